"""service/sessions.py: the per-key cap at the limit and one past it, the tenant-checked lookup, idleness by the
clock at the TTL and one past it, a failed record that adds nothing, and the leases: what a session holds after
leases and releases, what closing it hands back (exactly that, and then nothing more), and that holding leases
does not let another key look the session up."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from server_mock.errors import WorkerError
from server_mock.service.sessions import ClientSessions


@dataclass
class Lease:
    tenant: str
    created: float
    last_seen: float


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def sessions(clock: Clock, cap: int = 2, ttl: float = 10.0) -> ClientSessions[Lease]:
    return ClientSessions(cap, ttl, clock, lambda sid: WorkerError(404, "session_not_found", f"no {sid!r}"),
                          cap_flag="--x-max-sessions", ttl_flag="--x-session-ttl")


def test_the_cap_is_per_key_at_the_limit_and_one_past():
    clock = Clock()
    open_ = sessions(clock)
    open_.open("a1", Lease("A", 1, 1))
    open_.open("a2", Lease("A", 2, 2))  # exactly the cap
    open_.open("b1", Lease("B", 3, 3))  # another key has its own
    with pytest.raises(WorkerError) as refused:
        open_.open("a3", Lease("A", 4, 4))
    assert refused.value.status == 429 and refused.value.code == "too_many_sessions"
    assert "--x-max-sessions=2" in refused.value.message and "--x-session-ttl=10" in refused.value.message
    assert sorted(open_) == ["a1", "a2", "b1"]
    assert [s.created for s in open_.of("A")] == [1, 2]


def test_a_failed_record_adds_nothing():
    open_ = sessions(Clock())

    def full_disk(session):
        raise OSError("no space left")

    with pytest.raises(OSError):
        open_.open("a1", Lease("A", 1, 1), record=full_disk)
    assert len(open_) == 0


def test_lookup_checks_the_tenant_and_marks_the_session_seen():
    clock = Clock()
    open_ = sessions(clock)
    lease = open_.open("a1", Lease("A", 100.0, 100.0))
    for sid, tenant in (("a1", "B"), ("nope", "A"), (None, "A")):
        with pytest.raises(WorkerError) as missing:
            open_.lookup(sid, tenant)
        assert missing.value.status == 404
    clock.now = 105.0
    assert open_.lookup("a1", "A") is lease and lease.last_seen == 105.0


def test_idle_past_the_ttl_by_the_clock():
    clock = Clock()
    open_ = sessions(clock, ttl=10.0)
    lease = open_.open("a1", Lease("A", 100.0, 100.0))
    clock.now = 110.0  # exactly the TTL: still open
    assert open_.idle() == []
    clock.now = 110.001
    assert open_.idle() == [lease]
    assert open_.idle(now=105.0) == []


def test_leases_released_and_what_closing_hands_back():
    open_ = sessions(Clock())
    open_.open("a1", Lease("A", 1, 1))
    open_.open("b1", Lease("B", 2, 2))
    for run in ("r1", "r2", "r3"):
        assert open_.lease("a1", "training", run)
    assert open_.lease("a1", "creation", "a1:train:0", "req-0")
    assert open_.lease("b1", "training", "r9")
    assert open_.release("a1", "training", "r2") and not open_.release("a1", "training", "r2")
    assert not open_.release("a1", "training", "r9")  # b1's, not a1's
    assert open_.lease("a1", "training", "r1", "again")  # leased again: its value changes, its place stays
    assert list(open_.leases("a1", "training").items()) == [("r1", "again"), ("r3", None)]
    assert open_.leases("a1", "creation")["a1:train:0"] == "req-0" and not open_.leases("a1", "sampler")
    assert open_.holder("training", "r3") == "a1" and open_.holder("training", "r9") == "b1"
    assert open_.holder("training", "r2") is None

    closed = open_.close("a1")
    assert closed == {"training": {"r1": "again", "r3": None}, "creation": {"a1:train:0": "req-0"}}
    assert list(closed["training"]) == ["r1", "r3"]
    assert "a1" not in open_ and not open_.leases("a1", "training") and open_.holder("training", "r1") is None
    assert not open_.lease("a1", "training", "r4")  # a closed session leases nothing more
    assert not open_.release("a1", "training", "r3") and open_.close("a1") == {}
    assert list(open_.leases("b1", "training")) == ["r9"] and open_.holder("training", "r9") == "b1"
    assert open_.close("nope") == {}


def test_leases_do_not_let_another_key_look_the_session_up():
    clock = Clock()
    open_ = sessions(clock)
    lease = open_.open("b1", Lease("B", 100.0, 100.0))
    open_.lease("b1", "sampler", "s1")
    clock.now = 105.0
    with pytest.raises(WorkerError) as missing:
        open_.lookup("b1", "A")
    assert missing.value.status == 404 and lease.last_seen == 100.0  # not marked seen by the other key
    assert open_.lookup("b1", "B") is lease and list(open_.leases("b1", "sampler")) == ["s1"]
