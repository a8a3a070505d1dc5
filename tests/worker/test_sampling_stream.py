"""A sample request's token stream (``SampleSpec.stream``): told every token of every row as the step that sampled
it ends, and, once cancelled, the request's rows end before the next step while the batch decodes on."""

from __future__ import annotations

import pytest

from server_mock.engine.tiny_model import build_tiny_model, build_tiny_tokenizer
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.sampling.generate import SampleSpec, generate, result_of


class Recorder:
    """A ``TokenStream`` that keeps what it is told, with the batch's step count at each token."""

    def __init__(self, steps) -> None:
        self.steps, self.heard, self.cancelled = steps, [], False

    def token(self, sample, position, token, logprob, finished):
        self.heard.append((self.steps(), sample, position, token, logprob, finished))


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(len(tok), seed=3)


def _counting(batch: DecodeBatch) -> list[int]:
    """Count the batch's decode steps (the count in the list, bumped as each step begins)."""
    count = [0]
    step = batch._step

    def counted():
        count[0] += 1
        step()

    batch._step = counted
    return count


def test_every_token_is_told_in_the_step_that_sampled_it(tok, model):
    batch = DecodeBatch(model, tok)
    steps = _counting(batch)
    spec = SampleSpec(prompt_tokens=tok.encode("what is 4 + 5"), num_samples=3, max_tokens=9, seed=1,
                      stop_token_ids=[2])
    spec.stream = Recorder(lambda: steps[0])
    [handle] = batch.admit([spec])
    batch.run()
    result = result_of(next(f for f in batch.take_finished() if f.handle == handle))
    for sample, seq in enumerate(result.sequences):
        heard = [h for h in spec.stream.heard if h[1] == sample]
        assert [h[3] for h in heard] == seq.tokens and [h[4] for h in heard] == seq.logprobs
        assert [h[2] for h in heard] == list(range(len(seq.tokens)))
        assert [h[0] for h in heard] == list(range(1, len(seq.tokens) + 1))  # token k in step k
        assert [h[5] for h in heard] == [None] * (len(seq.tokens) - 1) + [seq.stop_reason]


def test_a_cancelled_request_ends_before_the_next_step_and_the_others_decode_on(tok, model):
    batch = DecodeBatch(model, tok)
    steps = _counting(batch)
    gone = SampleSpec(prompt_tokens=tok.encode("7 7 7"), num_samples=2, max_tokens=30, seed=4)
    gone.stream = Recorder(lambda: steps[0])
    stays = SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=1, max_tokens=12, seed=2, temperature=0.7)
    handles = batch.admit([gone, stays])
    rows = []
    for _ in range(3):
        rows.append(batch.live_rows)
        batch.run(lambda: True)  # one step
    gone.stream.cancelled = True
    rows.append(batch.live_rows)
    batch.run(lambda: True)
    rows.append(batch.live_rows)
    assert rows == [3, 3, 3, 3, 1]  # the cancelled request's two rows are gone after the next step
    batch.run()
    done = {f.handle: result_of(f) for f in batch.take_finished()}
    assert [s.stop_reason for s in done[handles[0]].sequences] == ["cancelled", "cancelled"]
    assert [len(s.tokens) for s in done[handles[0]].sequences] == [3, 3]  # no token sampled after the cancel
    assert len(gone.stream.heard) == 6 and steps[0] == 12
    alone = generate(model, SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=1, max_tokens=12, seed=2,
                                       temperature=0.7), tok)
    assert done[handles[1]].sequences[0].tokens == alone.sequences[0].tokens


def test_cancelling_the_only_request_ends_the_batch(tok, model):
    batch = DecodeBatch(model, tok)
    spec = SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=2, max_tokens=30, seed=5)
    spec.stream = Recorder(lambda: 0)
    [handle] = batch.admit([spec])
    batch.run(lambda: True)
    spec.stream.cancelled = True
    batch.run()
    assert not batch.active
    [finished] = batch.take_finished()
    assert finished.handle == handle and [len(r.tokens) for r in finished.rows] == [1, 1]
    later = SampleSpec(prompt_tokens=tok.encode("then"), num_samples=1, max_tokens=4, seed=6)
    [again] = batch.admit([later])  # the batch takes new requests after it ended
    batch.run()
    assert [f.handle for f in batch.take_finished()] == [again]


def test_a_request_cancelled_before_it_is_admitted_ends_without_a_prefill(tok, model):
    batch = DecodeBatch(model, tok)
    spec = SampleSpec(prompt_tokens=tok.encode("hi"), num_samples=2, max_tokens=30, seed=5)
    spec.stream = Recorder(lambda: 0)
    spec.stream.cancelled = True
    stays = SampleSpec(prompt_tokens=tok.encode("then"), num_samples=1, max_tokens=4, seed=6)
    gone, kept = batch.admit([spec, stays])
    assert batch.live_rows == 1  # only the other request's row was prefilled
    batch.run()
    done = {f.handle: f for f in batch.take_finished()}
    assert [(r.reason, r.tokens) for r in done[gone].rows] == [("cancelled", []), ("cancelled", [])]
    assert spec.stream.heard == [] and len(done[kept].rows[0].tokens) == 4
