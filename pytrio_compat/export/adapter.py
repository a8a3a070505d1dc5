"""Reading a downloaded LoRA adapter: an archive or a folder, checked before anything is merged.

An adapter is PEFT's folder (``adapter_config.json`` + ``adapter_model.safetensors``), as the worker saves it,
``download_checkpoint`` / ``get_checkpoint_archive_url`` deliver it (a tar of that folder), or Tinker's export
holds it (the output head then named ``model.unembed_tokens``). Only JSON and safetensors are read: a
``.bin``/``.pt`` pickle is refused, as is an encrypted (``.age``) export, and every LoRA feature a plain
``W + scale * B @ A`` merge cannot reproduce (DoRA, biases, per-layer ranks, extra trained modules ...).

Nothing in an adapter is trusted before it is checked: an archive is a plain (uncompressed) tar, as the worker
writes it, so nothing in it grows past its own size when unpacked; each member's size is checked before it is
written (the weights file against its own safetensors header); a safetensors header must describe exactly the bytes
that follow it; the config is a small, shallow JSON object; and LoRA tensors, ``lora_alpha`` and the deltas
they fold in must be finite.
"""

from __future__ import annotations

import json
import math
import re
import struct
import tarfile
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TINKER_HEAD = "model.unembed_tokens"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# PEFT LoraConfig fields whose non-default values change what the adapter computes beyond W + s * B @ A
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
MAX_SMALL_MEMBER = 1 << 16  # checkpoint_complete and other small files of an archive
MAX_HEADER_BYTES = 100 << 20  # a safetensors header's length (safetensors' own bound)
MAX_LORA_ALPHA = 1e6  # |lora_alpha|: PEFT's are 1..a few hundred; past this a merge only overflows
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
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
    """Unpack a checkpoint archive into ``folder``: a plain tar of regular files at the top level, each of a size
    checked before anything is written (the weights against their safetensors header)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        tar = tarfile.open(archive, "r:")  # plain tar only: a compressed one could unpack to any size
    except tarfile.ReadError as exc:
        raise ExportError(f"{archive} is not a plain (uncompressed) tar archive ({exc}); the worker's archives are "
                          "plain tar: decompress it first (e.g. xz -d / gunzip), after checking its size") from None
    with tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise ExportError(f"{archive}: damaged tar archive ({exc})") from None
        for member in members:
            name = member.name.removeprefix("./")
            if not member.isfile() or member.issparse() or "/" in name or name in ("", ".", ".."):
                raise ExportError(f"{archive}: unexpected entry {member.name!r}; a checkpoint archive holds only "
                                  f"{CONFIG_FILE}, {WEIGHTS_FILE} and checkpoint_complete")
            _check_member(archive, tar, member, name)
        try:
            tar.extractall(folder, filter="data")
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise ExportError(f"{archive}: cannot be unpacked ({type(exc).__name__}: {exc})") from None
    return folder


def _check_member(archive: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> None:
    """A member's size, before it is written: the weights exactly what their header describes, the rest small."""
    if name == WEIGHTS_FILE:
        stream = tar.extractfile(member)
        try:
            expected = _safetensors_size(stream.read(8), stream.read, f"{archive}: {WEIGHTS_FILE}")
        finally:
            stream.close()
        if member.size != expected:
            raise ExportError(f"{archive}: {WEIGHTS_FILE} is {member.size} bytes but its header describes "
                              f"{expected}: a damaged or altered file")
    elif member.size > (MAX_CONFIG_BYTES if name == CONFIG_FILE else MAX_SMALL_MEMBER):
        raise ExportError(f"{archive}: {name} is {member.size} bytes, more than such a file ever holds")


