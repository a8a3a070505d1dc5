"""Folding a LoRA adapter into its base model: a complete Hugging Face model folder, shard by shard.

For every layer the adapter trains, ``W' = W + scale * B @ A`` is computed in float32 and stored in the
dtype the base model's checkpoint holds that tensor in; every other tensor is copied unchanged, so the folder
keeps the base model's shards, names and index. The config, tokenizer, chat template and generation config
come along (a generation config is written from the model config when the base has none). Only one shard is
in memory at a time. The base model is read from safetensors only. Image-text models (Qwen3.5, Qwen2.5-VL,
Qwen3-VL, Gemma 3, LLaVA checkpoints with a vision tower) store their tensors under other names than their
modules, so they are loaded whole by transformers, merged in place and saved by it instead.

Tied embeddings: when the base model shares its output head with the input embeddings (SmolLM2, Qwen3 up
to 4B, Llama 3.2, Gemma 3 ...) and the adapter trains the head (``lm_head``), the trained model computes
``logits = h @ (E + scale * B @ A)^T`` while its input embeddings stay ``E``. Folding the delta into the
shared matrix would move the embeddings too and give another model, so the merge unties the head: it writes
``lm_head.weight = E + scale * B @ A`` as a tensor of its own and sets ``tie_word_embeddings: false``. A head
named ``model.unembed_tokens`` (Tinker's name) on a tied model is refused: such an adapter does not say
whether it meant the output head alone or the shared matrix.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from .adapter import TINKER_HEAD, Adapter, ExportError, read_adapter

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
INDEX = "model.safetensors.index.json"


def merge(base_dir: Path, adapter_dir: Path, out_dir: Path, *, overwrite: bool = False) -> dict:
    """Write the merged model of ``base_dir`` + ``adapter_dir`` to ``out_dir``; a summary of what was done."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    adapter = read_adapter(Path(adapter_dir))
    if not (base_dir / "config.json").is_file():
        raise ExportError(f"{base_dir} is not a Hugging Face model folder (no config.json)")
    if out_dir.exists() and not overwrite:
        raise ExportError(f"{out_dir} already exists: choose another folder or pass --overwrite")
    image_text = "vision_config" in json.loads((base_dir / "config.json").read_text())
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    tmp.mkdir(parents=True)
    try:
        write = _merge_loaded if image_text else _merge_shards
        untied, layers, dtypes = write(base_dir, adapter, tmp)
        for item in base_dir.iterdir():  # tokenizer, chat template, processor and generation configs
            if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not (tmp / item.name).exists():
                shutil.copy2(item, tmp / item.name)
        if not (tmp / "generation_config.json").exists():
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp)).save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out_dir), "layers": layers, "rank": adapter.rank, "scale": adapter.scale,
            "untied_head": untied, "dtypes": sorted(dtypes),
            "tokenizer": any((out_dir / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))}


def _merge_shards(base_dir: Path, adapter: Adapter, tmp: Path) -> tuple[bool, int, set[str]]:
    """The merge of a text model, one stored shard at a time (its tensors are stored under their module names)."""
    import torch
    from safetensors.torch import load_file, save_file

    shards, weight_map, index = _base_weights(base_dir)
    plan = _plan(adapter, _layout(base_dir), weight_map)
    dtypes: set[str] = set()
    for shard in shards:
        tensors = load_file(str(base_dir / shard))
        for key in list(tensors):
            dtypes.add(str(tensors[key].dtype).removeprefix("torch."))
            if key in plan.deltas:
                tensors[key] = _fold(tensors[key], *plan.deltas[key], adapter.scale, torch)
        if plan.untie is not None and weight_map[plan.untie.source] == shard:
            tensors[plan.untie.head] = _fold(tensors[plan.untie.source], *plan.untie.pair, adapter.scale, torch)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / shard), metadata={"format": "pt"})
        del tensors
    if index is not None:
        index = dict(index)
        index["weight_map"] = dict(index["weight_map"])
        if plan.untie is not None:
            index["weight_map"][plan.untie.head] = weight_map[plan.untie.source]
            index.pop("metadata", None)  # total_size changed; transformers does not need it
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((base_dir / "config.json").read_text())
    if plan.untie is not None:
        _untie(config)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return plan.untie is not None, len(plan.deltas) + (plan.untie is not None), dtypes


