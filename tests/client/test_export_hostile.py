"""The export command on hostile adapters (small crafted files): a compressed archive (a decompression bomb) is
refused before anything is unpacked, each member's size is checked against what it can hold (the weights against
their own safetensors header) before it is written, a safetensors header that lies about its length or offsets and
a deeply nested config end in an ``export: ...`` message with a nonzero exit code (never a traceback), and NaN or
infinite LoRA values or an absurd ``lora_alpha`` are refused instead of merged."""

from __future__ import annotations

import io
import json
import struct
import tarfile

import pytest
import torch
from safetensors.torch import save_file

from pytrio_compat.cli import main as compat_main
from pytrio_compat.export import ExportError, extract_archive, read_adapter
from pytrio_compat.export.adapter import MAX_CONFIG_BYTES, MAX_HEADER_BYTES, MAX_LORA_ALPHA

MODULE = "base_model.model.model.layers.0.self_attn.q_proj"
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def adapter(folder, a=None, b=None, **config):
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{MODULE}.lora_A.weight": torch.randn(2, 8, generator=gen) if a is None else a,
               f"{MODULE}.lora_B.weight": torch.randn(8, 2, generator=gen) if b is None else b}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({**CONFIG, **config}))
    return folder


def tar_of(path, members: dict[str, bytes], mode="w"):
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def files_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_whole_adapter_reads_and_a_plain_tar_of_it_unpacks(tmp_path):
    folder = adapter(tmp_path / "a")
    assert read_adapter(folder).rank == 2
    out = extract_archive(tar_of(tmp_path / "a.tar", files_of(folder)), tmp_path / "x")
    assert files_of(out) == files_of(folder)


@pytest.mark.parametrize("mode", ["w:xz", "w:gz", "w:bz2"])
def test_a_compressed_archive_is_refused_before_anything_is_unpacked(tmp_path, mode):
    bomb = tar_of(tmp_path / "bomb", {"adapter_model.safetensors": bytes(4 << 20)}, mode)
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(ExportError, match="not a plain \\(uncompressed\\) tar"):
        extract_archive(bomb, tmp_path / "x")
    assert list((tmp_path / "x").iterdir()) == []


def test_a_weights_member_is_checked_against_its_header_before_it_is_written(tmp_path):
    whole = files_of(adapter(tmp_path / "a"))["adapter_model.safetensors"]
    padded = whole + bytes(1 << 20)  # the header describes fewer bytes than the member holds
    with pytest.raises(ExportError, match=f"is {len(padded)} bytes but its header describes {len(whole)}"):
        extract_archive(tar_of(tmp_path / "p.tar", {"adapter_model.safetensors": padded}), tmp_path / "x")
    assert list((tmp_path / "x").iterdir()) == []
    with pytest.raises(ExportError, match="its header describes"):
        extract_archive(tar_of(tmp_path / "c.tar", {"adapter_model.safetensors": whole[:-1]}), tmp_path / "y")


def test_a_config_member_at_its_bound_unpacks_and_one_byte_more_is_refused(tmp_path):
    at = tar_of(tmp_path / "at.tar", {"adapter_config.json": b" " * MAX_CONFIG_BYTES})
    assert (extract_archive(at, tmp_path / "x") / "adapter_config.json").stat().st_size == MAX_CONFIG_BYTES
    past = tar_of(tmp_path / "past.tar", {"adapter_config.json": b" " * (MAX_CONFIG_BYTES + 1)})
    with pytest.raises(ExportError, match="more than such a file ever holds"):
        extract_archive(past, tmp_path / "y")


def lying(folder, header: bytes | dict, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return folder


def test_lying_safetensors_headers_are_export_errors(tmp_path):
    entry = {"dtype": "F32", "shape": [2, 8]}
    cases = {
        "length": (lambda f: lying(f, b"{}", length=MAX_HEADER_BYTES + 1), "claims"),
        "short": (lambda f: lying(f, b"{}", length=4096), "file ends before"),
        "offsets past the end": (lambda f: lying(f, {"x": {**entry, "data_offsets": [0, 64]}}, bytes(8)),
                                 "header describes"),
        "offsets and shape disagree": (lambda f: lying(f, {"x": {**entry, "data_offsets": [0, 8]}}, bytes(8)),
                                       "disagree"),
        "overlap": (lambda f: lying(f, {"x": {**entry, "data_offsets": [0, 64]},
                                        "y": {**entry, "data_offsets": [32, 96]}}, bytes(96)), "gap or overlap"),
        "unknown dtype": (lambda f: lying(f, {"x": {**entry, "dtype": "F128", "data_offsets": [0, 64]}}, bytes(64)),
                          "disagree"),
        "not JSON": (lambda f: lying(f, b"{\"x\": "), "not valid JSON"),
        "deep": (lambda f: lying(f, b"[" * 100000 + b"]" * 100000), "nested too deeply"),
    }
    for name, (make, reason) in cases.items():
        folder = make(adapter(tmp_path / name.replace(" ", "-")))
        with pytest.raises(ExportError, match=reason):
            read_adapter(folder)


def test_the_command_answers_export_errors_not_tracebacks(tmp_path, capsys):
    deep = adapter(tmp_path / "deep")
    (deep / "adapter_config.json").write_text("[" * 100000 + "]" * 100000)
    liar = lying(adapter(tmp_path / "liar"), b"{}", length=1 << 40)
    nan = adapter(tmp_path / "nan", b=torch.full((8, 2), float("nan")))
    for folder, reason in ((deep, "nested too deeply"), (liar, "claims"), (nan, "NaN or infinite")):
        code = compat_main(["export", str(folder), "--base", str(tmp_path), "--merged", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("export: ") and reason in err and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_lora_values_are_refused(tmp_path, bad):
    a = torch.randn(2, 8)
    a[1, 3] = bad
    with pytest.raises(ExportError, match="lora_A.weight holds NaN or infinite values"):
        read_adapter(adapter(tmp_path / "a", a=a))
    b = torch.randn(8, 2)
    b[0, 0] = bad
    with pytest.raises(ExportError, match="lora_B.weight holds NaN or infinite values"):
        read_adapter(adapter(tmp_path / "b", b=b))


def test_lora_alpha_at_its_bound_reads_and_past_it_is_refused(tmp_path):
    assert read_adapter(adapter(tmp_path / "at", lora_alpha=MAX_LORA_ALPHA)).scale == MAX_LORA_ALPHA / 2
    for alpha in (MAX_LORA_ALPHA * (1 + 1e-9), 1e308, -1e308, 0):
        with pytest.raises(ExportError, match="lora_alpha"):
            read_adapter(adapter(tmp_path / f"past-{alpha}", lora_alpha=alpha))


def test_a_merge_that_overflows_the_base_dtype_is_refused():
    from pytrio_compat.export.merge import _fold

    weight = torch.zeros(8, 8, dtype=torch.float16)
    a, b = torch.full((2, 8), 300.0), torch.full((8, 2), 300.0)  # 2 * 300 * 300 * 1 = 180000 > float16's 65504
    with pytest.raises(ExportError, match="NaN or infinite weights in float16"):
        _fold(weight, a, b, 1.0, torch)
    assert _fold(weight, a / 10, b / 10, 1.0, torch).isfinite().all()  # 1800: fits
