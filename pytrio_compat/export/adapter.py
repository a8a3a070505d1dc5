"""Reading a downloaded LoRA adapter: an archive or a folder, checked before anything is merged.

An adapter is PEFT's folder (``adapter_config.json`` + ``adapter_model.safetensors``), as the worker saves it,
``download_checkpoint`` / ``get_checkpoint_archive_url`` deliver it (a tar of that folder), or Tinker's export
holds it (the output head then named ``model.unembed_tokens``). Only JSON and safetensors are read: a
``.bin``/``.pt`` pickle is refused, as is an encrypted (``.age``) export, and every LoRA feature a plain
``W + scale * B @ A`` merge cannot reproduce (DoRA, biases, per-layer ranks, extra trained modules ...).
"""

from __future__ import annotations

import json
import math
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TINKER_HEAD = "model.unembed_tokens"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# PEFT LoraConfig fields whose non-default values change what the adapter computes beyond W + s * B @ A
_MUST_BE_OFF = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                "layers_to_transform", "lora_bias", "target_parameters", "trainable_token_indices",
                "layer_replication")


class ExportError(Exception):
    """The adapter or base model cannot be exported as asked; the message says why and what to do."""


@dataclass
class Adapter:
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)
    pairs: dict[str, tuple]  # module name -> (lora_A [r, in], lora_B [out, r]) as stored (torch tensors)
    config: dict
    tinker_head: bool  # the output head is named model.unembed_tokens (Tinker's naming)


def extract_archive(archive: Path, folder: Path) -> Path:
    """Unpack a checkpoint archive into ``folder`` (only regular files at the top level are accepted)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix("./")
            if not member.isfile() or "/" in name or name in ("", ".", ".."):
                raise ExportError(f"{archive}: unexpected entry {member.name!r}; a checkpoint archive holds only "
                                  f"{CONFIG_FILE}, {WEIGHTS_FILE} and checkpoint_complete")
        tar.extractall(folder, filter="data")
    return folder


def read_adapter(folder: Path) -> Adapter:
    from safetensors.torch import load_file

    if any(p.suffix == ".age" for p in folder.iterdir()):
        raise ExportError(f"{folder} holds age-encrypted files (.age): decrypt them first "
                          "(age -d -i KEY FILE.age > FILE, or pyrage.decrypt_file)")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            pickled = [p.name for p in folder.glob("adapter_model.*") if p.suffix in (".bin", ".pt", ".pth")]
            hint = f" (found {pickled[0]}: pickled weights are never read; save as safetensors)" if pickled else ""
            raise ExportError(f"{folder} has no {name}: a PEFT adapter folder holds {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE}{hint}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except ValueError as exc:
        raise ExportError(f"{folder / CONFIG_FILE} is not valid JSON: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ExportError(f"{CONFIG_FILE}: only LoRA adapters can be merged, got peft_type={config['peft_type']!r}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ExportError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ExportError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise ExportError(f"{CONFIG_FILE}: bias={config['bias']!r} (trained biases) cannot be merged; only 'none'")
    for key in _MUST_BE_OFF:
        if config.get(key) not in (None, False, {}, []):
            raise ExportError(f"{CONFIG_FILE}: {key}={config[key]!r} is not a plain LoRA and cannot be merged "
                              "as W + scale * B @ A")
    tensors = load_file(str(folder / WEIGHTS_FILE))
    pairs: dict[str, dict] = {}
    for key, tensor in tensors.items():
        if key.endswith(".base_layer.weight"):
            continue  # PEFT's copy of a base head/embedding next to its LoRA: the base model's own is used
        match = _KEY.match(key)
        if not match:
            raise ExportError(f"{WEIGHTS_FILE}: unexpected tensor {key!r} (expected "
                              "base_model.model.<module>.lora_A/lora_B.weight; embedding LoRAs are not merged)")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise ExportError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ExportError(f"{WEIGHTS_FILE}: layer {module!r} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ExportError(f"{WEIGHTS_FILE}: layer {module!r} has lora_A {tuple(a.shape)} and lora_B "
                              f"{tuple(b.shape)}, not [r, in] and [out, r] with r={rank}")
        out[module] = (a, b)
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return Adapter(rank, scale, out, config, TINKER_HEAD in out)
