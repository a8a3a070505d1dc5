"""The LoRA vocabulary every layer shares: adapters, frozen snapshots of their weights, which Linear layers a
LoRA covers, and PEFT's configuration for them.

A LoRA here is PEFT's: ``lora_A`` (rank x in) and ``lora_B`` (out x rank) on each covered ``nn.Linear``, scaled
by ``LORA_ALPHA / rank``. The layers are grouped by the three switches of a ``LoraSpec`` (attention, MLP, the
output head), decided from the module tree alone, so the in-process host and the Ray front end (which holds
the model on the ``meta`` device) agree on the layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn

from pytrio_compat.wire import LoraSpec
from server_mock.errors import bad_request

LORA_ALPHA = 32  # fixed alpha: the effective scale is alpha / rank, as in most LoRA RL setups


@dataclass
class Adapter:
    """A run's LoRA: its parameters (float32 master weights) and their AdamW (``training/adamw.py``)."""

    adapter_id: str
    spec: LoraSpec
    seed: int
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    optim_steps: int = 0  # optim_step calls
    version: int = 0  # bumped whenever the weights change

    @property
    def param_steps(self) -> dict[str, int]:
        """Adam steps per parameter (those that had a gradient), as the optimizer counts them."""
        state = self.optimizer.state if self.optimizer is not None else {}
        return {name: int(state[p]["step"]) for name, p in self.params.items() if p in state}


@dataclass
class Snapshot:
    """Adapter weights frozen at one moment, in PEFT's state-dict layout (adapter name removed)."""

    snapshot_id: str
    spec: LoraSpec
    target_modules: tuple[str, ...]
    tensors: dict[str, torch.Tensor]


def linear_groups(model: nn.Module, vision_tower: bool = False) -> dict[str, str]:
    """Which LoRA switch covers each Linear layer: train_attn, train_mlp or train_unembed.

    In an image-text model the layers outside the language model (the vision tower and its projector into the
    text embedding space) belong to no group, so a LoRA adapts the language model only and the vision tower
    stays frozen, unless ``vision_tower``: then its attention layers join train_attn and all its other Linear
    layers (MLPs, the projector) train_mlp.
    """
    vision = _vision_modules(model)
    groups = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        in_vision = any(name == v or name.startswith(v + ".") for v in vision)
        if in_vision and not vision_tower:
            continue
        if name.split(".")[-1] == "lm_head":
            groups[name] = "train_unembed"
        elif ".mlp." in name or "feed_forward" in name:
            groups[name] = "train_mlp"
        elif "attn" in name or "attention" in name:
            groups[name] = "train_attn"
        elif in_vision:
            groups[name] = "train_mlp"
    return groups


def _vision_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of an image-text model's modules beside its language model (vision tower, projector); none for a
    model without a vision config. Found from the module tree: the siblings of the text decoder."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None or not hasattr(model, "get_decoder"):
        return ()
    decoder = model.get_decoder()
    names = {id(module): name for name, module in model.named_modules()}
    decoder_name = names.get(id(decoder))
    if not decoder_name:
        return ()
    parent_name = decoder_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    prefix = parent_name + "." if parent_name else ""
    return tuple(prefix + child for child, module in parent.named_children()
                 if module is not decoder and any(isinstance(m, nn.Linear) for m in module.modules()))
def ties_head(model: nn.Module) -> bool:
    """Whether the output head shares its weight matrix with the input embeddings (``tie_word_embeddings``).
    A LoRA on ``lm_head`` of such a model changes the output projection only; the embeddings stay as they are."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embeddings is not None and head.weight is embeddings.weight


@dataclass(frozen=True)
class Layer:
    group: str  # train_attn / train_mlp / train_unembed
    in_features: int
    out_features: int


def model_layout(model: nn.Module, groups: dict[str, str]) -> dict[str, Layer]:
    """Every LoRA-able Linear layer of the base model, by name (``groups`` from ``linear_groups``; run on the
    model's thread: PEFT may have wrapped the layers, whose base layer then holds the shape)."""
    layout = {}
    for name, group in groups.items():
        module = model.get_submodule(name)
        base = getattr(module, "base_layer", module)
        layout[name] = Layer(group, int(base.in_features), int(base.out_features))
    return layout


# What a training run's adapter holds per LoRA parameter: float32 weights, their gradient, and AdamW's two moments
BYTES_PER_TRAINED_PARAM = 16


def adapter_parameters(layout: dict[str, Layer], targets: tuple[str, ...], rank: int) -> int:
    """The parameters of a LoRA of ``rank`` on the ``targets`` layers of a model (``layout``: ``model_layout``):
    ``lora_A`` is rank x in, ``lora_B`` out x rank."""
    return sum(rank * (layout[name].in_features + layout[name].out_features) for name in targets)


def lora_config(groups: dict[str, str], spec: LoraSpec):
    """PEFT's ``LoraConfig`` for ``spec`` on a model whose Linear layers are grouped as ``groups``, and the
    target layer names."""
    from peft import LoraConfig

    targets = [name for name, group in groups.items() if getattr(spec, group)]
    if not targets:
        raise bad_request("lora", "no Linear layers match train_mlp/train_attn/train_unembed for this model")
    return LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                      bias="none"), tuple(targets)


def peft_adapter_config(model_name: str, groups: dict[str, str], spec: LoraSpec) -> str:
    """The ``adapter_config.json`` of a saved adapter: PEFT's config, naming the base model it was trained on."""
    config, _ = lora_config(groups, spec)
    data = config.to_dict()
    data["base_model_name_or_path"] = model_name
    return json.dumps(data, indent=1, default=lambda o: sorted(o) if isinstance(o, set) else str(o))