def _safetensors_size(head: bytes, read, what: str) -> int:
    """The size in bytes of a safetensors file from its header (read through ``read``), checking that the header
    describes its tensors exactly: known dtypes, offsets that tile the data with no gap or overlap."""
    if len(head) != 8:
        raise ExportError(f"{what}: too short for a safetensors file")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES:
        raise ExportError(f"{what}: its header claims {length} bytes (at most {MAX_HEADER_BYTES}): not a "
                          "safetensors file, or a damaged one")
    raw = read(length)
    if len(raw) != length:
        raise ExportError(f"{what}: its header claims {length} bytes, the file ends before")
    header = _json(raw, what)
    if not isinstance(header, dict):
        raise ExportError(f"{what}: its header is not a JSON object")
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (dtype in _DTYPE_BYTES and isinstance(shape, list)
                  and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
                  and all(isinstance(n, int) and not isinstance(n, bool) for n in (start, end)))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or not 0 <= start <= end or end - start != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise ExportError(f"{what}: tensor {str(key)[:100]!r} has a header entry that does not describe its "
                              "bytes (dtype, shape and data_offsets disagree): a damaged or altered file")
        spans.append((start, end))
    at = 0
    for start, end in sorted(spans):
        if start != at:
            raise ExportError(f"{what}: its tensors' data_offsets leave a gap or overlap at byte {at}: a damaged "
                              "or altered file")
        at = end
    return 8 + length + at


def _json(raw: bytes | str, what: str):
    try:
        return json.loads(raw)
    except RecursionError:
        raise ExportError(f"{what}: its JSON is nested too deeply") from None
    except ValueError as exc:
        raise ExportError(f"{what} is not valid JSON: {exc}") from None


def check_weights_file(path: Path) -> None:
    """A safetensors file whose header describes exactly its size (before safetensors maps it)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        expected = _safetensors_size(f.read(8), f.read, str(path))
    if size != expected:
        raise ExportError(f"{path} is {size} bytes but its header describes {expected}: a damaged or altered file")


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
    if (folder / CONFIG_FILE).stat().st_size > MAX_CONFIG_BYTES:
        raise ExportError(f"{folder / CONFIG_FILE} is more than {MAX_CONFIG_BYTES} bytes: not an adapter config")
    config = _json((folder / CONFIG_FILE).read_bytes(), str(folder / CONFIG_FILE))
    if not isinstance(config, dict):
        raise ExportError(f"{folder / CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ExportError(f"{CONFIG_FILE}: only LoRA adapters can be merged, got peft_type={config['peft_type']!r}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ExportError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ExportError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    if not 0 < abs(alpha) <= MAX_LORA_ALPHA:
        raise ExportError(f"{CONFIG_FILE}: lora_alpha={alpha!r} is out of range: |lora_alpha| must be in "
                          f"(0, {MAX_LORA_ALPHA:g}]")
    if config.get("bias", "none") != "none":
        raise ExportError(f"{CONFIG_FILE}: bias={config['bias']!r} (trained biases) cannot be merged; only 'none'")
    for key in _MUST_BE_OFF:
        if config.get(key) not in (None, False, {}, []):
            raise ExportError(f"{CONFIG_FILE}: {key}={config[key]!r} is not a plain LoRA and cannot be merged "
                              "as W + scale * B @ A")
    check_weights_file(folder / WEIGHTS_FILE)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - safetensors' own refusal (SafetensorError), a dtype torch lacks
        raise ExportError(f"{folder / WEIGHTS_FILE} cannot be read: {type(exc).__name__}: {exc}") from None
    pairs: dict[str, dict] = {}
    for key, tensor in tensors.items():
        if key.endswith(".base_layer.weight"):
            continue  # PEFT's copy of a base head/embedding next to its LoRA: the base model's own is used
        match = _KEY.match(key)
        if not match:
            raise ExportError(f"{WEIGHTS_FILE}: unexpected tensor {key!r} (expected "
                              "base_model.model.<module>.lora_A/lora_B.weight; embedding LoRAs are not merged)")
        if not tensor.is_floating_point():
            raise ExportError(f"{WEIGHTS_FILE}: {key} is {str(tensor.dtype).removeprefix('torch.')}, not a float")
        if not bool(tensor.isfinite().all()):
            raise ExportError(f"{WEIGHTS_FILE}: {key} holds NaN or infinite values; such an adapter cannot be merged")
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
