"""Several sample requests decoded as one batch give each request exactly what it gets alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pytrio_compat as trio
from server_mock.engine.tiny_model import build_tiny_model, build_tiny_tokenizer
from server_mock.sampling.generate import SampleSpec, generate, generate_batch, teacher_forced_logprobs


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    return build_tiny_model(len(tok)), tok


def test_batched_requests_match_solo_requests_token_for_token(tiny):
    model, tok = tiny
    specs = [
        SampleSpec(prompt_tokens=tok.encode("1 + 2 = 3"), num_samples=3, max_tokens=20, seed=1, stop_token_ids=[2]),
        SampleSpec(prompt_tokens=tok.encode("what is 45 + 7? The answer"), num_samples=2, max_tokens=12, seed=2,
                   temperature=0.7, top_p=0.9, include_prompt_logprobs=True),
        SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=4, max_tokens=25, seed=3, temperature=0,
                   stop_strings=["99"]),
        SampleSpec(prompt_tokens=tok.encode("7 7 7 7 7 7 7"), num_samples=1, max_tokens=5, seed=4, top_k=5),
    ]
    solo = [generate(model, s, tok) for s in specs]
    batched = generate_batch(model, specs, tok)
    worst = 0.0
    for spec, a, b in zip(specs, solo, batched):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.stop_reason for s in a.sequences] == [s.stop_reason for s in b.sequences]
        assert all(len(s.tokens) <= spec.max_tokens for s in b.sequences)
        for seq in b.sequences:
            # left padding must not change the numbers: compare with an unpadded teacher-forced pass
            ref = teacher_forced_logprobs(model, spec.prompt_tokens + seq.tokens)[len(spec.prompt_tokens) - 1:]
            worst = max(worst, float(np.abs(np.asarray(ref) - np.asarray(seq.logprobs)).max()))
    assert solo[1].prompt_logprobs == pytest.approx(batched[1].prompt_logprobs, abs=1e-6)
    assert worst < 1e-5


def test_concurrent_requests_to_the_worker_are_coalesced(service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=0)
    sampler = tc.save_weights_and_get_sampling_client()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = [trio.SamplingParams(max_tokens=12, seed=i, stop=[]) for i in range(4)]

    async def together():
        return await asyncio.gather(*[sampler.sample_async(trio.ModelInput.from_ints(p), num_samples=4,
                                                           sampling_params=sp) for p, sp in zip(prompts, params)])

    batched = asyncio.run(together())
    solo = [sampler.sample(trio.ModelInput.from_ints(p), num_samples=4, sampling_params=sp).result()
            for p, sp in zip(prompts, params)]
    assert max(r.metrics["batch_requests"] for r in batched) > 1
    for a, b in zip(batched, solo):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
