"""Fixed-shape decode steps (the CUDA-graph path, run eagerly here): the same tokens as the dynamic path, logprobs
equal to a teacher-forced pass, through joins and compactions; the buckets; the compiled step (slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server_mock.engine.tiny_model import build_tiny_model
from server_mock.sampling import static_steps
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.sampling.generate import SampleSpec, generate, generate_batch, result_of, teacher_forced_logprobs
from server_mock.sampling.static_steps import StaticSteps, bucket_columns, bucket_rows

STATIC_FAMILIES = ["qwen2", "llama", "qwen3", "qwen3_moe", "qwen3_5", "lfm2"]


def _specs(tok):
    return [SampleSpec(prompt_tokens=tok.encode("what is 45 + 7? the answer is"), num_samples=3, max_tokens=14, seed=1),
            SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=2, max_tokens=6, seed=2, temperature=0.7,
                       stop_token_ids=[]),
            SampleSpec(prompt_tokens=tok.encode("1 + 2 = 3 and 4 + 4 = 8, so 5 + 5 ="), num_samples=5, max_tokens=9,
                       seed=3, temperature=0, stop_token_ids=[])]


@pytest.mark.parametrize("family", STATIC_FAMILIES + ["gemma3", "mistral"])
def test_fixed_shape_steps_give_the_dynamic_path_s_results(tok, family, monkeypatch):
    model = build_tiny_model(len(tok), arch=family, seed=3)
    specs = _specs(tok)
    specs[0].stop_token_ids = [generate(model, specs[0], tok).sequences[0].tokens[2]]  # rows end: compaction
    solo = [generate(model, s, tok) for s in specs]
    calls = []
    original = StaticSteps.step
    monkeypatch.setattr(StaticSteps, "step", lambda self, feed: calls.append(len(feed)) or original(self, feed))
    steps = StaticSteps(model, compile=False)
    batch = DecodeBatch(model, tok, static=steps)
    handles = batch.admit(specs[:1])
    count = [0]
    batch.run(lambda: (count.__setitem__(0, count[0] + 1), count[0] >= 3)[1])
    handles += batch.admit(specs[1:])  # joins three steps in: the state leaves the bucket and comes back
    batch.run()
    done = {f.handle: result_of(f) for f in batch.take_finished()}
    for spec, handle, alone in zip(specs, handles, solo):
        got = done[handle]
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
        assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in alone.sequences]
        for seq in got.sequences:
            ref = teacher_forced_logprobs(model, spec.prompt_tokens + seq.tokens)[len(spec.prompt_tokens) - 1:]
            assert np.abs(np.asarray(ref) - np.asarray(seq.logprobs)).max() < 1e-5
    if family in STATIC_FAMILIES:
        assert len(calls) > 10 and max(calls) > 3  # the fixed-shape path ran the steps, also after the join
    else:  # a sliding-window cache is not taken: the dynamic path decodes
        with torch.no_grad():
            cache = model(input_ids=torch.tensor([[5, 6]]), use_cache=True).past_key_values
        assert calls == [] and not StaticSteps.supports(cache)


def test_buckets_at_their_edges():
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 255, 256, 257)] == [1, 2, 4, 4, 8, 8, 16, 256, 256, 512]
    assert [bucket_columns(n) for n in (1, 255, 256, 257, 512, 513)] == [256, 256, 256, 512, 512, 768]


def test_a_bucket_is_reused_and_only_a_few_are_kept(tok, monkeypatch):
    model = build_tiny_model(len(tok), seed=1)
    steps = StaticSteps(model, compile=False)
    spec = SampleSpec(prompt_tokens=[5, 6, 7], num_samples=3, max_tokens=4, seed=0, stop_token_ids=[])
    generate_batch(model, [spec], tok, static=steps)
    first = dict(steps._buckets)
    generate_batch(model, [spec], tok, static=steps)
    assert steps._buckets == first  # same rows bucket (4) and columns bucket (256): the same static cache
    assert list(first) == [(4, 256)]
    for rows in (1, 2, 8, 16):  # four more shapes: the least recently used one goes
        generate_batch(model, [SampleSpec(prompt_tokens=[5, 6, 7], num_samples=rows, max_tokens=2, seed=0,
                                          stop_token_ids=[])], tok, static=steps)
    assert len(steps._buckets) == static_steps.KEPT_BUCKETS and (4, 256) not in steps._buckets


@pytest.mark.slow
@pytest.mark.timeout(1800)  # inductor compiles the step once (minutes on a loaded 2-core CPU)
def test_compiled_fixed_shape_steps_are_exact(tok):
    """torch.compile of the fixed-shape step (inductor on a CPU; on CUDA the same call captures a CUDA graph)."""
    model = build_tiny_model(len(tok), seed=3)
    spec = SampleSpec(prompt_tokens=tok.encode("what is 45 + 7? the answer is"), num_samples=3, max_tokens=10,
                      seed=1, stop_token_ids=[])
    ref = generate(model, spec, tok)
    got = generate_batch(model, [spec], tok, static=StaticSteps(model, compile=True))[0]
    assert [s.tokens for s in got.sequences] == [s.tokens for s in ref.sequences]
    for a, b in zip(got.sequences, ref.sequences):
        assert np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs)).max() < 1e-5
