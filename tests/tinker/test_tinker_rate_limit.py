"""The official ``tinker`` SDK over a key's token budget (``--tokens-per-minute``), against a real worker over HTTP:
the request is accepted and held, the SDK's queue-state observers see ``paused_rate_limit`` (with the worker's
reason) while it waits, and once the budget has room it is served, never dropped; then the state is active again.
The budget's clock is the test's, so nothing here waits for a real minute."""

from __future__ import annotations

import time
import warnings

import pytest
import tinker  # the official SDK, pinned in the dev extra
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.public_interfaces.sampling_client import SamplingClient
from tinker.lib.queue_state_logger import QueueStateLogger
from support import FakeClock

BUDGET = 120  # tokens a minute for every key of this worker
WORKER_KEY = "budgeted-key"
CLIENT_KEY = "tml-" + WORKER_KEY


@pytest.fixture()
def budgeted(worker_factory, tiny_model_dir):
    worker = worker_factory("--tokens-per-minute", str(BUDGET), api_keys=[WORKER_KEY], model_name=str(tiny_model_dir))
    if not isinstance(worker.service.budgets.clock, FakeClock):  # one clock for the worker's life: levels stay exact
        worker.service.budgets.clock = FakeClock()
    worker.clock = worker.service.budgets.clock
    worker.clock.advance(60)  # a full bucket, whatever an earlier test left
    yield worker


@pytest.fixture()
def states(monkeypatch):
    """Every queue state the SDK's observers are told of, with its reason: the training client's logger and the
    sampling client (each is its own futures' observer)."""
    seen: list[tuple[QueueState, str | None]] = []
    for cls in (QueueStateLogger, SamplingClient):
        original = cls.on_queue_state_change

        def record(self, queue_state, queue_state_reason, _original=original):
            seen.append((queue_state, queue_state_reason))
            return _original(self, queue_state, queue_state_reason)

        monkeypatch.setattr(cls, "on_queue_state_change", record)
    return seen


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def _answered_429(worker) -> float:
    return sum(s.value for family in worker.service.usage.metrics.requests.collect() for s in family.samples
               if s.name.endswith("_total") and s.labels == {"protocol": "tinker", "code": "429"})


def _datum(first: int, n: int) -> types.Datum:
    ids = list(range(first, first + n + 1))
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def test_a_training_op_over_the_budget_shows_paused_rate_limit_and_is_served(budgeted, states):
    warnings.simplefilter("ignore", FutureWarning)
    client = tinker.ServiceClient(base_url=budgeted.base_url, api_key=CLIENT_KEY)
    try:
        tc = client.create_lora_training_client(base_model=str(budgeted.model_dir), rank=4)
        tc.forward_backward([_datum(10, 60), _datum(10, 60)], "cross_entropy").result(timeout=60)  # the budget
        refused_before = _answered_429(budgeted)
        held = tc.forward_backward([_datum(5, 2)], "cross_entropy")  # 2 tokens past an empty bucket
        step = tc.optim_step(types.AdamParams(learning_rate=1e-3))  # behind it: waits for it, in seq_id order
        _until(lambda: any(state == QueueState.PAUSED_RATE_LIMIT for state, _ in states), "paused_rate_limit")
        reason = next(reason for state, reason in states if state == QueueState.PAUSED_RATE_LIMIT)
        assert "tokens_per_minute" in reason and f"{BUDGET} tokens a minute" in reason
        assert not held.future().done() and not step.future().done()  # held, not refused and not run
        budgeted.clock.advance(1.0)  # 2 tokens back at 2 a second: it fits now
        out = held.result(timeout=60)
        assert len(out.loss_fn_outputs) == 1
        step.result(timeout=60)
        assert states[-1][0] == QueueState.ACTIVE  # the pause ended
        assert _answered_429(budgeted) == refused_before  # accepted at once: the client never had to re-send
    finally:
        client.holder.close() if hasattr(client, "holder") else None


def test_a_sample_over_the_budget_shows_paused_rate_limit_and_is_served(budgeted, states):
    warnings.simplefilter("ignore", FutureWarning)
    client = tinker.ServiceClient(base_url=budgeted.base_url, api_key=CLIENT_KEY)
    try:
        tc = client.create_lora_training_client(base_model=str(budgeted.model_dir), rank=4)
        sampler = tc.save_weights_and_get_sampling_client("paused")  # costs nothing
        tc.forward_backward([_datum(10, 60), _datum(10, 60)], "cross_entropy").result(timeout=60)  # the budget
        refused_before = _answered_429(budgeted)
        held = sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=2,
                              sampling_params=types.SamplingParams(max_tokens=2, seed=1))  # 3 + 2 x 2 tokens
        _until(lambda: any(state == QueueState.PAUSED_RATE_LIMIT for state, _ in states), "paused_rate_limit")
        assert not held.future().done()
        budgeted.clock.advance(3.0)  # 6 tokens back: one short
        time.sleep(1.5)  # the held request looks again (at least once a second): still short, still held
        assert not held.future().done()
        budgeted.clock.advance(0.5)  # 7: it fits
        result = held.result(timeout=60)
        assert len(result.sequences) == 2
        assert _answered_429(budgeted) == refused_before
    finally:
        client.holder.close() if hasattr(client, "holder") else None
