"""The sampling records behind stable_reinforce (service/stability.py): their bounds at the limit and one past,
their age, their scope, and every check a datum's provenance spans go through."""

from __future__ import annotations

import numpy as np
import pytest

from server_mock.config import Limits
from server_mock.errors import WorkerError
from server_mock.service.stability import Span, StabilityRecords

PROMPT = [11, 12, 13, 14]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(**limits) -> tuple[StabilityRecords, Clock]:
    clock = Clock()
    return StabilityRecords(Limits(**limits), clock=clock), clock


def sample(records: StabilityRecords, ids: list[str], tenant: str = "t", scope: str = "s", sampler: str = "smp",
           prompt=PROMPT, length: int = 3) -> None:
    records.record(tenant, scope, sampler, prompt,
                   [(sid, [20 + i for i in range(length)], [-0.5 - i for i in range(length)]) for sid in ids])


def datum(sid: str = "a", prompt=PROMPT, sampled=(20, 21, 22)):
    """rl_loop's layout: input = prompt + sampled[:-1], targets = [0] * (P - 1) + sampled."""
    p, s = len(prompt), len(sampled)
    tokens = np.array(list(prompt) + list(sampled[:-1]), dtype=np.int64)
    targets = np.array([0] * (p - 1) + list(sampled), dtype=np.int64)
    advantages = np.array([0.0] * (p - 1) + [1.0] * s, dtype=np.float32)
    model_spans = [Span("prompt", sid, 0, p), Span("sampled", sid, 0, s - 1)]
    loss_spans = [Span("prompt", sid, 1, p - 1), Span("sampled", sid, 0, s)]
    return tokens, targets, advantages, model_spans, loss_spans


def resolve(records, d, tenant="t", scope="s"):
    return records.resolve(tenant, scope, "data[0]", *d)


def test_resolution_gives_the_recorded_logprobs_on_the_sampled_positions():
    records, _ = make()
    sample(records, ["a"])
    mu, mask = resolve(records, datum())
    np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(mu, [0, 0, 0, -0.5, -1.5, -2.5])


def test_count_bound_at_the_limit_and_one_past():
    records, _ = make(max_recorded_sequences=3)
    sample(records, ["a", "b", "c"])
    assert records.held("t")[0] == 3
    for sid in "abc":
        resolve(records, datum(sid))  # each one used: b, c, a... ends most recently used "c"
    sample(records, ["d"])  # one past: the least recently used ("a") goes
    assert records.held("t")[0] == 3
    with pytest.raises(WorkerError) as e:
        resolve(records, datum("a"))
    assert e.value.status == 400 and "'a' is not held" in e.value.message
    assert e.value.field == "data[0].model_input_spans[0].sequence_id"
    for sid in "bcd":
        resolve(records, datum(sid))


def test_token_bound_counts_a_shared_prompt_once():
    # 2 sequences of 3 tokens + their 4-token prompt once = 10 tokens: exactly at a limit of 10
    records, _ = make(max_recorded_tokens=11)
    sample(records, ["a", "b"])
    assert records.held("t") == (2, 10)
    sample(records, ["c"], prompt=[15])  # 4 more: 14; the oldest sequence goes (its prompt stays for "b"): 11
    assert records.held("t") == (2, 11)
    with pytest.raises(WorkerError):
        resolve(records, datum("a"))
    resolve(records, datum("b"))
    # a limit one lower: "b" goes too, and with it the shared prompt
    records, _ = make(max_recorded_tokens=10)
    sample(records, ["a", "b"])
    sample(records, ["c"], prompt=[15])
    assert records.held("t") == (1, 4)


def test_age_counts_from_the_last_use():
    records, clock = make(recorded_sequence_ttl=100.0)
    sample(records, ["a", "b"])
    clock.now += 99.0
    resolve(records, datum("a"))  # using "a" restarts its time
    clock.now += 2.0  # "b" is now 101 s unused, "a" 2 s
    with pytest.raises(WorkerError) as e:
        resolve(records, datum("b"))
    assert "unused for 100 s" in e.value.message
    clock.now += 98.0
    resolve(records, datum("a"))
    assert records.held("t")[0] == 1


def test_tenants_scopes_and_samplers():
    records, _ = make(max_recorded_sequences=2)
    sample(records, ["a"], tenant="t1", sampler="s1")
    sample(records, ["b", "c"], tenant="t2", sampler="s2")  # another key's volume evicts nothing of t1's
    resolve(records, datum("a"), tenant="t1")
    with pytest.raises(WorkerError) as e:  # another key's sequence does not exist for this one
        resolve(records, datum("b"), tenant="t1")
    assert "is not held" in e.value.message
    with pytest.raises(WorkerError) as e:
        resolve(records, datum("a"), tenant="t1", scope="other-session")
    assert "another session" in e.value.message
    records.drop_sampler("s2")
    assert records.held("t2") == (0, 0)
    records.drop_scope("t1", "s")
    assert records.held("t1") == (0, 0)


@pytest.mark.parametrize("change, field, words", [
    (lambda d: (d[0], d[1], d[2], None, None), "data[0].loss_fn_input_spans", "needs provenance"),
    (lambda d: (d[0], d[1], d[2], d[3], d[4][:1]), "data[0].loss_fn_input_spans", "add up to 6"),
    (lambda d: (np.where(np.arange(6) == 4, 99, d[0]), *d[1:]), "data[0].model_input_spans", "position 4 is 99"),
    (lambda d: (d[0], np.where(np.arange(6) == 5, 99, d[1]), *d[2:]), "data[0].loss_fn_inputs.target_tokens",
     "position 5 is 99"),
    (lambda d: (d[0], d[1], np.where(np.arange(6) == 0, 0.5, d[2]), d[3], d[4]), "data[0].loss_fn_inputs.advantages",
     "position 0"),
    (lambda d: (*d[:4], [Span("prompt", "a", 1, 3), Span("sampled", "a", 1, 3)]), "data[0].loss_fn_input_spans[1]",
     "runs past the 3 sampled tokens"),
])
def test_span_checks(change, field, words):
    records, _ = make()
    sample(records, ["a"])
    with pytest.raises(WorkerError) as e:
        resolve(records, change(datum()))
    assert e.value.status == 400 and e.value.field == field and words in e.value.message


def test_ignored_targets_and_zero_prompt_targets_pass():
    records, _ = make()
    sample(records, ["a"])
    tokens, targets, advantages, model_spans, loss_spans = datum()
    targets[4] = -100  # an ignored sampled position is not compared, and gets the recorded logprob anyway
    advantages[4] = 7.0  # (its advantage does not count: the loss masks it)
    mu, mask = resolve(records, (tokens, targets, advantages, model_spans, loss_spans))
    np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1])
