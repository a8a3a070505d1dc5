"""Which tenant's job a model queue takes next: the policy object its backlog (engine/backlog.py) asks at every turn.

``FairShare`` is the virtual token counter of "Fairness in Serving Large Language Models" (Sheng et al., OSDI'24):
one counter per tenant (API key) of the cost the model served it, divided by the tenant's weight; the next turn
goes to the backlogged tenant with the smallest counter, ties to the one that waited longest since its last turn
(so jobs that cost nothing take turns exactly as a round robin). A tenant that becomes backlogged is lifted to
the smallest counter among the backlogged tenants (or, when none is, to the counter of the last tenant that left
the backlog), so that idle time is not banked as credit.

Cost is priced per token, across training and sampling alike (``Prices``): a ``forward_backward`` op's datum
tokens at the train price, a ``forward`` op's at the prefill price, a sample request's prompt at the prefill price
and each token it returns at the decode price; and each such request, when it begins to run, a fixed price for
what it costs whatever its tokens (``REQUEST_TOKENS`` tokens of its kind). The defaults are model time measured on
the worker's CPU (docs/operations.md, "Fair scheduling"; ``benchmarks/fairness.py --prices`` measures them again),
relative to one prefill token. ``RoundRobin`` keeps the same books but takes tenants strictly in turn (the order before
costs were counted; the benchmark's baseline).

Everything here is called under the backlog's lock, on the model's thread or the event loop's; nothing here blocks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

# Per-token model time on the worker's CPU, relative to one prefill token (docs/operations.md, "Fair scheduling";
# benchmarks/fairness.py --prices on a SmolLM2-135M-shaped model): a trained token runs forward and backward (the
# backward of a LoRA run computes input gradients and the small adapter's: measured 2.0-2.5x its forward); a
# decoded token is one row of a decode step (measured 2.0x at 16 rows, 7.0x at 4: the rows of a step share one
# read of the weights), priced for the batches RL sampling runs (a group of 8-16 samples and more).
TRAIN_PRICE = 2.0
PREFILL_PRICE = 1.0
DECODE_PRICE = 2.0
# A request also costs a fixed amount whatever its tokens: a pass over the model reads every weight and runs every
# layer's Python once, and the request is checked, queued, encoded and answered. Measured as the intercept of a
# request's model time against its tokens (benchmarks/fairness.py --prices: one datum of 4 tokens against 128 or
# 256), it is on SmolLM2-135M's shape 60 prefill tokens' time for a forward_backward and 25 for a forward: about
# 30 tokens of the request's own kind, at that kind's price. So each request is charged as if it held
# REQUEST_TOKENS more tokens: a forward_backward's at the train price, a forward's and a sample's at the prefill
# price (a sample's prompt is one such pass; its decode steps are shared by the batch and priced per row).
REQUEST_TOKENS = 30.0
MAX_WEIGHT = 1000.0  # a key's weight=W: 0 < W <= MAX_WEIGHT
FORWARD_KINDS = {"forward_backward": "train", "forward": "prefill"}
_NUMBER = re.compile(r"\d+(\.\d+)?")


@dataclass(frozen=True)
class Prices:
    """Cost units per token of each kind, and a request's fixed cost in tokens of its kind."""

    train: float = TRAIN_PRICE
    prefill: float = PREFILL_PRICE
    decode: float = DECODE_PRICE
    request_tokens: float = REQUEST_TOKENS  # a request's fixed cost, in tokens of its kind (``of_request``)

    def of_forward(self, kind: str, tokens: int) -> float:
        """A forward op's cost for ``tokens`` datum tokens (0 for any other kind of job), without the request's
        fixed price (``of_request``)."""
        which = FORWARD_KINDS.get(kind)
        return 0.0 if which is None else getattr(self, which) * max(0, tokens)

    def of_sample(self, prompt_tokens: int, output_tokens: int) -> float:
        """A sample request's token cost, without the request's fixed price (``of_request``)."""
        return self.prefill * max(0, prompt_tokens) + self.decode * max(0, output_tokens)

    def of_request(self, kind: str) -> float:
        """The fixed price of one request of ``kind``, whatever its tokens: ``request_tokens`` at the train price
        for a forward_backward, at the prefill price for a forward or a sample (0 for the jobs that cost nothing)."""
        which = FORWARD_KINDS.get(kind, "prefill" if kind == "sample" else None)
        return 0.0 if which is None else getattr(self, which) * max(0.0, self.request_tokens)


