"""``ModelHost``: what the service may ask of one served base model, wherever the model runs.

Two implementations: ``LocalModelHost`` (engine/local_host.py, the model in this process) and
``RemoteModelHost`` (cluster/remote_host.py, the model on Ray actors). The service holds hosts only through
this protocol, so nothing above the engine reaches into PEFT or a model's modules. Every method that touches
the model runs on the model's queue thread (engine/queue.py); the attributes are fixed once the host exists.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pytrio_compat.wire import AdamParams, LoraSpec
from server_mock.config import TrainOptions
from server_mock.lora import Layer, Snapshot, lora_config, model_layout, peft_adapter_config, ties_head


class ModelHost(Protocol):
    name: str
    device: str
    options: TrainOptions
    tokenizer: Any
    source_dir: str  # the folder the model was loaded from
    vocab_size: int
    max_seq_len: int | None
    vision: Any  # engine.vision.ImageProcessing of an image-text model; None for a text-only one
    vision_refusal: str | None  # why an image-text model takes no images (None: it takes them)
    # whether sample requests of one mix key (other adapters of the base model) are batched together, whatever
    # their weights, into one ``sample_mixed`` call: a host that decodes each batch in one go and can mix adapters
    # in it (the Ray replicas); the local host mixes inside its decode sessions instead (False)
    mixed_batches: bool

    @property
    def model_type(self) -> str:
        """The transformers ``model_type`` (e.g. ``qwen3``)."""

    @property
    def tied_head(self) -> bool:
        """Whether the output head shares the input embedding matrix (``lora.ties_head``)."""

    def stop_token_ids(self) -> list[int]:
        """The ids that end a turn when a sample request names none."""

    def lora_layout(self) -> dict[str, Layer]:
        """Every LoRA-able Linear layer, by name."""

    def lora_targets(self, spec: LoraSpec) -> tuple[str, ...]:
        """The layers a LoRA of ``spec`` covers."""

    def peft_adapter_config(self, spec: LoraSpec) -> str:
        """``adapter_config.json`` for a saved adapter of ``spec``."""

    # --- a run's adapter (the returned object is opaque to callers but for ``seed`` and ``optim_steps``)

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> Any: ...

    def drop_adapter(self, adapter_id: str) -> None: ...

    def forward_backward(self, adapter: Any, data: list[dict], loss_fn: str, config: dict[str, float],
                         backward: bool, loss_scale: float = 1.0) -> dict:
        """Per-datum outputs (numpy arrays) and the call's metrics; with ``backward`` the gradient of the summed loss
        times ``loss_scale`` accumulates (the metrics are unscaled)."""

    def optim_step(self, adapter: Any, adam: AdamParams) -> dict[str, float]: ...

    def adapter_weights(self, adapter: Any) -> dict[str, torch.Tensor]: ...

    def load_adapter_weights(self, adapter: Any, tensors: dict[str, torch.Tensor]) -> None: ...

    def optimizer_state(self, adapter: Any) -> dict[str, torch.Tensor]: ...

    def load_optimizer_state(self, adapter: Any, state: dict[str, torch.Tensor] | None) -> None: ...

    def snapshot(self, adapter: Any) -> Snapshot: ...

    # --- sampling

    def sample_batch(self, snapshot: Snapshot | None, specs: list, timings: dict[str, float]) -> list:
        """Generate for every ``SampleSpec`` as one batch with the snapshot's weights (None: the base model)."""

    def sample_mixed(self, requests: list[tuple[Snapshot | None, Any]], timings: dict[str, float]) -> list:
        """Generate for ``(snapshot, spec)`` requests of one or several sets of weights as one batch (rows of
        different adapters decoding together where the host can mix them); the results in request order."""

    def sampling_session(self, snapshot: Snapshot | None, defer: bool = False) -> Any | None:
        """A resumable decode batch for these weights (engine/sampling_session.py), which the model queue runs in
        slices and adds requests to while it decodes; None where the host decodes a batch in one go. ``defer``:
        its model is chosen when its first requests come (by whether they are of several adapters)."""


class ModelFacts:
    """What both hosts read from the model's module tree alone (the Ray front end holds it on the ``meta`` device):
    its type, whether it ties its head, stop ids and LoRA layout. Needs ``name``, ``model``, ``tokenizer`` and
    ``_linear_groups`` (``lora.linear_groups`` of the model before PEFT wraps it)."""

    name: str
    model: Any
    tokenizer: Any
    _linear_groups: dict[str, str]

    @property
    def model_type(self) -> str:
        return getattr(self.model.config, "model_type", type(self.model).__name__)

    @property
    def tied_head(self) -> bool:
        return ties_head(self.model)

    def stop_token_ids(self) -> list[int]:
        return default_stop_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    def lora_layout(self) -> dict[str, Layer]:
        return model_layout(self.model, self._linear_groups)

    def lora_targets(self, spec: LoraSpec) -> tuple[str, ...]:
        return lora_config(self._linear_groups, spec)[1]

    def peft_adapter_config(self, spec: LoraSpec) -> str:
        return peft_adapter_config(self.name, self._linear_groups, spec)


def default_stop_ids(tokenizer, generation_config) -> list[int]:
    """EOS of the tokenizer and of the generation config (stop=None means: stop at end of turn)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(x) for x in gen_eos)
    return sorted(ids)
