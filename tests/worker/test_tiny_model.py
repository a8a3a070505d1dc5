"""Tests for the offline tiny model / tokenizer fixtures in server_mock.tiny_model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server_mock.engine.tiny_model import CHATML_TEMPLATE, build_tiny_model, build_tiny_tokenizer, make_tiny_model

SAMPLE_TEXTS = [
    "What is 12 + 34? The answer is 46.",
    "héllo ✓ wörld\n\n  spaced   out\ttabs",
    "<|im_start|>user\nCompute 7 * 8<|im_end|>\n<|im_start|>assistant\n56<|im_end|>",
    "Question: Tom has 3 apples. #### 6",
]


def test_tokenizer_specials_and_vocab(tok):
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids("<|endoftext|>") == tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id == 2
    # Specials are single tokens, not split into bytes.
    assert tok.encode("<|im_start|>x<|im_end|>", add_special_tokens=False)[0] == 1
    assert tok.encode("<|im_start|>x<|im_end|>", add_special_tokens=False)[-1] == 2
    # It actually learned merges (fewer tokens than bytes on in-domain text).
    text = "What is 12 times 34? The answer is 408."
    assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()) * 0.7


def test_tokenizer_roundtrips_text_and_is_deterministic(tok):
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    again = build_tiny_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_chat_template_renders_chatml(tok):
    assert tok.chat_template == CHATML_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_gen == text[: -len("<|im_start|>assistant\n")]
    with_answer = tok.apply_chat_template(
        messages + [{"role": "assistant", "content": "5"}], tokenize=False, enable_thinking=True
    )
    assert with_answer.endswith("<|im_start|>assistant\n5<|im_end|>\n")
    # Tokenized form equals encoding the rendered text.
    enc = tok.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, return_dict=True
    )
    assert list(enc["input_ids"]) == tok.encode(text, add_special_tokens=False)


def test_build_tiny_model_shape_and_determinism(tok):
    m = build_tiny_model(len(tok), seed=0)
    cfg = m.config
    assert cfg.model_type == "qwen2"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert m.generation_config.eos_token_id == tok.eos_token_id
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()  # tied
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert sum(p.numel() for p in m.parameters()) < 200_000

    same = build_tiny_model(len(tok), seed=0)
    other = build_tiny_model(len(tok), seed=1)
    sd, sd_same, sd_other = m.state_dict(), same.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd_same[k]) for k in sd)
    assert any(not torch.equal(sd[k], sd_other[k]) for k in sd)

    # Building must not disturb the caller's global RNG.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(len(tok), seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_make_tiny_model_roundtrip(tmp_path, tok, arch):
    out = make_tiny_model(tmp_path / arch, arch=arch, seed=3)
    assert (out / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    loaded_tok = AutoTokenizer.from_pretrained(out)
    ref = build_tiny_model(len(tok), arch=arch, seed=3)
    assert loaded.config.model_type == arch
    assert loaded.dtype == torch.float32
    ref_sd, got_sd = ref.state_dict(), loaded.state_dict()
    assert set(ref_sd) == set(got_sd)
    assert all(torch.equal(ref_sd[k], got_sd[k]) for k in ref_sd)
    assert loaded.generation_config.eos_token_id == tok.eos_token_id

    # The reloaded tokenizer (AutoTokenizer picks Qwen2Tokenizer for qwen2) tokenizes identically.
    assert loaded_tok.get_vocab() == tok.get_vocab()
    for text in SAMPLE_TEXTS:
        assert loaded_tok.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert loaded_tok.eos_token_id == tok.eos_token_id == 2
    assert loaded_tok.pad_token_id == tok.pad_token_id == 0
    msgs = [{"role": "user", "content": "hi"}]
    assert loaded_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
    ) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    ids = torch.tensor([tok.encode("1 + 2 = 3", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)
