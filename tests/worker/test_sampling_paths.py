"""The load-time probe picks the sampling path a model's cache can take, and the slower paths are exact too."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import cache_utils

from server_mock.engine.support import Float32Head, probe_sampling, use_float32_head
from server_mock.engine.tiny_model import build_tiny_model
from server_mock.sampling.generate import SampleSpec, SamplingSupport, generate_batch, teacher_forced_logprobs


def specs(tok):
    return [
        SampleSpec(prompt_tokens=tok.encode("1 + 2 = 3 and 4 + 4 ="), num_samples=3, max_tokens=12, seed=1,
                   stop_token_ids=[2], include_prompt_logprobs=True),
        SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=2, max_tokens=9, seed=2, temperature=0.7, top_p=0.9),
        SampleSpec(prompt_tokens=tok.encode("7 7 7"), num_samples=2, max_tokens=0, seed=3),
        SampleSpec(prompt_tokens=tok.encode("what is 45 + 7?"), num_samples=4, max_tokens=10, seed=4, temperature=0),
    ]


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "lfm2"])
def test_every_path_gives_the_same_tokens_and_exact_logprobs(tok, family):
    model = build_tiny_model(len(tok), arch=family, seed=2)
    assert probe_sampling(model, len(tok)) == SamplingSupport(shared_prefix=True, padded_batch=True)
    batch = specs(tok)
    # the stop token must cut a row short somewhere, so that dropping rows is exercised
    batch[0].stop_token_ids = [generate_batch(model, [batch[0]], tok)[0].sequences[1].tokens[4]]
    results = {}
    for shared in (True, False):
        for padded in (True, False):
            results[shared, padded] = generate_batch(model, batch, tok, support=SamplingSupport(shared, padded))
    reference = results[True, True]
    assert any(s.stop_reason == "stop" and len(s.tokens) < 12 for s in reference[0].sequences)
    for key, got in results.items():
        for spec, a, b in zip(batch, reference, got):
            assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences], key
            assert [s.stop_reason for s in a.sequences] == [s.stop_reason for s in b.sequences], key
            for seq in b.sequences:
                ref = teacher_forced_logprobs(model, spec.prompt_tokens + seq.tokens)[len(spec.prompt_tokens) - 1:]
                assert np.abs(np.asarray(ref) - np.asarray(seq.logprobs)).max(initial=0) < 1e-5, key
        assert got[0].prompt_logprobs == pytest.approx(reference[0].prompt_logprobs, abs=1e-5)


def test_a_cache_that_cannot_be_reordered_falls_back_and_says_so(tok, monkeypatch, caplog):
    model = build_tiny_model(len(tok), arch="qwen3", seed=0)

    def refuse(self, beam_idx):
        raise NotImplementedError("this cache cannot reorder its rows")

    monkeypatch.setattr(cache_utils.Cache, "reorder_cache", refuse)
    with caplog.at_level(logging.WARNING, logger="server_mock"):
        support = probe_sampling(model, len(tok))
    assert support == SamplingSupport(shared_prefix=False, padded_batch=True)
    assert "cannot be expanded or reordered" in caplog.text
    # the fallback never reorders the cache, so it works on this model as it is
    out = generate_batch(model, specs(tok), tok, support=support)
    assert [len(s.tokens) for s in out[3].sequences] == [10] * 4


def test_float32_head_keeps_tied_weights_and_computes_in_float32(tok):
    model = build_tiny_model(len(tok), arch="llama", seed=0).to(torch.bfloat16)
    ids = torch.tensor([tok.encode("12 + 30 = 42")])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        plain = model(input_ids=ids).logits
        assert use_float32_head(model)
        assert isinstance(model.lm_head, Float32Head)
        assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
        upcast = model(input_ids=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = model(input_ids=ids).logits
    expected = hidden.float() @ model.lm_head.weight.float().T
    assert upcast.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert torch.allclose(upcast, expected, atol=1e-5)
    assert torch.equal(under_autocast, upcast)
    assert not torch.equal(plain.float(), upcast)  # bf16 logits are rounded
