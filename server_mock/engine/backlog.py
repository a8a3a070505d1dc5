"""``Backlog``: the jobs waiting for one base model's thread, a FIFO lane per tenant, and whose turn it is.

The HTTP loop puts jobs in and reads what waits (``position``, ``depth``, ``waiting``, ``books``). The model's
thread (engine/queue.py ``ModelQueue``) takes its turns here (``next_turn``), takes the queued jobs that join a
batch (``take``, ``queued``), says which owners have work in progress to resume at their turn (``hold``,
``release``), asks whether a slice should give way (``should_yield``, ``others_wait``) and charges the policy
what it runs (``began``, ``charge``). Whose turn it is, of the owners with work, is the policy's choice
(engine/fairness.py). Every method but ``queued`` runs under the backlog's lock; none of them blocks but
``next_turn``, which waits for work.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Generic, Protocol, TypeVar

from server_mock.engine.fairness import FairShare


class Queued(Protocol):
    """What the backlog reads of a job (engine/jobs.py ``Job``)."""

    request_id: str
    kind: str
    owner: str
    tokens: int
    batch_key: str | None
    mix_key: str | None
    batch_cost: int


J = TypeVar("J", bound=Queued)


class Backlog(Generic[J]):
    """The queued jobs of one model by owner (see the module's docstring).

    Each owner has a FIFO lane; a lane exists while its owner has work: a queued job, or work in progress
    (``hold``: a decode batch, a job running in slices) that resumes at the owner's turn, before its lane's next
    job. Of the owners with work, longest waiting first (the one served last behind every other), the ``policy``
    picks whose turn it is; it is told when an owner's backlog begins and ends (``activate``, ``deactivate``).
    """

    def __init__(self, policy: FairShare | None = None) -> None:
        self.policy = policy or FairShare()
        self._lanes: collections.OrderedDict[str, collections.deque[J]] = collections.OrderedDict()
        self._served: str | None = None  # the lane served last: it rejoins the rotation behind new arrivals
        self._held: dict[str, object] = {}  # by owner: its work in progress, to resume at its turn
        self._keys_queued: collections.Counter[str] = collections.Counter()  # queued jobs by batch key
        self._mix_queued: collections.Counter[str] = collections.Counter()  # queued jobs by mix key
        self._cond = threading.Condition()
        self._stopped = False

    # --- what the HTTP loop puts and reads ----------------------------------------------------------------

    def put(self, job: J) -> None:
        with self._cond:
            if not self._ready(job.owner):  # newly backlogged: no credit for the time it was idle
                self.policy.activate(job.owner, [o for o in self._lanes if self._ready(o)])
            lane = self._lanes.get(job.owner)
            if lane is None:
                lane = self._lanes[job.owner] = collections.deque()
            lane.append(job)
            if job.batch_key is not None:
                self._keys_queued[job.batch_key] += 1
            if job.mix_key is not None:
                self._mix_queued[job.mix_key] += 1
            self._cond.notify()

    def position(self, request_id: str) -> int | None:
        """How many queued jobs will be taken before this one, None if not queued: the policy's turns played
        forward on a copy of its books, each job charged what it is expected to cost. Work in progress waiting
        for its owner's turn (a decode batch, a job running in slices) counts as one job ahead of the owner's
        lane."""
        with self._cond:
            lanes = {
                owner: collections.deque(([None] if owner in self._held else []) + list(lane))
                for owner, lane in self._rotation()
            }
            if not any(job is not None and job.request_id == request_id for lane in lanes.values() for job in lane):
                return None
            policy, rotation, taken = self.policy.copy(), list(lanes), 0
            while True:
                owner = policy.pick([o for o in rotation if lanes[o]])
                job = lanes[owner].popleft()
                if job is not None and job.request_id == request_id:
                    return taken
                taken += 1
                if job is not None:
                    policy.charge(owner, self._expected_cost(job))
                rotation.remove(owner)
                rotation.append(owner)

    def depth(self) -> int:
        with self._cond:
            return sum(len(lane) for lane in self._lanes.values())

    def waiting(self) -> collections.Counter[tuple[str, str]]:
        """Queued jobs by (owner, kind), for the operator's queue-depth gauge."""
        with self._cond:
            return collections.Counter((job.owner, job.kind) for lane in self._lanes.values() for job in lane)

    def books(self) -> dict[str, dict[str, float]]:
        """The policy's books per owner (counter, served cost, weight): the metrics and the operator's view."""
        with self._cond:
            return self.policy.books()

    def stop(self) -> None:
        """No more turns: every ``next_turn`` waiting or to come returns None, and ``should_yield`` is True."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # --- what the model's thread takes and tells ----------------------------------------------------------

    def next_turn(self) -> tuple[str, J | None, object | None] | None:
        """The next owner's turn, once there is work (None once stopped): ``(owner, None, work)`` for its work in
        progress to resume (what ``hold`` was given), else ``(owner, job, None)`` for its lane's next job, taken
        off."""
        with self._cond:
            while not self._stopped and not self._lanes:
                self._cond.wait()
            if self._stopped:
                return None
            if self._served in self._lanes:
                self._lanes.move_to_end(self._served)  # behind every lane that waited meanwhile
            owner = self.policy.pick([owner for owner in self._lanes if self._ready(owner)])
            self._served = owner
            if owner in self._held:
                return owner, None, self._held[owner]
            head = self._lanes[owner][0]
            self._pop(owner, head)
            return owner, head, None

    def take(self, fits: Callable[[J], bool], budget: int) -> list[J]:
        """Take every queued job that ``fits`` (called under the lock) and whose batch cost fits what is left of
        ``budget`` (lane order, then job order)."""
        group = []
        with self._cond:
            for owner in list(self._lanes):
                for job in list(self._lanes[owner]):
                    if fits(job) and job.batch_cost <= budget:
                        group.append(job)
                        budget -= job.batch_cost
                        self._pop(owner, job)
        return group

    def queued(self, batch_key: str, mix_key: str | None = None) -> int:
        """How many queued jobs a batch could take: those of ``mix_key`` where it has one (a batch that mixes
        weights), else those of ``batch_key``. Read without the lock (it is asked before every decode step): a
        job put meanwhile is counted at the next ask."""
        if mix_key is not None:
            return self._mix_queued.get(mix_key, 0)
        return self._keys_queued.get(batch_key, 0)

    def hold(self, owner: str, work: object) -> None:
        """``owner`` has ``work`` in progress (a decode batch, a job in slices): its turns resume it, and its lane
        stays while it lasts."""
        with self._cond:
            self._held[owner] = work
            self._lanes.setdefault(owner, collections.deque())

    def release(self, owner: str, work: object) -> None:
        """``owner``'s ``work`` in progress has ended (nothing if another's is held now); its backlog ends too if
        its lane is empty."""
        with self._cond:
            if self._held.get(owner) is work:
                del self._held[owner]
                if not self._lanes.get(owner, True):
                    self._drop_lane(owner)

    def in_progress(self) -> list[object]:
        """Every owner's work in progress (what ``hold`` was given), in the order it began."""
        with self._cond:
            return list(self._held.values())

    def others_wait(self, owner: str) -> bool:
        """Whether an owner other than ``owner`` has work waiting for a turn."""
        with self._cond:
            return any(other != owner and self._ready(other) for other in self._lanes)

    def should_yield(self, owner: str, slice_over: bool) -> bool:
        """Whether ``owner``'s running slice should give way now: the backlog is stopping, or another owner has
        work and either the slice is over or the policy says another's turn is due (``FairShare.yields``)."""
        with self._cond:
            waiting = [o for o in self._lanes if o != owner and self._ready(o)]
            if self._stopped:
                return True
            return bool(waiting) and (slice_over or self.policy.yields(owner, waiting))

    def began(self, owner: str, kind: str) -> float:
        """A job of ``kind`` begins to run for ``owner``: its request's fixed price charged (what was charged)."""
        with self._cond:
            return self.policy.began(owner, kind)

    def charge(self, owner: str, cost: float) -> None:
        """``cost`` served to ``owner`` (negative: an estimate charged earlier was too high)."""
        with self._cond:
            self.policy.charge(owner, cost)

    # --- under the lock -----------------------------------------------------------------------------------

    def _ready(self, owner: str) -> bool:
        return owner in self._held or bool(self._lanes.get(owner))

    def _rotation(self) -> list[tuple[str, collections.deque[J]]]:
        """The owners with work, in the order they will be served (the last-served one last). An owner with work
        in progress keeps its place in the rotation even while its lane is empty."""
        order = [(owner, lane) for owner, lane in self._lanes.items() if owner != self._served and self._ready(owner)]
        if self._served is not None and self._ready(self._served):
            order.append((self._served, self._lanes[self._served]))
        return order

    def _pop(self, owner: str, job: J) -> None:
        lane = self._lanes[owner]
        lane.remove(job)
        if not lane and owner not in self._held:
            self._drop_lane(owner)
        if job.batch_key is not None:
            self._keys_queued[job.batch_key] -= 1
        if job.mix_key is not None:
            self._mix_queued[job.mix_key] -= 1

    def _drop_lane(self, owner: str) -> None:
        """The owner has nothing left (no queued job, nothing in progress): its backlog ends."""
        del self._lanes[owner]
        self.policy.deactivate(owner)

    def _expected_cost(self, job: J) -> float:
        """What a queued job should cost: a forward op its datum tokens; a sample its reservation, as decode;
        either, its request's fixed price."""
        prices = self.policy.prices
        if job.kind == "sample":
            return prices.of_request(job.kind) + prices.of_sample(0, job.tokens or job.batch_cost)
        return prices.of_request(job.kind) + prices.of_forward(job.kind, job.tokens)
