"""Length bounds for the lists and maps of request bodies, checked while a body is parsed.

pydantic checks ``max_length`` while it iterates a list, and with ``fail_fast`` it stops at the first bad item,
so a body holding millions of wrongly typed items costs one error, not millions. The bounds here are
structural: far above any limit a worker enforces (its own limits, e.g. ``--max-seq-len``, are checked after
parsing and may be raised up to these), so the client and every worker parse the same shapes.
"""

from __future__ import annotations

from typing import Annotated, Any

from annotated_types import MaxLen
from pydantic import FailFast

MAX_TOKENS = 1 << 24  # token ids in one list
MAX_ITEMS = 1 << 20  # datums of one op, stop strings, stop token ids
MAX_KEYS = 1 << 12  # entries of a map (loss inputs, loss_fn_config)
MAX_DIMS = 64  # a tensor's shape (numpy's own maximum)


class _FailFast(FailFast):
    """pydantic's FailFast, hashable, so that a bounded list can be a member of a union."""

    def __hash__(self) -> int:
        return hash((FailFast, self.fail_fast))


FAIL_FAST = _FailFast()


def bounded_list(item: Any, max_items: int) -> Any:
    """``list[item]`` of at most ``max_items`` items, validation stopping at the first bad one."""
    return Annotated[list[item], MaxLen(max_items), FAIL_FAST]


def bounded_dict(value: Any, max_items: int) -> Any:
    """``dict[str, value]`` of at most ``max_items`` entries, validation stopping at the first bad value."""
    return Annotated[dict[str, value], MaxLen(max_items), FAIL_FAST]