def parse_weight(value: str, where: str) -> float:
    """A keys file's ``weight=W``: a positive decimal number up to ``MAX_WEIGHT`` (ValueError naming ``where``)."""
    if not _NUMBER.fullmatch(value) or not 0 < float(value) <= MAX_WEIGHT:
        raise ValueError(f"{where}: weight must be a number > 0 and <= {MAX_WEIGHT:g} (e.g. weight=2 serves this "
                         "key twice the cost of a weight-1 key while both wait)")
    return float(value)


class FairShare:
    """Virtual token counters per tenant (see the module's docstring). ``weights`` maps a tenant to its weight
    (missing: 1); it is read at every charge, so weights set after the queue was made apply from then on."""

    def __init__(self, prices: Prices | None = None, weights: Mapping[str, float] | None = None) -> None:
        self.prices = prices or Prices()
        self.weights = weights if weights is not None else {}
        self.counters: dict[str, float] = {}  # the virtual counters: served cost / weight, plus lifts
        self.served: dict[str, float] = {}  # the cost actually served, unweighted and never lifted
        self.requests: dict[str, int] = {}  # the priced requests begun (each charged ``prices.request``)
        self._last_left = 0.0  # the counter of the last tenant whose backlog emptied

    def weight(self, owner: str) -> float:
        weight = self.weights.get(owner, 1.0)
        return weight if weight > 0 and math.isfinite(weight) else 1.0

    def pick(self, candidates: list[str]) -> str:
        """The tenant whose turn it is, of ``candidates`` (the backlogged tenants, longest waiting first)."""
        return min(candidates, key=lambda owner: self.counters.get(owner, 0.0))  # min keeps the first of ties

    def yields(self, running: str, waiting: list[str]) -> bool:
        """Whether ``running``'s slice should give way now to one of ``waiting``: one has a smaller counter."""
        mine = self.counters.get(running, 0.0)
        return any(self.counters.get(o, 0.0) < mine for o in waiting)

    def activate(self, owner: str, backlogged: Iterable[str]) -> None:
        """``owner`` has work again while ``backlogged`` (the others) already had: lift its counter."""
        others = [self.counters.get(o, 0.0) for o in backlogged if o != owner]
        floor = min(others) if others else self._last_left
        self.counters[owner] = max(self.counters.get(owner, 0.0), floor)

    def deactivate(self, owner: str) -> None:
        """``owner``'s backlog emptied (no queued job, nothing in progress)."""
        self._last_left = self.counters.get(owner, 0.0)

    def charge(self, owner: str, cost: float) -> None:
        """``cost`` served to ``owner`` (negative: an estimate charged earlier was too high)."""
        if cost == 0:
            return
        self.served[owner] = self.served.get(owner, 0.0) + cost
        self.counters[owner] = self.counters.get(owner, 0.0) + cost / self.weight(owner)

    def began(self, owner: str, kind: str) -> float:
        """A job of ``kind`` begins to run for ``owner``: charge its request's fixed price (``Prices.of_request``);
        what was charged."""
        cost = self.prices.of_request(kind)
        if cost:
            self.requests[owner] = self.requests.get(owner, 0) + 1
            self.charge(owner, cost)
        return cost

    def copy(self) -> FairShare:
        """The same books, to simulate the order of the queued jobs (``Backlog.position``)."""
        other = type(self)(self.prices, self.weights)
        other.counters, other.served, other._last_left = dict(self.counters), dict(self.served), self._last_left
        other.requests = dict(self.requests)
        return other

    def books(self) -> dict[str, dict[str, float]]:
        """Per tenant: its counter, the cost served (the requests' fixed prices included: ``requests`` is how many
        were charged one) and its weight (the metrics and the operator's view)."""
        return {owner: {"counter": self.counters.get(owner, 0.0), "served_cost": self.served.get(owner, 0.0),
                        "requests": self.requests.get(owner, 0), "weight": self.weight(owner)}
                for owner in sorted(set(self.counters) | set(self.served))}


class RoundRobin(FairShare):
    """Tenants strictly in turn, whatever their jobs cost (the counters are kept, but only for reading)."""

    def pick(self, candidates: list[str]) -> str:
        return candidates[0]

    def yields(self, running: str, waiting: list[str]) -> bool:
        return False  # a slice runs its full time
