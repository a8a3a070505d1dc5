"""Requests that join a running decode batch, a batch decoded in slices, and the vectorised token draw: each
request gets the tokens it gets alone, with logprobs equal to an independent teacher-forced pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server_mock.engine.tiny_model import TINY_FAMILIES, build_tiny_model
from server_mock.sampling import batch_admission, cache_rows, decode_batch
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.sampling.generate import SampleSpec, SamplingSupport, generate, result_of, teacher_forced_logprobs
from server_mock.sampling.token_choice import _exponential_race

TOL = 1e-5


def _specs(tok):
    return [
        SampleSpec(prompt_tokens=tok.encode("what is 45 + 7? the answer is"), num_samples=3, max_tokens=14, seed=1),
        SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=2, max_tokens=9, seed=2, temperature=0.7, top_p=0.9,
                   include_prompt_logprobs=True),
        SampleSpec(prompt_tokens=tok.encode("1 + 2 = 3 and 4 + 4 = 8, so 5 + 5 ="), num_samples=4, max_tokens=6,
                   seed=3, temperature=0),
        SampleSpec(prompt_tokens=tok.encode("7 7 7"), num_samples=2, max_tokens=11, seed=4, top_k=5),
    ]


def _steps(n: int):
    """A ``stop`` for ``DecodeBatch.run`` that yields after ``n`` steps."""
    count = [0]

    def stop() -> bool:
        count[0] += 1
        return count[0] >= n
    return stop


def _check_exact(model, spec, got, solo):
    assert [s.tokens for s in got.sequences] == [s.tokens for s in solo.sequences]
    assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in solo.sequences]
    for seq in got.sequences:
        assert len(seq.tokens) <= spec.max_tokens
        ref = teacher_forced_logprobs(model, spec.prompt_tokens + seq.tokens)[len(spec.prompt_tokens) - 1:]
        assert np.abs(np.asarray(ref) - np.asarray(seq.logprobs)).max() < TOL
    if spec.include_prompt_logprobs:
        assert got.prompt_logprobs == pytest.approx(solo.prompt_logprobs, abs=TOL)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_requests_joining_a_running_batch_get_their_solo_tokens(tok, family):
    """Requests arrive after 0, 2, 5 and 7 steps of the first (prompts longer and shorter than the running
    batch's columns, so both sides get left-padded); the first's stop token makes rows end early too."""
    model = build_tiny_model(len(tok), arch=family, seed=3)
    specs = _specs(tok)
    first = generate(model, specs[0], tok)
    specs[0].stop_token_ids = [first.sequences[1].tokens[3]]
    solo = [generate(model, s, tok) for s in specs]
    assert any(s.stop_reason == "stop" for s in solo[0].sequences)
    batch = DecodeBatch(model, tok)
    handles = batch.admit([specs[0]])
    for spec, after in zip(specs[1:], (2, 3, 2)):
        batch.run(_steps(after))
        assert batch.can_join() and batch.active
        handles += batch.admit([spec])
    batch.run()
    done = {f.handle: result_of(f) for f in batch.take_finished()}
    for spec, handle, alone in zip(specs, handles, solo):
        _check_exact(model, spec, done[handle], alone)


def test_a_batch_decoded_in_slices_between_other_work_is_exact(tok):
    """Two batches on one PEFT model with different adapters, one step at a time in turn (what the queue's
    slices do when two tenants' samplers take turns): each equals its uninterrupted run."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    peft = get_peft_model(build_tiny_model(len(tok), seed=0), config, adapter_name="one")
    peft.add_adapter("two", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    specs = _specs(tok)
    peft.set_adapter("one")
    alone_one = [generate(peft, s, tok) for s in specs[:2]]
    peft.set_adapter("two")
    alone_two = [generate(peft, s, tok) for s in specs[2:]]
    one, two = DecodeBatch(peft, tok), DecodeBatch(peft, tok)
    peft.set_adapter("one")
    h_one = one.admit(specs[:2])
    peft.set_adapter("two")
    h_two = two.admit(specs[2:])
    while one.active or two.active:
        for name, batch in (("one", one), ("two", two)):
            if batch.active:
                peft.set_adapter(name)
                batch.run(_steps(1))
    done_one = {f.handle: result_of(f) for f in one.take_finished()}
    done_two = {f.handle: result_of(f) for f in two.take_finished()}
    for h, alone in zip(h_one, alone_one):
        assert [s.tokens for s in done_one[h].sequences] == [s.tokens for s in alone.sequences]
    for h, alone in zip(h_two, alone_two):
        assert [s.tokens for s in done_two[h].sequences] == [s.tokens for s in alone.sequences]
    peft.set_adapter("two")  # the two adapters sample differently, so a slice run with the wrong one would show
    assert [s.tokens for s in alone_one[0].sequences] != [s.tokens for s in generate(peft, specs[0], tok).sequences]


def test_a_request_finishes_when_its_own_rows_end(tok):
    model = build_tiny_model(len(tok), seed=1)
    short = SampleSpec(prompt_tokens=[5, 6, 7], num_samples=2, max_tokens=3, seed=0, stop_token_ids=[])
    long = SampleSpec(prompt_tokens=[8, 9], num_samples=2, max_tokens=10, seed=1, stop_token_ids=[])
    batch = DecodeBatch(model, tok)
    h_long, h_short = batch.admit([long, short])
    batch.run(lambda: batch.has_finished)
    finished = batch.take_finished()
    assert [f.handle for f in finished] == [h_short] and batch.active
    assert all(len(row.tokens) == 3 for row in finished[0].rows)
    batch.run()
    assert [f.handle for f in batch.take_finished()] == [h_long] and not batch.active


def test_without_stacking_a_request_waits_for_the_running_batch(tok):
    model = build_tiny_model(len(tok), seed=1)
    a = SampleSpec(prompt_tokens=[5, 6, 7], num_samples=2, max_tokens=6, seed=0, stop_token_ids=[])
    b = SampleSpec(prompt_tokens=[8, 9], num_samples=1, max_tokens=4, seed=1, stop_token_ids=[])
    batch = DecodeBatch(model, tok, SamplingSupport(join_running=False))
    batch.admit([a])
    batch.run(_steps(2))
    assert not batch.can_join()
    h_b = batch.admit([b])[0]
    assert batch.live_rows == 2  # b is queued, not prefilled
    batch.run()
    done = {f.handle: result_of(f) for f in batch.take_finished()}
    assert [s.tokens for s in done[h_b].sequences] == [s.tokens for s in generate(model, b, tok).sequences]


def test_dead_rows_stay_until_a_quarter_of_the_rows_are_dead(tok, monkeypatch):
    """The cache keeps its rows while more than 75% are live (7 of 8) and drops the dead ones at exactly 75%."""
    model = build_tiny_model(len(tok), seed=2)
    prompt = tok.encode("5 + 5 = 10 and")
    specs = [SampleSpec(prompt_tokens=prompt, num_samples=1, max_tokens=2, seed=1, stop_token_ids=[]),
             SampleSpec(prompt_tokens=prompt, num_samples=1, max_tokens=4, seed=2, stop_token_ids=[]),
             SampleSpec(prompt_tokens=prompt, num_samples=6, max_tokens=8, seed=3, stop_token_ids=[])]
    solo = [generate(model, s, tok) for s in specs]
    shapes: list[int] = []
    original = batch_admission.forward

    def counting(model_, ids, *args, **kwargs):
        shapes.append(ids.shape[0])
        return original(model_, ids, *args, **kwargs)

    for module in (batch_admission, decode_batch):  # the prefill's call and the decode steps'
        monkeypatch.setattr(module, "forward", counting)
    batch = DecodeBatch(model, tok)
    handles = batch.admit(specs)
    batch.run()
    # prefill: one row per request; after token 2 one row is dead (7 of 8 live: kept), after token 4 two are
    # (6 of 8: the cache keeps the 6 live rows)
    assert shapes == [3, 8, 8, 8, 6, 6, 6, 6]
    done = {f.handle: result_of(f) for f in batch.take_finished()}
    for spec, h, alone in zip(specs, handles, solo):
        _check_exact(model, spec, done[h], alone)


def test_in_place_layers_hand_the_model_the_same_keys_as_concatenation(tok):
    model = build_tiny_model(len(tok), seed=0)
    ids = torch.tensor([tok.encode("12 + 30 = 42")])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        plain, grown = out.past_key_values, model(input_ids=ids, use_cache=True).past_key_values
        cache_rows.give_room(grown, 3)
        kbuf = grown.layers[0]._kbuf
        for t in (5, 6, 7, 8):  # the 4th append goes past the room: the buffer regrows
            step = torch.tensor([[t]])
            a = model(input_ids=step, past_key_values=plain, use_cache=True).logits
            b = model(input_ids=step, past_key_values=grown, use_cache=True).logits
            assert torch.equal(a, b)
        for la, lb in zip(plain.layers, grown.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        assert grown.layers[0]._kbuf is not kbuf and grown.layers[0].keys.shape[-2] == ids.shape[1] + 4


def test_exponential_race_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 20000
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    picked = _exponential_race(probs.expand(n, -1), gens)
    freq = torch.bincount(picked, minlength=6).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert torch.all((freq - probs.double()).abs() <= 4 * sigma + 1e-12), freq
    assert freq[5] == 0  # a zero-probability token is never drawn
    # a row's draw depends on its own generator only
    again = _exponential_race(probs.expand(3, -1), [torch.Generator().manual_seed(i) for i in (7, 8, 9)])
    assert again[0] == picked[7] and again[2] == picked[9]
