"""Tests for the KV-cached sampler in server_mock.sampling, checked against independent forward passes."""

from __future__ import annotations

import pytest
import torch

from server_mock.engine.tiny_model import build_tiny_model
from server_mock.sampling.generate import SampleSpec, generate, teacher_forced_logprobs

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(len(tok), seed=0)


@pytest.fixture(scope="module")
def prompt(tok):
    msgs = [{"role": "user", "content": "What is 17 + 25? Think step by step."}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])


def ref_logprob_table(model, ids: list[int]) -> torch.Tensor:
    """Independent reference: full forward, float32 log_softmax. Row i is the distribution of token i+1."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def ref_completion_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    table = ref_logprob_table(model, prompt + completion)
    rows = table[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return rows.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced(model, prompt, temperature):
    res = generate(model, SampleSpec(prompt, num_samples=4, max_tokens=24, temperature=temperature, seed=7))
    assert len(res.sequences) == 4
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == 24
        assert seq.stop_reason == "length"
        ref = ref_completion_logprobs(model, prompt, seq.tokens)
        assert max_abs_diff(seq.logprobs, ref) <= TOL
        # teacher_forced_logprobs helper agrees with the independent computation too.
        helper = teacher_forced_logprobs(model, prompt + seq.tokens)
        assert len(helper) == len(prompt) + len(seq.tokens) - 1
        assert max_abs_diff(helper[len(prompt) - 1 :], ref) <= TOL


def test_prefill_happens_once(model, prompt):
    calls: list[tuple[int, ...]] = []
    original = model.forward

    def counting_forward(*args, **kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    model.forward = counting_forward
    try:
        res = generate(model, SampleSpec(prompt, num_samples=8, max_tokens=10, seed=1))
    finally:
        del model.forward
    assert all(len(s.tokens) == 10 for s in res.sequences)
    steps = max(len(s.tokens) for s in res.sequences)
    assert len(calls) == 1 + (
        steps - 1
    )  # one prefill, then one forward per further token for all rows together
    assert calls[0] == (1, len(prompt))
    assert all(shape == (8, 1) for shape in calls[1:])


def test_seed_reproducibility(model, prompt):
    spec = {"num_samples": 4, "max_tokens": 12, "temperature": 1.0}
    a = generate(model, SampleSpec(prompt, seed=11, **spec))
    b = generate(model, SampleSpec(prompt, seed=11, **spec))
    c = generate(model, SampleSpec(prompt, seed=12, **spec))
    toks_a = [s.tokens for s in a.sequences]
    assert toks_a == [s.tokens for s in b.sequences]
    assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
    assert len({tuple(t) for t in toks_a}) == 4  # rows differ
    assert toks_a != [s.tokens for s in c.sequences]
    # Row r's stream does not depend on how many rows are sampled alongside it.
    fewer = generate(model, SampleSpec(prompt, seed=11, num_samples=2, max_tokens=12))
    assert [s.tokens for s in fewer.sequences] == toks_a[:2]
    # No seed: fresh randomness each call.
    u1 = generate(model, SampleSpec(prompt, num_samples=2, max_tokens=12))
    u2 = generate(model, SampleSpec(prompt, num_samples=2, max_tokens=12))
    assert [s.tokens for s in u1.sequences] != [s.tokens for s in u2.sequences]


def test_greedy_is_argmax_and_top_k_1_equals_greedy(model, prompt):
    greedy = generate(model, SampleSpec(prompt, num_samples=2, max_tokens=16, temperature=0.0))
    completion = greedy.sequences[0].tokens
    assert greedy.sequences[1].tokens == completion
    table = ref_logprob_table(model, prompt + completion)
    for i, t in enumerate(completion):
        assert int(table[len(prompt) - 1 + i].argmax()) == t
    assert (
        max_abs_diff(greedy.sequences[0].logprobs, ref_completion_logprobs(model, prompt, completion)) <= TOL
    )

    top1 = generate(model, SampleSpec(prompt, num_samples=3, max_tokens=16, temperature=1.3, top_k=1, seed=5))
    assert all(s.tokens == completion for s in top1.sequences)
    tiny_p = generate(model, SampleSpec(prompt, num_samples=2, max_tokens=16, top_p=1e-6, seed=5))
    assert all(s.tokens == completion for s in tiny_p.sequences)


def test_top_k_and_top_p_restrict_support(model, prompt):
    k = 5
    res = generate(model, SampleSpec(prompt, num_samples=4, max_tokens=12, temperature=1.0, top_k=k, seed=3))
    for seq in res.sequences:
        table = ref_logprob_table(model, prompt + seq.tokens)
        for i, t in enumerate(seq.tokens):
            assert t in table[len(prompt) - 1 + i].topk(k).indices.tolist()
        # Returned logprobs are still the unfiltered model's.
        assert max_abs_diff(seq.logprobs, ref_completion_logprobs(model, prompt, seq.tokens)) <= TOL

    top_p, temp = 0.05, 0.8
    res = generate(
        model, SampleSpec(prompt, num_samples=4, max_tokens=12, temperature=temp, top_p=top_p, seed=4)
    )
    for seq in res.sequences:
        table = ref_logprob_table(model, prompt + seq.tokens)
        for i, t in enumerate(seq.tokens):
            probs = torch.softmax(table[len(prompt) - 1 + i] / temp, dim=-1)
            sorted_p, order = probs.sort(descending=True)
            n_keep = int((sorted_p.cumsum(0) < top_p).sum()) + 1  # smallest prefix reaching top_p
            nucleus = set(order[: n_keep + 1].tolist())  # +1 slack for float ties at the boundary
            assert t in nucleus
        assert max_abs_diff(seq.logprobs, ref_completion_logprobs(model, prompt, seq.tokens)) <= TOL


def test_stop_token_ids(model, prompt):
    base = generate(model, SampleSpec(prompt, num_samples=3, max_tokens=20, seed=21))
    row0 = base.sequences[0].tokens
    stop_tok = row0[5]
    cut = row0.index(stop_tok) + 1
    res = generate(
        model, SampleSpec(prompt, num_samples=3, max_tokens=20, seed=21, stop_token_ids=[stop_tok])
    )
    seq = res.sequences[0]
    assert seq.tokens == row0[:cut]
    assert seq.tokens[-1] == stop_tok
    assert seq.stop_reason == "stop"
    assert seq.logprobs == pytest.approx(base.sequences[0].logprobs[:cut], abs=TOL)
    for base_seq, seq in zip(base.sequences[1:], res.sequences[1:]):
        if stop_tok in base_seq.tokens:
            assert seq.tokens == base_seq.tokens[: base_seq.tokens.index(stop_tok) + 1]
            assert seq.stop_reason == "stop"
        else:
            assert seq.tokens == base_seq.tokens and seq.stop_reason == "length"
        assert max_abs_diff(seq.logprobs, ref_completion_logprobs(model, prompt, seq.tokens)) <= TOL


def test_stop_strings(model, tok, prompt):
    base = generate(model, SampleSpec(prompt, num_samples=2, max_tokens=20, seed=8))
    row0 = base.sequences[0].tokens
    text = tok.decode(row0, skip_special_tokens=False)
    stop = text[len(tok.decode(row0[:6], skip_special_tokens=False)) - 1 :][:3]
    assert len(stop) == 3
    expected_cut = next(
        k for k in range(1, len(row0) + 1) if stop in tok.decode(row0[:k], skip_special_tokens=False)
    )
    res = generate(
        model, SampleSpec(prompt, num_samples=2, max_tokens=20, seed=8, stop_strings=[stop]), tokenizer=tok
    )
    assert res.sequences[0].tokens == row0[:expected_cut]
    assert res.sequences[0].stop_reason == "stop"
    with pytest.raises(ValueError):
        generate(model, SampleSpec(prompt, max_tokens=4, stop_strings=["x"]))


def test_max_tokens_length(model, prompt):
    res = generate(model, SampleSpec(prompt, num_samples=2, max_tokens=3, seed=0, stop_token_ids=[]))
    assert all(len(s.tokens) == 3 and s.stop_reason == "length" for s in res.sequences)
    assert res.prompt_logprobs is None and res.topk_prompt_logprobs is None


def test_prompt_logprobs(model, prompt):
    res = generate(
        model,
        SampleSpec(
            prompt, num_samples=1, max_tokens=2, seed=0, include_prompt_logprobs=True, topk_prompt_logprobs=3
        ),
    )
    table = ref_logprob_table(model, prompt)
    ref = table[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert len(res.prompt_logprobs) == len(prompt)
    assert res.prompt_logprobs[0] is None
    assert max_abs_diff(res.prompt_logprobs[1:], ref) <= TOL
    assert res.topk_prompt_logprobs[0] is None
    assert len(res.topk_prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        vals, idx = table[i - 1].topk(3)
        got = res.topk_prompt_logprobs[i]
        assert [t for t, _ in got] == idx.tolist()
        assert max_abs_diff([v for _, v in got], vals.tolist()) <= TOL


def test_peft_wrapped_model(tok, prompt):
    from peft import LoraConfig, get_peft_model

    base = build_tiny_model(len(tok), seed=0)
    plain = build_tiny_model(len(tok), seed=0)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules="all-linear")
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft_model.train()  # the sampler must disable LoRA dropout and restore the mode afterwards
    res = generate(
        peft_model, SampleSpec(prompt, num_samples=4, max_tokens=16, seed=2, include_prompt_logprobs=True)
    )
    assert peft_model.training
    peft_model.eval()
    for seq in res.sequences:
        ref = ref_completion_logprobs(peft_model, prompt, seq.tokens)
        assert max_abs_diff(seq.logprobs, ref) <= TOL
        assert max_abs_diff(seq.logprobs, ref_completion_logprobs(plain, prompt, seq.tokens)) > 1e-2
    ref_prompt = ref_logprob_table(peft_model, prompt)[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[
        :, 0
    ]
    assert max_abs_diff(res.prompt_logprobs[1:], ref_prompt.tolist()) <= TOL


def test_llama_arch(tok, prompt):
    m = build_tiny_model(len(tok), arch="llama", seed=1)
    res = generate(m, SampleSpec(prompt, num_samples=2, max_tokens=10, seed=0))
    for seq in res.sequences:
        assert max_abs_diff(seq.logprobs, ref_completion_logprobs(m, prompt, seq.tokens)) <= TOL
