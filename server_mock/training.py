"""LoRA adapters on one shared base model: forward/backward with the named losses, AdamW, snapshots.

One ``ModelHost`` per base model. Every method here runs on that model's single worker thread (see
engine.py), so switching the active PEFT adapter between requests is safe without locks.
"""

from __future__ import annotations

import hashlib
import json
import math
import logging
import secrets
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from pytrio_compat.types import AdamParams
from pytrio_compat.wire import LoraSpec

from . import losses, model_support, prefix_sharing
from .errors import WorkerError, bad_request
from .model_loading import load_model_and_tokenizer

logger = logging.getLogger("server_mock")

LORA_ALPHA = 32  # fixed alpha: the effective scale is alpha / rank, as in most LoRA RL setups
MICRO_BATCH_TOKENS = 2048  # padded tokens per forward pass; bounds the (B, T, V) logits in memory
PREFIX_SHARE_MIN_TOKENS = 32


@dataclass(frozen=True)
class TrainOptions:
    """How forward/backward runs. bf16 autocast is 2-3x faster on CPUs with AVX-512 BF16 and on GPUs, but
    the trainer's logprobs then differ from the float32 sampler's by ~1e-2, so it is off unless asked for."""

    micro_batch_tokens: int = MICRO_BATCH_TOKENS
    autocast_bf16: bool = False
    activation_checkpointing: bool = False
    float32_head: bool = True  # the output head in float32 in the sampler and the trainer (see model_support)
    # datums of one call sharing at least this many leading tokens run them once (prefix_sharing.py); 0 = never
    prefix_share_min_tokens: int = PREFIX_SHARE_MIN_TOKENS


@dataclass
class Adapter:
    adapter_id: str
    spec: LoraSpec
    seed: int
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    optim_steps: int = 0  # optim_step calls
    param_steps: dict[str, int] = field(default_factory=dict)  # Adam steps per parameter (those with a gradient)
    version: int = 0  # bumped whenever the weights change


@dataclass
class Snapshot:
    """Adapter weights frozen at one moment, in PEFT's state-dict layout (adapter name removed)."""

    snapshot_id: str
    spec: LoraSpec
    target_modules: tuple[str, ...]
    tensors: dict[str, torch.Tensor]


def linear_groups(model: nn.Module) -> dict[str, str]:
    """Which LoRA switch covers each Linear layer: train_attn, train_mlp or train_unembed."""
    groups = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name.split(".")[-1] == "lm_head":
            groups[name] = "train_unembed"
        elif ".mlp." in name or "feed_forward" in name:
            groups[name] = "train_mlp"
        elif "attn" in name or "attention" in name:
            groups[name] = "train_attn"
    return groups


