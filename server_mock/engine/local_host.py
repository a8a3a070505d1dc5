"""``LocalModelHost``: one base model in this process, with its LoRA adapters (PEFT), forward/backward with the
named losses (training/forward_backward.py), AdamW (training/adamw.py), snapshots and sampling.

Every method runs on the model's single worker thread (engine/queue.py), so switching the active PEFT adapter
between requests is safe without locks. The service sees it through the ``ModelHost`` protocol (engine/host.py).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Generator
from functools import partial

import numpy as np
import torch
from torch import nn

from pytrio_compat.wire import AdamParams, LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine import support
from server_mock.engine.host import ModelFacts
from server_mock.engine.loading import load_model_and_tokenizer
from server_mock.engine.adapter_pool import AdapterPool
from server_mock.engine.merged_lora import MergedDecoder, merged_bytes
from server_mock.engine.mixed_lora import MixedLoraDecoder
from server_mock.engine.sampling_session import SamplingSession, weights_tag
from server_mock.engine.vision import ImageProcessing, batch_image_inputs, is_image_text, load_image_processing
from server_mock.engine.vision_probe import probe_image_decoding
from server_mock.errors import bad_request
from server_mock.lora import Adapter, Snapshot, align_adapter_keys, linear_groups, lora_config
from server_mock.sampling.generate import generate_batch
from server_mock.sampling.prefix_store import PrefixStore
from server_mock.sampling.static_steps import StaticSteps
from server_mock.training import adamw, prefix_cache, prefix_sharing
from server_mock.training.forward_backward import TrainModel, forward_backward_steps, token_logprobs

logger = logging.getLogger("server_mock")


class LocalModelHost(ModelFacts):
    """A base model loaded in this process (see the module docstring)."""

    mixed_batches = False  # the model queue's decode sessions mix adapters (``sampling_session``)

    def __init__(self, name: str, source: str, device: str, dtype: torch.dtype, max_seq_len: int | None = None,
                 options: TrainOptions | None = None):
        options = options or TrainOptions()
        self.name = name
        self.options = options
        self.device = device
        self.dtype = dtype
        self.model, self.tokenizer, self.source_dir = load_model_and_tokenizer(source, device, dtype)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        # read before PEFT wraps the layers; an image-text model's vision tower only when asked
        self._linear_groups = linear_groups(self.model, vision_tower=options.lora_vision_tower)
        if not any(group != "train_unembed" for group in self._linear_groups.values()):
            raise support.refuse(self.model.config.model_type,
                                       "LoRA needs nn.Linear attention or MLP layers and this model has none")
        if options.float32_head:
            support.use_float32_head(self.model)
        self.sampling_support = support.probe_sampling(self.model, self.vocab_size)
        self.vision, self.vision_refusal = self._load_vision()
        ctx = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.max_seq_len = min(x for x in (max_seq_len, ctx) if x) if (max_seq_len or ctx) else None
        if options.activation_checkpointing:
            # recompute activations in backward: memory falls with sequence length x layers, time rises ~30%
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.cache_kwarg = prefix_cache.cache_kwarg(self.model)
        self.prefix_sharing = self._probe_prefix_sharing()
        self.peft = None
        self._active: str | None = None  # the adapter this host last made active (``_set_active``)
        self.adapters: dict[str, Adapter] = {}
        self._slots: dict[str, str] = {}  # sampler slot adapter name -> snapshot id loaded in it
        self._base_only: _BaseOnly | None = None
        self._merged: dict[str, tuple[MergedDecoder, int]] = {}  # snapshot id -> merged decoder, its bytes
        self._static: dict[int, tuple[nn.Module, StaticSteps]] = {}  # by sampling model
        self.adapter_pool = (AdapterPool(options.adapter_pool_bytes, dtype, device)
                             if options.adapter_pool_bytes > 0 else None)
        self.batch_invariant = options.batch_invariant and self.adapter_pool is not None
        self.prefix_store = self._prefix_store()
        self.decode_profile: dict[str, float] | None = None  # seconds per decode phase, where a benchmark asks

    def _prefix_store(self) -> PrefixStore | None:
        """The prompt-prefix caches of this model's sampling (``--prefix-cache-bytes``), where reusing them is exact:
        a full-attention text model (the probe's ``prefix_reuse``), and not under ``--batch-invariant`` (whose
        results must not depend on what other requests left behind)."""
        budget = self.options.prefix_cache_bytes
        if budget < 0:
            raise ValueError("prefix_cache_bytes must be >= 0 (0 turns prefix reuse off)")
        if budget == 0 or not self.sampling_support.prefix_reuse or self.batch_invariant or self.vision is not None:
            return None
        return PrefixStore(budget)

    def _load_vision(self) -> tuple[ImageProcessing | None, str | None]:
        """An image-text model's image processing, and why images cannot be served on it (None: they can)."""
        if not is_image_text(self.model.config):
            return None, None
        vision = load_image_processing(self.model, self.source_dir, self.tokenizer)
        why_not = probe_image_decoding(self.model, vision, self.vocab_size)
        if why_not:
            logger.warning("model type %s: image inputs are refused (%s); text is served as usual", self.model_type,
                           why_not)
        else:
            logger.info("model type %s: an image-text model (%s); images are taken, the vision tower is %s",
                        self.model_type, type(self.model).__name__,
                        "adapted by LoRA" if self.options.lora_vision_tower else "frozen")
        return vision, why_not

    # --- adapters ---------------------------------------------------------------------------------

    def _lora_config(self, spec: LoraSpec):
        return lora_config(self._linear_groups, spec)

    def _add_peft_adapter(self, name: str, spec: LoraSpec, seed: int) -> None:
        from peft import get_peft_model

        config, _ = self._lora_config(spec)
        self._active = None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.model, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        self.peft.eval()

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> Adapter:
        seed = spec.seed if spec.seed is not None else secrets.randbits(31)
        self._add_peft_adapter(adapter_id, spec, seed)
        adapter = Adapter(adapter_id, spec, seed)
        marker = f".{adapter_id}."
        for pname, param in self.peft.named_parameters():
            if marker in pname:
                adapter.params[pname] = param
        adapter.params = dict(sorted(adapter.params.items()))
        for param in adapter.params.values():
            param.data = param.data.float()  # master weights and Adam state in float32
        adapter.optimizer = adamw.new_optimizer(list(adapter.params.values()))
        self.adapters[adapter_id] = adapter
        return adapter

    def drop_adapter(self, adapter_id: str) -> None:
        """Forget a run's adapter: its gradients, and its PEFT layers once that is safe."""
        adapter = self.adapters.pop(adapter_id, None)
        if adapter is not None:
            for param in adapter.params.values():
                param.grad = None
        if self.peft is None:
            return
        names = list(self.peft.peft_config)
        unused = [name for name in names if name.startswith("run-") and name not in self.adapters]
        if len(unused) == len(names):
            # PEFT cannot drop its last adapter cleanly (disabling adapters, as base-model sampling does,
            # then fails on the missing name): one stays, unused, until another adapter exists
            unused = unused[1:]
        for name in unused:
            self._active = None
            self.peft.delete_adapter(name)

    def _activate(self, adapter: Adapter) -> None:
        self._set_active(adapter.adapter_id)
        for param in adapter.params.values():
            param.requires_grad_(True)

    def _set_active(self, name: str) -> None:
        """Make ``name`` PEFT's active adapter, unless this host made it so and no adapter was added or deleted
        since: PEFT's ``set_adapter`` visits every LoRA layer (a few ms on a small model), and a run's slices, or
        a sampler's requests, in a row ask for the same one. A decode on a merged copy or on the base model
        leaves the active adapter as it was; an adapter added or deleted may change a layer's, so it clears
        ``_active``. The other adapters' parameters, frozen or not, are not in the active adapter's forward."""
        if self._active != name or self.peft.active_adapters != [name]:
            self.peft.set_adapter(name)
            self._active = name

    # --- forward / backward ---------------------------------------------------------------------------

    def forward_backward(self, adapter: Adapter, data: list[dict[str, np.ndarray]], loss_fn: str,
                         config: dict[str, float], backward: bool, loss_scale: float = 1.0) -> dict:
        """Per-datum logprobs and losses; with ``backward`` the gradient of the summed loss (times ``loss_scale``)
        accumulates.

        If anything fails midway, the gradients accumulated before this call are restored, so a failed
        request leaves the adapter exactly as it was.
        """
        steps = self.forward_backward_steps(adapter, data, loss_fn, config, backward, loss_scale)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    def forward_backward_steps(self, adapter: Adapter, data: list[dict[str, np.ndarray]], loss_fn: str,
                               config: dict[str, float], backward: bool,
                               loss_scale: float = 1.0) -> Generator[int, None, dict]:
        """``forward_backward`` in parts (training/forward_backward.py ``forward_backward_steps``): yields the datum
        tokens of each part, and makes the adapter active again before the next, since other runs' work may run
        in between. A failure, or the generator closed before its end, restores the gradients of before the call.
        """
        self._activate(adapter)
        saved = {n: (p.grad.clone() if p.grad is not None else None) for n, p in adapter.params.items()}
        model = TrainModel(partial(self.logits, self.peft), self.model.config, self.cache_kwarg, self.device,
                           self.options.micro_batch_tokens,
                           self.options.prefix_share_min_tokens if self.prefix_sharing else 0,
                           reference_logits=partial(self.logits, _BaseOnly(self.peft)),
                           vision=self.vision, image_inputs=batch_image_inputs)
        steps = forward_backward_steps(model, data, loss_fn, config, backward, loss_scale)
        try:
            while True:
                try:
                    tokens = next(steps)
                except StopIteration as end:
                    return end.value
                yield tokens
                self._activate(adapter)
        except BaseException:
            for name, param in adapter.params.items():
                param.grad = saved[name]
            raise

    def logits(self, model: nn.Module, **inputs) -> torch.Tensor:
        """The model's logits for ``inputs``, under the configured autocast and activation checkpointing."""
        checkpointing = self.options.activation_checkpointing and torch.is_grad_enabled()
        if checkpointing:
            model.train()  # transformers only checkpoints in train mode; LoRA dropout is 0 here
        try:
            with torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16,
                                enabled=self.options.autocast_bf16):
                return model(**inputs).logits
        finally:
            if checkpointing:
                model.eval()

    def _probe_prefix_sharing(self) -> bool:
        """Whether forward/backward may share prefixes on this model: decided once, on a few random tokens."""
        if self.options.prefix_share_min_tokens <= 0:
            return False
        model_type = self.model_type
        if self.options.activation_checkpointing:
            # The shared path's caches store nothing and return the same states when a checkpointed layer is run
            # again in backward, so layers may keep their cache under checkpointing.
            for module in self.model.modules():
                if hasattr(module, "_can_checkpoint_with_cache"):
                    module._can_checkpoint_with_cache = True
        why_not = prefix_sharing.probe(self.model, partial(self.logits, self.model), token_logprobs,
                                       self.vocab_size, half_precision=self.options.autocast_bf16)
        if why_not:
            logger.warning("model type %s: forward/backward does not share prompt prefixes (%s); every datum runs "
                           "its full sequence (correct, slower)", model_type, why_not)
            return False
        logger.info("model type %s: forward/backward runs prefixes shared by >= %d tokens once", model_type,
                    self.options.prefix_share_min_tokens)
        return True

    # --- optimizer --------------------------------------------------------------------------------------

    def optim_step(self, adapter: Adapter, adam: AdamParams) -> dict[str, float]:
        """AdamW, the same update as ``torch.optim.AdamW`` (adamw.py), then gradients reset."""
        return adamw.optim_step(adapter, adam)

    # --- state ------------------------------------------------------------------------------------------

    def adapter_weights(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in
                get_peft_model_state_dict(self.peft, adapter_name=adapter.adapter_id,
                                          save_embedding_layers=False).items()}

    def load_adapter_weights(self, adapter: Adapter, tensors: dict[str, torch.Tensor]) -> None:
        current = self.adapter_weights(adapter)
        expected = set(current)
        tensors = align_adapter_keys(tensors, expected)  # saved on the causal-LM layout of an image-text model
        if set(tensors) != expected:
            raise bad_request("path", "checkpoint tensors do not match this adapter's layout "
                                      f"({len(tensors)} vs {len(expected)} tensors)", code="checkpoint_mismatch")
        wrong = next((k for k, v in tensors.items() if tuple(v.shape) != tuple(current[k].shape)), None)
        if wrong is not None:
            raise bad_request("path", f"checkpoint tensor {wrong} has shape {tuple(tensors[wrong].shape)}, this "
                                      f"adapter's has {tuple(current[wrong].shape)}", code="checkpoint_mismatch")
        self._set_peft_weights(adapter.adapter_id, tensors)
        for param in adapter.params.values():
            param.grad = None
        adapter.version += 1

    def _set_peft_weights(self, adapter_name: str, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.peft, {k: v.to(self.device) for k, v in tensors.items()},
                                  adapter_name=adapter_name)

    def optimizer_state(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        return adamw.optimizer_state(adapter)

    def load_optimizer_state(self, adapter: Adapter, state: dict[str, torch.Tensor] | None) -> None:
        adamw.load_optimizer_state(adapter, state, self.device)

    def snapshot(self, adapter: Adapter) -> Snapshot:
        targets = self.lora_targets(adapter.spec)
        tensors = self.adapter_weights(adapter)
        digest = hashlib.sha256(f"{adapter.adapter_id}:{adapter.version}:{secrets.token_hex(4)}".encode()).hexdigest()
        return Snapshot(digest[:16], adapter.spec, targets, tensors)

    # --- sampling ---------------------------------------------------------------------------------------

    def sample_batch(self, snapshot: Snapshot | None, specs: list, timings: dict[str, float]) -> list:
        """Generate for every spec as one batch with the snapshot's weights (None: the base model); the time to
        load the weights goes in ``timings["load_weights"]``, prefill and decode times beside it."""
        started = time.perf_counter()
        model = self.decode_model(snapshot)
        timings["load_weights"] = time.perf_counter() - started
        return generate_batch(model, specs, self.tokenizer, timings, self.sampling_support, self.static_steps(model),
                              vision=self.vision)

    def sample_mixed(self, requests: list[tuple[Snapshot | None, object]], timings: dict[str, float]) -> list:
        """Generate for ``(snapshot, spec)`` requests, of one or several sets of weights, as one batch; the results
        in request order, the batch's timings in ``timings``. Requests of one set of weights run ``sample_batch``
        (its merged copy: faster for a lone adapter), unless ``--batch-invariant``; requests of several decode on one
        ``SamplingSession`` prefilled together (``add_many``), on the mixed decoder, as the model queue's mixed
        batches do. A host that cannot mix (no adapter pool) runs each set of weights as a batch of its own."""
        by_weights: dict[str, list[int]] = {}
        for i, (snapshot, _) in enumerate(requests):
            by_weights.setdefault(weights_tag(snapshot), []).append(i)
        if not self.can_mix or (len(by_weights) == 1 and not self.batch_invariant):
            results: list = [None] * len(requests)
            for indices in by_weights.values():
                part: dict[str, float] = {}
                got = self.sample_batch(requests[indices[0]][0], [requests[i][1] for i in indices], part)
                for i, result in zip(indices, got):
                    results[i] = result
                for key, seconds in part.items():  # one batch after another: their times add up
                    timings[key] = timings.get(key, 0.0) + seconds
            return results
        session = SamplingSession(self, requests[0][0], defer=True)
        handles = session.add_many([(spec, snapshot) for snapshot, spec in requests])
        done: dict[int, object] = {}
        prefill = decode = 0.0
        while session.active:
            for handle, result, seconds in session.run(lambda: False):
                done[handle] = result
                prefill, decode = max(prefill, seconds["prefill"]), max(decode, seconds["decode"])
        timings.update(load_weights=session.load_weights_s, prefill=prefill, decode=decode)
        return [done[handle] for handle in handles]

    def forget_snapshot(self, snapshot_id: str) -> None:
        """Drop what this host derived from a snapshot its holder no longer keeps: its adapter pool entry and
        its merged copy (a sampler slot keeps its weights until another snapshot takes it)."""
        if self.adapter_pool is not None:
            self.adapter_pool.drop(snapshot_id)
        self._merged.pop(snapshot_id, None)

    def sampling_session(self, snapshot: Snapshot | None, defer: bool = False) -> SamplingSession:
        """A decode batch for these weights that the model queue runs in slices and adds requests to (``defer``:
        its model chosen by its first requests, ``SamplingSession``)."""
        return SamplingSession(self, snapshot, defer)

    @property
    def can_mix(self) -> bool:
        """Whether a decode batch may hold rows of different adapters (``mixed_decoder``)."""
        return self.adapter_pool is not None and self.sampling_support.padded_batch

    def mixed_decoder(self) -> MixedLoraDecoder:
        """A decoder for one batch whose rows use different adapters (engine/mixed_lora.py), its adapters from
        the host's ``adapter_pool``."""
        return MixedLoraDecoder(self.model, list(self._linear_groups), self.adapter_pool, self.batch_invariant)

    def static_steps(self, model: nn.Module) -> StaticSteps | None:
        """The fixed-shape (CUDA graph) decode steps of a sampling model, kept per model: None unless
        ``--decode-graphs on``."""
        if not self.options.decode_graphs:
            return None
        if id(model) not in self._static:
            self._static[id(model)] = (model, StaticSteps(model, compile=True))
        return self._static[id(model)][1]

    @staticmethod
    def _slot_name(snapshot: Snapshot) -> str:
        layout = hashlib.sha256(repr((snapshot.spec.rank, snapshot.target_modules)).encode()).hexdigest()[:12]
        return f"sampler-slot-{layout}"

    def decode_model(self, snapshot: Snapshot | None) -> nn.Module:
        """The model a decode runs on: for a snapshot of a float32 model, its LoRA merged into a copy of the
        adapted weights (engine/merged_lora.py) while the merged copies fit ``--merge-lora-bytes``; otherwise
        ``sampling_model``. Merged copies are kept per snapshot, the least recently used dropped first."""
        budget = self.options.merge_lora_bytes
        if snapshot is None or self.dtype != torch.float32 or budget <= 0:
            return self.sampling_model(snapshot)
        merged = self._merged.pop(snapshot.snapshot_id, None)
        if merged is None:
            model = self.sampling_model(snapshot)  # the slot holds the snapshot's LoRA: merge it from there
            size = merged_bytes(self.peft, self._slot_name(snapshot))
            if size > budget:
                return model
            while self._merged and size + sum(m[1] for m in self._merged.values()) > budget:
                self._merged.pop(next(iter(self._merged)))
            merged = (MergedDecoder(self.peft, self._slot_name(snapshot)), size)
        self._merged[snapshot.snapshot_id] = merged  # most recently used last
        return merged[0]

    def sampling_model(self, snapshot: Snapshot | None) -> nn.Module:
        """The model to generate with: the base model, or a sampler slot holding the snapshot's weights.

        Slots are PEFT adapters reserved for sampling, one per LoRA layout; a slot is reloaded only when
        a different snapshot asks for it, so a GRPO step's many sample calls copy the weights once.
        """
        if snapshot is None:
            if self.peft is None:
                return self.model
            if self._base_only is None or self._base_only.inner is not self.peft:
                self._base_only = _BaseOnly(self.peft)
            return self._base_only
        slot = self._slot_name(snapshot)
        if self.peft is None or slot not in self.peft.peft_config:
            self._add_peft_adapter(slot, snapshot.spec, 0)
        if self._slots.get(slot) != snapshot.snapshot_id:
            self._set_peft_weights(slot, snapshot.tensors)
            self._slots[slot] = snapshot.snapshot_id
        self._set_active(slot)
        return self.peft


class _BaseOnly(nn.Module):
    """Calls a PeftModel with every adapter disabled (the plain base model)."""

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        self.inner = peft_model

    def forward(self, *args, **kwargs):
        with self.inner.disable_adapter():
            return self.inner(*args, **kwargs)