def _merge_loaded(base_dir: Path, adapter: Adapter, tmp: Path) -> tuple[bool, int, set[str]]:
    """The merge of an image-text model: its checkpoints store tensors under other names than its modules
    (``language_model.model.*`` for ``model.language_model.*``), which only transformers' loading maps. So the
    model is loaded whole (in its stored dtype), changed in place and saved by transformers, which writes the
    stored names back."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    try:
        model = AutoModelForImageTextToText.from_pretrained(base_dir, dtype="auto")
    except (ValueError, KeyError, OSError) as exc:
        raise ExportError(f"transformers cannot load {base_dir} as an image-text model: {exc}") from None
    layout = _layout_of(model, AutoConfig.from_pretrained(base_dir).model_type)
    names = {f"{module}.weight" for module in layout.linears} | ({layout.embeddings} if layout.embeddings else set())
    plan = _plan(adapter, layout, dict.fromkeys(names, ""))
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
    with torch.no_grad():
        for key, pair in plan.deltas.items():
            layer = model.get_submodule(key.removesuffix(".weight"))
            layer.weight.copy_(_fold(layer.weight, *pair, adapter.scale, torch))
        if plan.untie is not None:
            embeddings = model.get_input_embeddings().weight
            head = model.get_output_embeddings()
            head.weight = torch.nn.Parameter(_fold(embeddings, *plan.untie.pair, adapter.scale, torch))
            for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
                config.tie_word_embeddings = False
    model.save_pretrained(tmp)
    return plan.untie is not None, len(plan.deltas) + (plan.untie is not None), dtypes


def _fold(weight, lora_a, lora_b, scale: float, torch):
    if tuple(weight.shape) != (lora_b.shape[0], lora_a.shape[1]):
        raise ExportError(f"a tensor of shape {tuple(weight.shape)} cannot take a LoRA of shape "
                          f"{tuple(lora_b.shape)} x {tuple(lora_a.shape)}")
    merged = (weight.to(torch.float32) + scale * (lora_b.to(torch.float32) @ lora_a.to(torch.float32))).to(weight.dtype)
    if merged.is_floating_point() and not bool(merged.isfinite().all()) and bool(weight.isfinite().all()):
        raise ExportError(f"merging a LoRA of scale {scale:g} into a {tuple(weight.shape)} tensor gives NaN or "
                          f"infinite weights in {str(weight.dtype).removeprefix('torch.')}: the adapter's values or "
                          "lora_alpha are out of range")
    return merged


class _Untie:
    def __init__(self, head: str, source: str, pair: tuple) -> None:
        self.head, self.source, self.pair = head, source, pair


class _Plan:
    def __init__(self) -> None:
        self.deltas: dict[str, tuple] = {}  # checkpoint key -> (lora_A, lora_B)
        self.untie: _Untie | None = None


class _Layout:
    """What the base model is, from its module tree on the meta device (no weights loaded)."""

    def __init__(self, linears: dict[str, tuple[int, int]], head: str | None, embeddings: str | None,
                 tied: bool, model_type: str) -> None:
        self.linears, self.head, self.embeddings = linears, head, embeddings
        self.tied, self.model_type = tied, model_type


def _layout(base_dir: Path) -> _Layout:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise ExportError(f"transformers cannot build a causal LM of {config.model_type!r} from {base_dir}: "
                          f"{exc}") from None
    return _layout_of(model, config.model_type)


def _layout_of(model, model_type: str) -> _Layout:
    from torch import nn

    names = {id(m): n for n, m in model.named_modules()}
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    return _Layout(linears, names.get(id(head)) if head is not None else None,
                   f"{names[id(embeddings)]}.weight" if embeddings is not None else None, tied, model_type)


def _plan(adapter: Adapter, layout: _Layout, weight_map: dict[str, str]) -> _Plan:
    plan = _Plan()
    for module, pair in adapter.pairs.items():
        if module == TINKER_HEAD:
            if layout.tied:
                raise ExportError(f"the adapter trains {TINKER_HEAD!r} (Tinker's name for the output head) on a "
                                  f"{layout.model_type} model whose head is tied to its input embeddings; it does not "
                                  "say whether that delta applies to the output head only or to the shared matrix, "
                                  "so no merge would be sure to reproduce it. Export the PEFT adapter instead "
                                  "(get_checkpoint_archive_url / download_checkpoint: it names the head lm_head)")
            module = layout.head or "lm_head"
        if module not in layout.linears:
            raise ExportError(f"the adapter trains {module!r}, which is not a Linear layer of this "
                              f"{layout.model_type} model (is it the adapter's base model?)")
        want_in, want_out = layout.linears[module]
        a, b = pair
        if a.shape[1] != want_in or b.shape[0] != want_out:
            raise ExportError(f"layer {module!r} is {want_out} x {want_in} in the base model but the adapter's "
                              f"LoRA is {b.shape[0]} x {a.shape[1]} (another base model?)")
        key = f"{module}.weight"
        if module == layout.head and layout.tied:
            if layout.embeddings not in weight_map:
                raise ExportError(f"the base checkpoint has no {layout.embeddings!r} to untie the output head from")
            plan.untie = _Untie(key, layout.embeddings, pair)
            continue
        if key not in weight_map:
            example = next(iter(weight_map), "?")
            raise ExportError(f"the base checkpoint has no tensor {key!r} for the adapter's layer {module!r} (its "
                              f"tensors are named like {example!r}); this checkpoint layout is not supported")
        plan.deltas[key] = pair
    return plan


def _untie(config: dict) -> None:
    config["tie_word_embeddings"] = False
    if "tie_embedding" in config:  # LFM2's own name for it
        config["tie_embedding"] = False
    text = config.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        text["tie_word_embeddings"] = False


def _base_weights(base_dir: Path) -> tuple[list[str], dict[str, str], dict | None]:
    """The safetensors shards of a base model, which shard holds each tensor, and its index (if sharded)."""
    from safetensors import safe_open

    index_path = base_dir / INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map = dict(index["weight_map"])
        return sorted(set(weight_map.values())), weight_map, index
    shards = sorted(p.name for p in base_dir.glob("*.safetensors"))
    if not shards:
        pickled = [p.name for p in base_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (it has {pickled[0]}: pickled weights are never read)" if pickled else ""
        raise ExportError(f"{base_dir} has no .safetensors weights{hint}")
    weight_map = {}
    for shard in shards:
        with safe_open(str(base_dir / shard), framework="pt") as f:
            weight_map.update({key: shard for key in f.keys()})
    return shards, weight_map, None
