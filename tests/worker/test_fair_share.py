"""Cost-fair turns (engine/fairness.py): the backlogged key with the least served cost goes next, ties to the one
that waited longest, a key that comes back is lifted to the others' least counter, weights divide the cost."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from server_mock.engine.fairness import (DECODE_PRICE, MAX_WEIGHT, PREFILL_PRICE, REQUEST_TOKENS, TRAIN_PRICE,
                                         FairShare, Prices, RoundRobin, parse_weight)
from server_mock.engine.jobs import Job


from server_mock.engine.queue import ModelQueue


UNIT = Prices(1.0, 1.0, 1.0, request_tokens=0.0)


class _Setup:
    def __init__(self, policy: FairShare | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        # unit prices, so that equal costs are exactly equal counters (the ties below)
        self.queue = ModelQueue("unit", self.loop, batch_window=0.0, policy=policy or FairShare(UNIT))
        self.order: list[str] = []
        self.gates: dict[str, threading.Event] = {}

    def job(self, owner: str, tag: str, tokens: int = 0, kind: str = "forward_backward", gate: bool = False) -> Job:
        if gate:
            self.gates[tag] = threading.Event()

        def fn() -> dict:
            if tag in self.gates:
                self.gates[tag].wait(30)
            self.order.append(tag)
            return {}

        made = Job(request_id=tag, kind=kind, fn=fn, owner=owner)
        made.tokens = tokens
        return made

    def put(self, *jobs: Job) -> None:
        for job in jobs:
            self.queue.put(job)

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + 20
        while len(self.order) < count:
            assert time.monotonic() < deadline, f"timed out with {self.order}"
            time.sleep(0.002)

    def wait_running(self) -> None:
        deadline = time.monotonic() + 20
        while self.queue.depth() and not self.order:
            assert time.monotonic() < deadline
            time.sleep(0.002)

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()
        self.queue.stop()
        self.loop.close()


@pytest.fixture()
def setup():
    made = []

    def make(policy: FairShare | None = None) -> _Setup:
        made.append(_Setup(policy))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _hold(s: _Setup) -> None:
    """A job of a third key that runs until released, so that what follows is queued before anything runs."""
    s.put(s.job("X", "hold", gate=True))
    deadline = time.monotonic() + 20
    while s.queue.depth():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_the_key_served_less_cost_goes_next(setup):
    s = setup()
    _hold(s)
    s.put(*[s.job("A", f"A{i}", tokens=800) for i in range(3)])
    s.put(*[s.job("B", f"B{i}", tokens=100) for i in range(20)])
    # positions are the policy's turns played forward: A0, then B0..B7 until B has been served A's 800 tokens
    assert [s.queue.position(t) for t in ("A0", "B0", "B7", "A1", "B8")] == [0, 1, 8, 9, 10]
    s.gates["hold"].set()
    s.wait_for(24)
    # after A0 (800 tokens) B catches up (8 x 100); at equal counters the key that waited longer (A) goes first
    assert s.order[1:] == (["A0"] + [f"B{i}" for i in range(8)] + ["A1"] + [f"B{i}" for i in range(8, 16)]
                           + ["A2"] + [f"B{i}" for i in range(16, 20)])
    books = s.queue.fairness()
    assert books["A"]["served_cost"] == 3 * 800 and books["B"]["served_cost"] == 20 * 100


def test_round_robin_takes_jobs_in_turn_whatever_they_cost(setup):
    s = setup(RoundRobin(UNIT))
    _hold(s)
    s.put(*[s.job("A", f"A{i}", tokens=800) for i in range(3)])
    s.put(*[s.job("B", f"B{i}", tokens=100) for i in range(3)])
    s.gates["hold"].set()
    s.wait_for(7)
    assert s.order[1:] == ["A0", "B0", "A1", "B1", "A2", "B2"]


def test_ties_go_to_the_key_that_waited_longest(setup):
    s = setup()
    _hold(s)
    for owner in ("C", "A", "B"):  # equal costs: arrival order, then in turn
        s.put(*[s.job(owner, f"{owner}{i}", tokens=10) for i in range(2)])
    s.gates["hold"].set()
    s.wait_for(7)
    assert s.order[1:] == ["C0", "A0", "B0", "C1", "A1", "B1"]


def test_a_key_that_comes_back_is_lifted_to_the_least_backlogged_counter(setup):
    s = setup()
    _hold(s)
    s.put(s.job("A", "A0", tokens=100), s.job("A", "A1", tokens=100, gate=True),
          *[s.job("A", f"A{i}", tokens=100) for i in range(2, 4)])
    s.gates["hold"].set()
    deadline = time.monotonic() + 20
    while s.queue.depth() > 2:  # A1 is running: A has been charged 200 tokens, B was idle all along
        assert time.monotonic() < deadline
        time.sleep(0.002)
    s.put(*[s.job("B", f"B{i}", tokens=100) for i in range(4)])
    assert s.queue.fairness()["B"]["counter"] == 200  # lifted, nothing served
    assert s.queue.fairness()["B"]["served_cost"] == 0
    s.gates["A1"].set()
    s.wait_for(9)
    # lifted to A's counter, B alternates with A instead of running its 4 jobs first on banked idle time
    assert s.order[1:] == ["A0", "A1", "B0", "A2", "B1", "A3", "B2", "B3"]


def test_lift_never_lowers_and_uses_the_last_leaver_when_none_is_backlogged():
    policy = FairShare()
    policy.charge("A", 500.0)
    policy.charge("B", 50.0)
    policy.activate("A", ["B"])  # A is above B: it stays where it is
    assert policy.counters["A"] == 500.0
    policy.deactivate("A")  # A's backlog empties; nobody else waits
    policy.activate("C", [])
    assert policy.counters["C"] == 500.0  # the last key to leave, not 0: C banks no credit from idle time
    policy.activate("B", ["C"])
    assert policy.counters["B"] == 500.0
    assert policy.served == {"A": 500.0, "B": 50.0}  # lifts are not served cost


def test_weights_divide_the_cost(setup):
    s = setup(FairShare(UNIT, weights={"A": 2.0}))
    _hold(s)
    s.put(*[s.job("A", f"A{i}", tokens=100) for i in range(8)])
    s.put(*[s.job("B", f"B{i}", tokens=100) for i in range(4)])
    s.gates["hold"].set()
    s.wait_for(13)
    # A's counter grows by half of what it is served: two of A's jobs for each of B's
    assert s.order[1:] == ["A0", "B0", "A1", "B1", "A2", "A3", "B2", "A4", "A5", "B3", "A6", "A7"]
    books = s.queue.fairness()
    assert books["A"]["counter"] == pytest.approx(books["A"]["served_cost"] / 2)
    assert books["A"]["weight"] == 2.0 and books["B"]["weight"] == 1.0


def test_prices_are_the_documented_constants():
    prices = Prices()
    assert (prices.train, prices.prefill, prices.decode) == (TRAIN_PRICE, PREFILL_PRICE, DECODE_PRICE)
    assert prices.of_forward("forward_backward", 10) == 10 * TRAIN_PRICE
    assert prices.of_forward("forward", 10) == 10 * PREFILL_PRICE
    assert prices.of_forward("optim_step", 10) == 0
    assert prices.of_sample(7, 3) == 7 * PREFILL_PRICE + 3 * DECODE_PRICE
    assert prices.of_request("forward_backward") == REQUEST_TOKENS * TRAIN_PRICE
    assert prices.of_request("forward") == prices.of_request("sample") == REQUEST_TOKENS * PREFILL_PRICE
    assert prices.of_request("optim_step") == prices.of_request("save_weights") == 0
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    for name, value in (("train", TRAIN_PRICE), ("prefill", PREFILL_PRICE), ("decode", DECODE_PRICE)):
        assert f"| {name} token | {value:g} |" in doc, f"docs/operations.md does not state the {name} price"
    assert f"| a request (fixed) | {REQUEST_TOKENS:g} tokens of its kind |" in doc


def test_a_sample_is_charged_its_exact_tokens_when_it_ends(setup):
    s = setup(FairShare())
    job = Job(request_id="s", kind="sample", fn=lambda: {"input_tokens": 7, "output_tokens": 3}, owner="A")
    s.put(job)
    deadline = time.monotonic() + 20
    while job.status != "succeeded":
        assert time.monotonic() < deadline
        time.sleep(0.002)
    exact = (REQUEST_TOKENS + 7) * PREFILL_PRICE + 3 * DECODE_PRICE  # the request's fixed price, then its tokens
    assert s.queue.fairness()["A"]["served_cost"] == pytest.approx(exact)
    assert job.charged == pytest.approx(exact)
    assert s.queue.fairness()["A"]["requests"] == 1


@pytest.mark.parametrize("value, ok", [("1", True), ("0.5", True), (f"{MAX_WEIGHT:g}", True),
                                       (f"{MAX_WEIGHT + 0.1:g}", False), ("0", False), ("-1", False),
                                       ("abc", False), ("1e3", False), ("nan", False), ("", False)])
def test_weight_bounds(value, ok):
    if ok:
        assert parse_weight(value, "keys line 1") == float(value)
    else:
        with pytest.raises(ValueError, match="keys line 1: weight must be a number > 0 and <= 1000"):
            parse_weight(value, "keys line 1")


def test_a_slice_gives_way_early_to_a_key_served_less(setup):
    """A job in parts holds the model for its slice only while it is the least served: a key that arrives (lifted
    to its counter) gets the turn once it has been served more, long before the slice's time is up."""
    s = setup()
    s.queue.slice_seconds = 60.0  # only the policy can end A's slice early
    parts_done = []

    def parts():
        for i in range(200):
            time.sleep(0.005)
            parts_done.append(i)
            yield 10
        s.order.append("A-long")
        return {}

    long = s.job("A", "A-long", tokens=2000)
    long.open_steps = parts
    s.put(long)
    deadline = time.monotonic() + 20
    while len(parts_done) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    s.put(s.job("B", "B0", tokens=10))
    s.wait_for(2)
    assert s.order == ["B0", "A-long"]
    assert s.queue.fairness()["A"]["served_cost"] == 2000  # its parts, as they ran: 200 x 10 tokens


