"""``pytrio-worker make-tiny-model DIR --vision``: a tiny random Qwen3.5 vision-language model whose weights,
tokenizer (image tokens included), chat template and image processor all come back from disk as written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from server_mock import cli
from server_mock.engine.tiny_vlm import (
    TINY_VLM_FAMILIES,
    build_tiny_vlm,
    build_tiny_vlm_tokenizer,
    tiny_image_processor,
)

TEXTS = ["What is 12 + 34? The answer is 46.", "héllo ✓ wörld\n\n  spaced   out\ttabs",
         "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>how many?<|im_end|>"]


def test_make_tiny_model_vision_round_trip(tmp_path, capsys):
    cli.main(["make-tiny-model", str(tmp_path / "vlm"), "--vision", "--seed", "4"])
    out = tmp_path / "vlm"
    assert "vision-language" in capsys.readouterr().out
    assert {"model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"} <= {
        p.name for p in out.iterdir()}

    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration" and model.dtype == torch.float32
    ref_tok = build_tiny_vlm_tokenizer("qwen3_5")
    ref = build_tiny_vlm(ref_tok, "qwen3_5", seed=4).state_dict()
    got = model.state_dict()
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    assert any(k.startswith("model.visual.") for k in got)
    assert sum(p.numel() for p in model.parameters()) < 300_000

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == ref_tok.get_vocab() and len(tok) == model.config.text_config.vocab_size == 516
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")}
    assert ids == {"<|vision_start|>": model.config.vision_start_token_id,
                   "<|vision_end|>": model.config.vision_end_token_id, "<|image_pad|>": model.config.image_token_id}
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
    assert tok.encode("<|vision_start|><|image_pad|><|vision_end|>", add_special_tokens=False) == [
        ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"]]
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>how many?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")

    proc = AutoImageProcessor.from_pretrained(out, backend="pil")
    want = tiny_image_processor("qwen3_5")
    assert type(proc) is type(want)
    assert (proc.patch_size, proc.merge_size, proc.temporal_patch_size) == (8, 2, 2)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    a, b = proc(images=[image], return_tensors="np"), want(images=[image], return_tensors="np")
    assert np.array_equal(a["image_grid_thw"], b["image_grid_thw"])
    assert np.array_equal(a["pixel_values"], b["pixel_values"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5"


@pytest.mark.parametrize("arch", TINY_VLM_FAMILIES)
def test_every_tiny_family_builds_deterministically_without_touching_the_global_rng(arch):
    tok = build_tiny_vlm_tokenizer(arch)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_vlm(tok, arch, seed=2).state_dict()
    assert torch.equal(torch.rand(3), expected)
    b, c = build_tiny_vlm(tok, arch, seed=2).state_dict(), build_tiny_vlm(tok, arch, seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], c[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values() if v.is_floating_point())


def test_the_cli_lists_the_tiny_vlm_families_and_refuses_a_mixed_up_arch(tmp_path):
    assert cli.VISION_TINY_ARCHS == TINY_VLM_FAMILIES
    with pytest.raises(SystemExit) as info:
        cli.main(["make-tiny-model", str(tmp_path / "x"), "--arch", "gemma3"])
    assert "pass --vision" in str(info.value)
    with pytest.raises(SystemExit) as info:
        cli.main(["make-tiny-model", str(tmp_path / "y"), "--vision", "--arch", "llama"])
    assert "with --vision, one of" in str(info.value)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    cli.main(["make-tiny-model", str(tmp_path / "g"), "--vision", "--arch", "gemma3"])
    assert json.loads((tmp_path / "g" / "config.json").read_text())["model_type"] == "gemma3"
