"""Soft-target inputs ([N, K]) in the service's request checks: K and the request's cells at exactly the limit
and one past, the shapes that must agree, and the fields each refusal names."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from server_mock.config import Limits
from server_mock.errors import WorkerError
from server_mock.service.validation import validate_rows

HOST = SimpleNamespace(vocab_size=512, max_seq_len=4096)


def soft(n: int, k: int) -> dict[str, np.ndarray]:
    return {"tokens": np.arange(1, n + 1, dtype=np.int64), "target_tokens": np.ones((n, k), dtype=np.int64),
            "weights": np.full((n, k), 0.5, dtype=np.float32)}


def refused(data, limits: Limits, loss_fn: str = "cross_entropy") -> WorkerError:
    with pytest.raises(WorkerError) as e:
        validate_rows(loss_fn, data, HOST, limits)
    return e.value


def test_k_at_the_limit_and_one_past():
    limits = Limits(max_target_k=8)
    rows = validate_rows("cross_entropy", [soft(5, 8)], HOST, limits)
    assert rows[0]["target_tokens"].shape == (5, 8) and rows[0]["weights"].dtype == np.float32
    e = refused([soft(5, 9)], limits)
    assert e.status == 413 and e.field == "data[0].loss_fn_inputs.target_tokens" and "max_target_k" in e.message
    e = refused([soft(5, 0)], limits)
    assert e.status == 400 and "[1, 8]" in e.message


def test_cells_at_the_limit_and_one_past():
    limits = Limits(max_target_cells=40)
    validate_rows("cross_entropy", [soft(5, 4), soft(5, 4)], HOST, limits)  # 40 cells
    e = refused([soft(5, 4), soft(7, 3)], limits)  # 41
    assert e.status == 413 and e.field == "data" and "41 soft-target cells" in e.message


def test_shapes_must_agree_and_other_losses_stay_1d():
    limits = Limits()
    no_weights = soft(4, 2)
    del no_weights["weights"]
    assert refused([no_weights], limits).field == "data[0].loss_fn_inputs.weights"
    mixed = soft(4, 2)
    mixed["weights"] = np.ones((4, 3), dtype=np.float32)
    assert "same shape" in refused([mixed], limits).message
    hard_targets = soft(4, 2)
    hard_targets["target_tokens"] = np.ones(4, dtype=np.int64)
    assert "need target_tokens of the same shape" in refused([hard_targets], limits).message
    bad_vocab = soft(4, 2)
    bad_vocab["target_tokens"][2, 1] = 600
    e = refused([bad_vocab], limits)
    assert "cell [2, 1]" in e.message and e.code == "token_id_out_of_range"
    ppo = {**soft(4, 2), "logprobs": np.zeros(4, np.float32), "advantages": np.ones(4, np.float32)}
    e = refused([ppo], limits, "ppo")
    assert e.field == "data[0].loss_fn_inputs.target_tokens" and "must have shape [4]" in e.message


def test_recorded_inputs_are_never_taken_from_the_request():
    row = {"tokens": np.arange(1, 5, dtype=np.int64), "target_tokens": np.ones(4, dtype=np.int64),
           "logprobs": np.zeros(4, np.float32), "advantages": np.ones(4, np.float32)}
    e = refused([row], Limits(), "stable_reinforce")
    assert e.field == "data[0].loss_fn_inputs.recorded_logprobs" and "record_stability_info" in e.message