def test_round_robin_slices_run_their_time():
    assert RoundRobin().yields("A", ["B"]) is False
    policy = FairShare()
    policy.charge("A", 5.0)
    assert policy.yields("A", ["B"]) is True
    assert policy.yields("B", ["A"]) is False


# --- the request's fixed price (Prices.request_tokens) ---------------------------------------------------------


@pytest.mark.parametrize("request_tokens, light_per_heavy", [(50.0, 2), (49.0, 3)])
def test_the_request_price_sets_how_many_small_requests_match_a_large_one(setup, request_tokens, light_per_heavy):
    """A's requests: 100 tokens, B's: 25. Priced by tokens alone B would get 4 turns per A turn; with a fixed price
    of 50 tokens a request A's costs 150 and B's 75, so two of B's match one of A's exactly (a tie: A, which waited
    longer, goes); at 49 (149 against 74 each) two leave B one unit short, so B takes a third turn first."""
    s = setup(FairShare(Prices(1.0, 1.0, 1.0, request_tokens=request_tokens)))
    _hold(s)
    s.put(*[s.job("A", f"A{i}", tokens=100) for i in range(3)])
    s.put(*[s.job("B", f"B{i}", tokens=25) for i in range(3 * light_per_heavy)])
    # the queue's forecast plays the same turns, each job charged its fixed price too
    assert s.queue.position("B0") == 1 and s.queue.position("A1") == 1 + light_per_heavy
    s.gates["hold"].set()
    s.wait_for(1 + 3 + 3 * light_per_heavy)
    assert s.order[1:3 + light_per_heavy] == ["A0"] + [f"B{j}" for j in range(light_per_heavy)] + ["A1"]
    books = s.queue.fairness()
    assert books["A"]["requests"] == 3 and books["B"]["requests"] == 3 * light_per_heavy
    assert books["A"]["served_cost"] == 3 * (100 + request_tokens)
    assert books["B"]["served_cost"] == 3 * light_per_heavy * (25 + request_tokens)