class ModelHost:
    def __init__(self, name: str, source: str, device: str, dtype: torch.dtype, max_seq_len: int | None = None,
                 options: TrainOptions = TrainOptions()):
        self.name = name
        self.options = options
        self.device = device
        self.dtype = dtype
        self.model, self.tokenizer, self.source_dir = load_model_and_tokenizer(source, device, dtype)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self._linear_groups = linear_groups(self.model)  # read before PEFT wraps the layers
        if not any(group != "train_unembed" for group in self._linear_groups.values()):
            raise model_support.refuse(self.model.config.model_type,
                                       "LoRA needs nn.Linear attention or MLP layers and this model has none")
        if options.float32_head:
            model_support.use_float32_head(self.model)
        self.sampling_support = model_support.probe_sampling(self.model, self.vocab_size)
        ctx = getattr(self.model.config, "max_position_embeddings", None)
        self.max_seq_len = min(x for x in (max_seq_len, ctx) if x) if (max_seq_len or ctx) else None
        if options.activation_checkpointing:
            # recompute activations in backward: memory falls with sequence length x layers, time rises ~30%
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.prefix_sharing = self._probe_prefix_sharing()
        self.peft = None
        self.adapters: dict[str, Adapter] = {}
        self._slots: dict[str, str] = {}  # sampler slot adapter name -> snapshot id loaded in it

    # --- adapters ---------------------------------------------------------------------------------

    def _lora_config(self, spec: LoraSpec):
        from peft import LoraConfig

        targets = [name for name, group in self._linear_groups.items() if getattr(spec, group)]
        if not targets:
            raise bad_request("lora", "no Linear layers match train_mlp/train_attn/train_unembed for this model")
        return LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                          bias="none"), tuple(targets)

    def _add_peft_adapter(self, name: str, spec: LoraSpec, seed: int) -> None:
        from peft import get_peft_model

        config, _ = self._lora_config(spec)
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
        for pname, param in adapter.params.items():
            param.data = param.data.float()  # master weights and Adam state in float32
            adapter.exp_avg[pname] = torch.zeros_like(param, dtype=torch.float32)
            adapter.exp_avg_sq[pname] = torch.zeros_like(param, dtype=torch.float32)
        self.adapters[adapter_id] = adapter
        return adapter

    def delete_adapter(self, adapter_id: str) -> None:
        self.adapters.pop(adapter_id, None)
        if self.peft is not None and adapter_id in self.peft.peft_config:
            self.peft.delete_adapter(adapter_id)

    def _activate(self, adapter: Adapter) -> None:
        self.peft.set_adapter(adapter.adapter_id)
        for param in adapter.params.values():
            param.requires_grad_(True)

    # --- forward / backward ---------------------------------------------------------------------------

    def forward_backward(self, adapter: Adapter, data: list[dict[str, np.ndarray]], loss_fn: str,
                         config: dict[str, float], backward: bool) -> dict:
        """Per-datum logprobs and losses; with ``backward`` the summed loss's gradient accumulates.

        If anything fails midway, the gradients accumulated before this call are restored, so a failed
        request leaves the adapter exactly as it was.
        """
        self._activate(adapter)
        saved = {n: (p.grad.clone() if p.grad is not None else None) for n, p in adapter.params.items()}
        try:
            return self._forward_backward(adapter, data, loss_fn, config, backward)
        except BaseException:
            for name, param in adapter.params.items():
                param.grad = saved[name]
            raise

    def _forward_backward(self, adapter: Adapter, data: list[dict[str, np.ndarray]], loss_fn: str,
                          config: dict[str, float], backward: bool) -> dict:
        results = _Results(data, loss_fn, config, self.device)
        lengths = [len(d["tokens"]) for d in data]
        budget = self.options.micro_batch_tokens
        groups = []
        if self.prefix_sharing:
            groups = prefix_sharing.find_groups([d["tokens"] for d in data], self.options.prefix_share_min_tokens)
        with torch.set_grad_enabled(backward):
            for batch in prefix_sharing.batch_groups(groups, budget):
                prompts = np.stack([data[g.members[0]]["tokens"][:batch.prefix_len] for g in batch.groups])
                shared = prefix_sharing.SharedPrefix(partial(self._logits, self.peft), self.model.config,
                                                     self._cache_kwarg, torch.from_numpy(prompts).to(self.device))
                for chunk in prefix_sharing.chunk_batch(batch, lengths, budget):
                    indices = [i for i, _ in chunk]
                    which = torch.tensor([row for _, row in chunk], device=self.device)
                    results.add(indices, self._shared_logprobs(shared, [data[i] for i in indices], which), backward)
                if backward:
                    shared.backward()
                del shared
            grouped = {i for g in groups for i in g.members}
            rest = [i for i in range(len(data)) if i not in grouped]
            for batch in _micro_batches([lengths[i] for i in rest], budget):
                batch = [rest[i] for i in batch]
                results.add(batch, self._target_logprobs([data[i] for i in batch]), backward)
        return results.summary()

    def _target_logprobs(self, rows: list[dict[str, np.ndarray]]) -> torch.Tensor:
        """float32 logprob of each target token, [B, T] (0 where the target is ignored or padding)."""
        ids, attention = _padded([r["tokens"] for r in rows], self.device)
        targets, _ = _padded([_targets(r) for r in rows], self.device)
        return token_logprobs(self._logits(self.peft, input_ids=ids, attention_mask=attention, use_cache=False),
                              targets)

    def _shared_logprobs(self, shared: prefix_sharing.SharedPrefix, rows: list[dict[str, np.ndarray]],
                         which: torch.Tensor) -> torch.Tensor:
        """Like ``_target_logprobs``, for rows that start with ``shared``'s prefixes (row i with prefix which[i])."""
        n = shared.prefix_len
        ids, attention = _padded([r["tokens"][n:] for r in rows], self.device)
        targets, _ = _padded([_targets(r)[n:] for r in rows], self.device)
        prefix_targets = torch.from_numpy(np.stack([_targets(r)[:n] for r in rows])).to(self.device)
        return torch.cat([token_logprobs(shared.logits, prefix_targets, which),
                          token_logprobs(shared.remainder_logits(ids, attention, which), targets)], dim=1)

    def _logits(self, model: nn.Module, **inputs) -> torch.Tensor:
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
        model_type = getattr(self.model.config, "model_type", type(self.model).__name__)
        self._cache_kwarg = prefix_sharing._cache_kwarg(self.model)
        if self.options.activation_checkpointing:
            # The shared path's caches store nothing and return the same states when a checkpointed layer is run
            # again in backward, so layers may keep their cache under checkpointing.
            for module in self.model.modules():
                if hasattr(module, "_can_checkpoint_with_cache"):
                    module._can_checkpoint_with_cache = True
        why_not = prefix_sharing.probe(self.model, partial(self._logits, self.model), token_logprobs,
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
        """AdamW, the same update as ``torch.optim.AdamW`` (decoupled decay), then gradients reset.

        As in torch, a parameter without a gradient is skipped: no decay, no moment update, and its own
        step count (which drives the bias correction) does not advance."""
        grads = {n: p.grad for n, p in adapter.params.items() if p.grad is not None}
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))
            grad_norm = float(norm)
        else:
            grad_norm = 0.0
        if not math.isfinite(grad_norm):
            raise WorkerError(422, "non_finite_gradient", "the accumulated gradient is not finite; nothing applied")
        scale = 1.0
        if adam.grad_clip_norm > 0 and grad_norm > adam.grad_clip_norm:
            scale = adam.grad_clip_norm / (grad_norm + 1e-6)
        adapter.optim_steps += 1
        lr, b1, b2, eps, wd = adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay
        with torch.no_grad():
            for name, grad in grads.items():
                param = adapter.params[name]
                if scale != 1.0:
                    grad = grad * scale
                step = adapter.param_steps.get(name, 0) + 1
                adapter.param_steps[name] = step
                m, v = adapter.exp_avg[name], adapter.exp_avg_sq[name]
                if wd:
                    param.mul_(1 - lr * wd)
                m.lerp_(grad, 1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
                param.addcdiv_(m, denom, value=-lr / (1 - b1**step))
                param.grad = None
        adapter.version += 1
        return {"grad_norm": grad_norm, "learning_rate": lr, "step": float(adapter.optim_steps)}

    # --- state ------------------------------------------------------------------------------------------

    def adapter_weights(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in
                get_peft_model_state_dict(self.peft, adapter_name=adapter.adapter_id,
                                          save_embedding_layers=False).items()}

    def load_adapter_weights(self, adapter: Adapter, tensors: dict[str, torch.Tensor]) -> None:
        expected = set(self.adapter_weights(adapter))
        if set(tensors) != expected:
            raise bad_request("path", "checkpoint tensors do not match this adapter's layout "
                                      f"({len(tensors)} vs {len(expected)} tensors)", code="checkpoint_mismatch")
        self._set_peft_weights(adapter.adapter_id, tensors)
        for param in adapter.params.values():
            param.grad = None
        adapter.version += 1

    def _set_peft_weights(self, adapter_name: str, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.peft, {k: v.to(self.device) for k, v in tensors.items()},
                                  adapter_name=adapter_name)

    def optimizer_state(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        """Adam moments and per-parameter step counts keyed by adapter-independent names, so a checkpoint
        resumes into any new run."""
        state = {}
        for name in adapter.params:
            key = _portable(name, adapter.adapter_id)
            state[f"exp_avg::{key}"] = adapter.exp_avg[name]
            state[f"exp_avg_sq::{key}"] = adapter.exp_avg_sq[name]
            state[f"step::{key}"] = torch.tensor([adapter.param_steps.get(name, 0)], dtype=torch.int64)
        state["optim_steps"] = torch.tensor([adapter.optim_steps], dtype=torch.int64)
        return state

    def load_optimizer_state(self, adapter: Adapter, state: dict[str, torch.Tensor] | None) -> None:
        """Restore Adam moments and step counts; ``None`` resets them (a fresh optimizer). Checkpoints from
        before per-parameter step counts give every parameter the adapter's step count."""
        keys = {name: _portable(name, adapter.adapter_id) for name in adapter.params}
        if state is not None:
            moments = {f"{kind}::{key}" for key in keys.values() for kind in ("exp_avg", "exp_avg_sq")}
            steps = {f"step::{key}" for key in keys.values()}
            if set(state) not in (moments | steps | {"optim_steps"}, moments | {"optim_steps"}):
                raise bad_request("path", "the checkpoint's optimizer state does not match this adapter's layout",
                                  code="checkpoint_mismatch")
        optim_steps = int(state["optim_steps"][0]) if state is not None else 0
        for name, param in adapter.params.items():
            key = keys[name]
            if state is None:
                adapter.exp_avg[name] = torch.zeros_like(param, dtype=torch.float32)
                adapter.exp_avg_sq[name] = torch.zeros_like(param, dtype=torch.float32)
                adapter.param_steps.pop(name, None)
            else:
                adapter.exp_avg[name] = state[f"exp_avg::{key}"].to(self.device, torch.float32).clone()
                adapter.exp_avg_sq[name] = state[f"exp_avg_sq::{key}"].to(self.device, torch.float32).clone()
                step = state.get(f"step::{key}")
                adapter.param_steps[name] = int(step[0]) if step is not None else optim_steps
        adapter.optim_steps = optim_steps

    def snapshot(self, adapter: Adapter) -> Snapshot:
        _, targets = self._lora_config(adapter.spec)
        tensors = self.adapter_weights(adapter)
        digest = hashlib.sha256(f"{adapter.adapter_id}:{adapter.version}:{secrets.token_hex(4)}".encode()).hexdigest()
        return Snapshot(digest[:16], adapter.spec, targets, tensors)

    def peft_adapter_config(self, spec: LoraSpec) -> str:
        config, _ = self._lora_config(spec)
        data = config.to_dict()
        data["base_model_name_or_path"] = self.name
        return json.dumps(data, indent=1, default=lambda o: sorted(o) if isinstance(o, set) else str(o))

    # --- sampling ---------------------------------------------------------------------------------------

    def sample_batch(self, snapshot: Snapshot | None, specs: list, timings: dict[str, float]) -> list:
        """Generate for every spec as one batch with the snapshot's weights (None: the base model); the time to
        load the weights goes in ``timings["load_weights"]``, prefill and decode times beside it."""
        from .sampling import generate_batch

        started = time.perf_counter()
        model = self.sampling_model(snapshot)
        timings["load_weights"] = time.perf_counter() - started
        return generate_batch(model, specs, self.tokenizer, timings, self.sampling_support)

    def sampling_model(self, snapshot: Snapshot | None) -> nn.Module:
        """The model to generate with: the base model, or a sampler slot holding the snapshot's weights.

        Slots are PEFT adapters reserved for sampling, one per LoRA layout; a slot is reloaded only when
        a different snapshot asks for it, so a GRPO step's many sample calls copy the weights once.
        """
        if snapshot is None:
            return _BaseOnly(self.peft) if self.peft is not None else self.model
        layout = hashlib.sha256(repr((snapshot.spec.rank, snapshot.target_modules)).encode()).hexdigest()[:12]
        slot = f"sampler-slot-{layout}"
        if self.peft is None or slot not in self.peft.peft_config:
            self._add_peft_adapter(slot, snapshot.spec, 0)
        if self._slots.get(slot) != snapshot.snapshot_id:
            self._set_peft_weights(slot, snapshot.tensors)
            self._slots[slot] = snapshot.snapshot_id
        self.peft.set_adapter(slot)
        return self.peft


class _BaseOnly(nn.Module):
    """Calls a PeftModel with every adapter disabled (the plain base model)."""

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        self.inner = peft_model

    def forward(self, *args, **kwargs):
        with self.inner.disable_adapter():
            return self.inner(*args, **kwargs)


def _portable(param_name: str, adapter_id: str) -> str:
    return param_name.replace(f".{adapter_id}.", ".")


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group datums of similar length so that (rows x longest) stays within the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = max([lengths[i] for i in current] + [lengths[index]])
        if current and longest * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 log-probability of each target token: logits [B, T, V], targets [B, T] -> [B, T]. With ``rows``,
    target row i reads logits row rows[i] (prefix logits shared by several datums, never copied per datum).
    No second (B, T, V) tensor in the forward pass."""
    logits = logits.float()
    norm = torch.logsumexp(logits, dim=-1)
    if rows is None:
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    positions = torch.arange(targets.shape[1], device=targets.device)
    return logits[rows[:, None], positions[None, :], targets] - norm[rows]


def _targets(datum: dict[str, np.ndarray]) -> np.ndarray:
    """The datum's target tokens with ignored positions (-100) pointing at token 0 (masked by the loss)."""
    t = datum["target_tokens"]
    return np.where(t == losses.IGNORE_INDEX, 0, t).astype(np.int64)


def _padded(rows: list[np.ndarray], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token rows [B, T] and their attention mask."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.long)
    attention = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        attention[i, :len(r)] = 1
    return ids.to(device), attention.to(device)


class _Results:
    """Per-datum losses, logprobs and the call's metrics, filled one micro-batch at a time."""

    def __init__(self, data: list[dict[str, np.ndarray]], loss_fn: str, config: dict[str, float], device: str):
        self.data, self.loss_fn, self.config, self.device = data, loss_fn, config, device
        self.outputs: list[dict[str, np.ndarray] | None] = [None] * len(data)
        self.loss_sum = 0.0
        self.token_count = 0

    def add(self, indices: list[int], logprobs: torch.Tensor, backward: bool) -> None:
        """Losses of the datums ``indices`` (row i of ``logprobs`` is datum indices[i]); backward of their sum."""
        total = None
        for row, index in enumerate(indices):
            datum = self.data[index]
            n = len(datum["tokens"])
            inputs = {k: torch.from_numpy(v).to(self.device) for k, v in datum.items() if k != "tokens"}
            result = losses.compute_loss(self.loss_fn, logprobs[row, :n], inputs, self.config)
            if not torch.isfinite(result.loss):
                raise WorkerError(422, "non_finite_loss",
                                  f"data[{index}]: the loss is not finite; check logprobs/advantages", "data")
            total = result.loss if total is None else total + result.loss
            self.loss_sum += float(result.loss.detach())
            self.token_count += result.token_count
            mask = inputs["target_tokens"] != losses.IGNORE_INDEX
            lp = torch.where(mask, logprobs[row, :n].detach(), torch.zeros_like(logprobs[row, :n]))
            self.outputs[index] = {"logprobs": lp.float().cpu().numpy(),
                                   "elementwise_loss": result.elementwise.float().cpu().numpy()}
        if backward and total is not None and total.requires_grad:
            total.backward()

    def summary(self) -> dict:
        metrics = {
            "loss_sum": self.loss_sum,
            "loss_mean": self.loss_sum / self.token_count if self.token_count else 0.0,
            "token_count": float(self.token_count),
            "loss:sum": self.loss_sum,
        }
        return {"outputs": self.outputs, "metrics": metrics}
