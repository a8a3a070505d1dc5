"""Sampling from a PEFT LoRA adapter folder on the worker's disk, inside folders the operator allowed.

``create_sampling_client(model_path=...)`` takes the worker's own ``trio://`` paths. With
``--allow-adapter-dir DIR`` (repeatable) it also takes a folder holding ``adapter_config.json`` and
``adapter_model.safetensors`` (what ``PeftModel.save_pretrained`` writes) anywhere under DIR. The real
path (symlinks resolved) of the folder and of both files must lie inside an allowed folder. Only JSON and
safetensors are read; ``.bin``/``.pt`` pickles are never opened.

The adapter is checked against the base model (rank, target layers, tensor shapes) and mapped onto the
worker's LoRA layout: layers the adapter does not train get zero weights (no change), and its
``lora_alpha`` scaling is folded into ``lora_B`` so the served model is the adapter's model exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pytrio_compat.wire import LoraSpec
from server_mock.errors import WorkerError, bad_request
from server_mock.lora import LORA_ALPHA, Layer, Snapshot, lora_config

PATTERN_SECONDS = 1.0  # a string target_modules, against all the layer names of a model
PATTERN_SECONDS_PER_NAME = 0.05  # ... and against one (a real pattern takes microseconds)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight\Z")
# LoraConfig features the worker's layout cannot reproduce: each must be off/empty
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
               "alpha_pattern": {}, "layers_to_transform": None, "lora_bias": False, "target_parameters": None,
               "trainable_token_indices": None, "layer_replication": None}


def is_local_path(path: str) -> bool:
    return not path.startswith("trio://")


def resolve(path: str, allowed: list[str], field: str = "model_path") -> Path:
    """The adapter folder's real path, if it lies inside an allowed folder; else a 4xx naming the reason."""
    if not allowed:
        raise bad_request(field, f"{path!r} is not a checkpoint path of this worker; expected "
                                 "trio://<run>/<state|sampler>/<name> (local adapter folders need the worker to be "
                                 "started with --allow-adapter-dir)", code="invalid_checkpoint_path")
    if not os.path.isabs(path):
        raise bad_request(field, f"a local adapter folder must be an absolute path, got {path!r}")
    real = os.path.realpath(path)
    if not any(_inside(real, root) for root in allowed):
        raise WorkerError(403, "adapter_dir_not_allowed",
                          f"{field}: {path} is not inside a folder allowed by --allow-adapter-dir "
                          "(symlinks are resolved before checking)", field)
    if not os.path.isdir(real):
        raise WorkerError(404, "adapter_not_found", f"{field}: no adapter folder at {path}", field)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = os.path.join(real, name)
        if not os.path.isfile(file):
            raise bad_request(field, f"{path} has no {name}: a PEFT adapter folder holds {CONFIG_FILE} and "
                                     f"{WEIGHTS_FILE} (pickled .bin/.pt weights are never loaded)",
                              code="invalid_adapter")
        if not any(_inside(os.path.realpath(file), root) for root in allowed):
            raise WorkerError(403, "adapter_dir_not_allowed",
                              f"{field}: {path}/{name} links outside the allowed folders", field)
    return Path(real)


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def base_model_hint(folder: Path) -> str | None:
    try:
        value = json.loads((folder / CONFIG_FILE).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def fingerprint(folder: Path) -> str:
    parts = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        st = (folder / name).stat()
        parts.append(f"{folder / name}:{st.st_mtime_ns}:{st.st_size}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _pattern_matches(pattern: str, names: list[str], reject) -> bool:
    """Whether PEFT's string ``target_modules`` (a regular expression, full-matched) matches one of ``names``,
    within ``PATTERN_SECONDS`` for all of them: a pattern like ``(.*?){12}Z`` backtracks for days. The ``regex``
    package takes a timeout (and releases the GIL while matching); ``re`` has neither."""
    import regex

    try:
        compiled = regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError) as exc:
        raise reject("target_modules", f"is not a valid regular expression ({exc})") from None
    deadline = time.monotonic() + PATTERN_SECONDS
    try:
        for name in names:
            # regex checks its timeout only now and then (it overshoots ~5x): a short one per name, and our own
            # clock for all of them
            if time.monotonic() > deadline:
                raise TimeoutError
            if compiled.fullmatch(name, timeout=PATTERN_SECONDS_PER_NAME, concurrent=True):
                return True
    except TimeoutError:
        raise reject("target_modules", f"the pattern took too long to match this model's layer names (limit "
                                       f"{PATTERN_SECONDS_PER_NAME:g} s a name, {PATTERN_SECONDS:g} s in all); give "
                                       "a list of layer names instead") from None
    return False


def load(folder: Path, model_name: str, layout: dict[str, Layer], max_rank: int, field: str = "model_path"
         ) -> Snapshot:
    """Read, check and convert the adapter into a sampler snapshot on the LoRA layout of the model ``model_name``
    (``layout``: its LoRA-able layers, ``lora.model_layout``)."""
    where = f"{field}: {folder}"
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise bad_request(field, f"{folder}/{CONFIG_FILE} is not valid JSON: {exc}", code="invalid_adapter") from None
    if not isinstance(config, dict):
        raise bad_request(field, f"{folder}/{CONFIG_FILE} must hold a JSON object", code="invalid_adapter")

    def reject(key: str, message: str) -> WorkerError:
        return WorkerError(400, "invalid_adapter", f"{where}: {CONFIG_FILE} {key}: {message}", field)

    if config.get("peft_type", "LORA") != "LORA":
        raise reject("peft_type", f"only LORA adapters are supported, got {config.get('peft_type')!r}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise reject("r", f"must be an integer in [1, {max_rank}], got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise reject("lora_alpha", f"must be a positive number, got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise reject("bias", f"only 'none' is supported, got {config.get('bias')!r}")
    for key, off in UNSUPPORTED.items():
        value = config.get(key, off)
        if value not in (off, None, False, {}, []):
            raise reject(key, f"is not supported by this worker (got {value!r})")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if not _pattern_matches(targets, list(layout), reject):
            raise reject("target_modules", f"pattern {targets[:100]!r} matches no LoRA-able layer of {model_name}")
    elif isinstance(targets, list):
        for target in targets:
            if not any(name == target or name.endswith(f".{target}") for name in layout):
                raise reject("target_modules", f"{target!r} matches no LoRA-able layer of {model_name} "
                                               f"(its layers are named like {next(iter(layout), '?')})")
    else:
        raise reject("target_modules", f"must be a list of layer names or a pattern, got {targets!r}")

    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, SafetensorError) as exc:
        raise bad_request(field, f"{folder}/{WEIGHTS_FILE} is not a readable safetensors file: {exc}",
                          code="invalid_adapter") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY_RE.fullmatch(key)
        if not match:
            raise bad_request(field, f"{WEIGHTS_FILE} has an unexpected tensor {key!r} (expected "
                                     "base_model.model.<layer>.lora_A/lora_B.weight)", code="invalid_adapter")
        module = match["module"]
        if module not in layout:
            raise bad_request(field, f"{WEIGHTS_FILE} tensor {key!r}: {model_name} has no LoRA-able layer {module!r}",
                              code="invalid_adapter")
        layer = layout[module]
        want = (rank, layer.in_features) if match["ab"] == "A" else (layer.out_features, rank)
        if tuple(tensor.shape) != want:
            raise bad_request(field, f"{WEIGHTS_FILE} tensor {key!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{want} for r={rank} on {model_name}", code="invalid_adapter")
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise bad_request(field, f"{WEIGHTS_FILE} tensor {key!r} must be finite floating point",
                              code="invalid_adapter")
        pairs.setdefault(module, {})[match["ab"]] = tensor.to(torch.float32)
    if not pairs:
        raise bad_request(field, f"{WEIGHTS_FILE} holds no LoRA tensors", code="invalid_adapter")
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise bad_request(field, f"{WEIGHTS_FILE}: layer {module!r} has lora_{''.join(ab)} without its pair",
                              code="invalid_adapter")

    groups = {layout[m].group for m in pairs}
    spec = LoraSpec(rank=rank, train_attn="train_attn" in groups, train_mlp="train_mlp" in groups,
                    train_unembed="train_unembed" in groups)
    _, target_modules = lora_config({name: layer.group for name, layer in layout.items()}, spec)
    their_scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    factor = their_scale / (LORA_ALPHA / rank)
    out: dict[str, torch.Tensor] = {}
    for module in target_modules:
        layer = layout[module]
        ab = pairs.get(module)
        a = ab["A"] if ab else torch.zeros(rank, layer.in_features)
        b = ab["B"] if ab else torch.zeros(layer.out_features, rank)
        out[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = (b if factor == 1.0 else b * factor).contiguous()
    return Snapshot(fingerprint(folder), spec, target_modules, out)