def test_jobs_that_cost_nothing_pay_no_request_price(setup):
    s = setup(FairShare(Prices(1.0, 1.0, 1.0, request_tokens=50.0)))
    s.put(s.job("A", "step", kind="optim_step"), s.job("A", "fb", tokens=10))
    s.wait_for(2)
    books = s.queue.fairness()["A"]
    assert books["requests"] == 1 and books["served_cost"] == 60


def test_a_light_key_waits_for_the_running_job_only(setup):
    """However much a heavy key has queued, a light key that sends one request (lifted to the heavy key's counter,
    which already holds the running job's fixed price) is next: it waits for the job that runs, not the backlog."""
    s = setup(FairShare(Prices(1.0, 1.0, 1.0, request_tokens=50.0)))
    s.put(s.job("A", "A-running", tokens=800, gate=True))
    s.wait_running()
    s.put(*[s.job("A", f"A{i}", tokens=800) for i in range(5)])
    s.put(s.job("B", "B0", tokens=10))
    assert s.queue.position("B0") == 0
    s.gates["A-running"].set()
    s.wait_for(7)
    assert s.order[:2] == ["A-running", "B0"]


def test_weights_divide_the_request_price_too(setup):
    s = setup(FairShare(Prices(1.0, 1.0, 1.0, request_tokens=50.0), weights={"A": 2.0}))
    _hold(s)
    s.put(*[s.job("A", f"A{i}", tokens=100) for i in range(6)])
    s.put(*[s.job("B", f"B{i}", tokens=100) for i in range(3)])
    s.gates["hold"].set()
    s.wait_for(10)
    assert s.order[1:] == ["A0", "B0", "A1", "B1", "A2", "A3", "B2", "A4", "A5"]
    books = s.queue.fairness()
    assert books["A"]["served_cost"] == 6 * 150 and books["A"]["counter"] == pytest.approx(6 * 150 / 2)
