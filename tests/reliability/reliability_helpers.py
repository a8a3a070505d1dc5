"""Helpers shared by the reliability tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import pytrio_compat as trio

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"


def datum(offset: int = 0, n: int = 20) -> trio.Datum:
    ids = [(7 * i + offset) % 480 + 10 for i in range(n)]
    return trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def saved_state(storage: Path, tc) -> dict[str, bytes]:
    """Weights and Adam state of a run, as saved on disk, for bit-exact comparison."""
    from server_mock.storage import CheckpointStore, parse_path

    path = tc.save_state(f"fingerprint-{tc._next_seq}").result().path
    return CheckpointStore(storage).fingerprint(parse_path(path))


def datum_wire(offset: int = 0, n: int = 20) -> dict:
    """The same datum in the worker's wire format, for raw HTTP requests."""
    from pytrio_compat.types.tensor import WireTensor

    ids = np.asarray([(7 * i + offset) % 480 + 10 for i in range(n)], dtype=np.int64)
    return {"tokens": WireTensor.from_array(ids[:-1]).model_dump(),
            "loss_fn_inputs": {"target_tokens": WireTensor.from_array(ids[1:]).model_dump()}}
