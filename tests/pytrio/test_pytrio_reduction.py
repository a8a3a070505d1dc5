"""The reduction of a PyTRIO forward_backward call (docs/pytrio.md): each event's summed loss is scaled by
1 / total_active_tokens of its call, so a call's gradient does not depend on how the SDK split it.

The worker here hands out ``max_batch_size=1``, so the unmodified SDK sends each call as one event per datum; the
same calls sent as one event each (raw msgpack, same seed) must give the same aggregated metrics, the same
gradient norm and the same weights after the step, and both must equal this project's own SDK (whose losses are
plain sums) fed the same data with weights or advantages divided by the call's active tokens."""

from __future__ import annotations

import numpy as np
import pytest
from pytrio_support import KEY_A, run_sdk
from pytrio_raw import RawClient, datum, totals
from transformers import AutoTokenizer

import pytrio_compat as ours

pytest.importorskip("pytrio", reason="the official pytrio SDK (the dev extra) is not installed")

TEXTS = ["12 + 30 = 42. The answer is 42.", "7 + 8 = 15", "what is 3 + 4? it is 7.", "one two three four", "9 - 4 = 5"]


@pytest.fixture(scope="module")
def chunking_worker(worker_factory):
    return worker_factory("--pytrio-max-batch-size", "1", api_keys=[KEY_A])


def _rows(tokenizer, loss: str, rng) -> list[dict]:
    rows = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        n = len(ids) - 1
        target = list(ids[1:])
        target[0] = -100
        row = {"tokens": ids[:-1], "target_tokens": target}
        if loss == "cross_entropy":
            weights = rng.uniform(0.2, 1.5, n).round(4)
            weights[1] = 0.0
            row["weights"] = weights.tolist()
        else:
            row["logprobs"] = (-rng.uniform(0.5, 4.0, n)).round(4).tolist()
            row["advantages"] = rng.normal(0, 1, n).round(4).tolist()
        rows.append(row)
    return rows


def _active(loss: str, rows: list[dict]) -> int:
    count = 0
    for row in rows:
        mask = np.asarray(row["target_tokens"]) != -100
        if loss == "cross_entropy":
            mask &= np.asarray(row["weights"]) != 0
        count += int(mask.sum())
    return count


def _wire(row: dict) -> dict:
    inputs = {k: v for k, v in row.items() if k not in ("tokens", "target_tokens")}
    return datum(row["tokens"], row["target_tokens"], **inputs)


LOSSES = ("cross_entropy", "importance_sampling")


@pytest.fixture(scope="module")
def cases(chunking_worker, tiny_model_dir, tmp_path_factory):
    """Each loss's calls and probe, and what the SDK reported for them (one SDK process for all)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rng = np.random.default_rng(1)
    calls = {}
    for loss in LOSSES:
        rows = _rows(tokenizer, loss, rng)
        calls[loss] = [rows[:3], rows[3:]]  # two calls before one step: gradients add up across them
    probe_ids = tokenizer.encode("the quick brown fox")
    probe = {"tokens": probe_ids[:-1], "target_tokens": probe_ids[1:]}
    plan = {"model": "tiny", "probe": probe, "cases": [{"loss": loss, "calls": calls[loss]} for loss in LOSSES]}
    reports = run_sdk(chunking_worker, KEY_A, "chunked_calls", plan, tmp_path_factory.mktemp("sdk"))
    return {loss: (calls[loss], probe, report) for loss, report in zip(LOSSES, reports)}


@pytest.mark.parametrize("loss", LOSSES)
def test_a_call_split_in_events_equals_the_call_in_one(chunking_worker, cases, loss):
    calls, probe, sdk = cases[loss]
    assert sdk["limits"][0] == 1
    assert [c["next_index"] for c in sdk["calls"]] == [5, 7]  # init, then 3 events, then 2: one per datum

    # the same two calls, each as one event, on a run with the same initial adapter
    raw = RawClient(chunking_worker.base_url, KEY_A)
    try:
        run = raw.training_run(raw.session())
        assert run.init(run.created["model_id"])["status"] == "succeeded"
        one_event = []
        for call in calls:
            active = _active(loss, call)
            advantage = sum(int(np.count_nonzero(np.asarray(r["advantages"])[np.asarray(r["target_tokens"]) != -100]))
                            for r in call) if loss != "cross_entropy" else 0
            answer = run.run("trainer.forward_backward", {
                "data": [_wire(r) for r in call], "auto_shift": False, "loss": {"type": loss, "config": {}},
                "gradient_accumulation": totals(len(call), active, advantage)})
            assert answer["status"] == "succeeded", answer
            one_event.append(answer["result"])
        step = run.run("trainer.optimize_step", {"adam_params": {
            "learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}})
        probe_answer = run.run("trainer.forward", {
            "data": [_wire(probe)], "auto_shift": False, "loss": {"type": "cross_entropy", "config": {}},
            "gradient_accumulation": totals(1, len(probe["tokens"]))})
    finally:
        raw.close()
    for split, whole, call in zip(sdk["calls"], one_event, calls):
        metrics = whole["metrics"]
        assert split["metrics"]["token_count"] == metrics["token_count"] == _active(loss, call)
        assert split["metrics"]["loss_sum"] == pytest.approx(metrics["loss_sum"], rel=1e-6, abs=1e-6)
        assert split["metrics"]["loss_mean"] == pytest.approx(metrics["loss_sum"] / metrics["token_count"], rel=1e-6,
                                                              abs=1e-7)
        for lp, out in zip(split["logprobs"], whole["loss_fn_outputs"]):  # padded with others or alone: ~1 ulp
            np.testing.assert_allclose(lp, np.frombuffer(out["logprobs"]["data"], "<f4"), atol=1e-6, rtol=0)
    assert sdk["optim"]["grad_norm"] == pytest.approx(step["result"]["metrics"]["grad_norm"], rel=1e-6)
    after = np.frombuffer(probe_answer["result"]["loss_fn_outputs"][0]["logprobs"]["data"], "<f4")
    np.testing.assert_allclose(sdk["probe"], after, atol=1e-6, rtol=0)

    # the rule itself, against plain summed losses: divide each call's weights (or advantages) by its active tokens
    scaled_key = "weights" if loss == "cross_entropy" else "advantages"
    client = ours.ServiceClient(base_url=chunking_worker.base_url, api_key=KEY_A)
    try:
        reference = client.create_lora_training_client("tiny", rank=8, seed=7)
        for call in calls:
            active = _active(loss, call)
            data = [ours.Datum(model_input=ours.ModelInput.from_ints(r["tokens"]), loss_fn_inputs={
                **{k: np.asarray(v, dtype=np.float32) for k, v in r.items() if k not in ("tokens", "target_tokens")},
                "target_tokens": np.asarray(r["target_tokens"], dtype=np.int64),
                scaled_key: np.asarray(r[scaled_key], dtype=np.float32) / active}) for r in call]
            reference.forward_backward(data, loss).result()
        summed = reference.optim_step(ours.AdamParams(learning_rate=1e-2)).result()
    finally:
        client.close()
    assert sdk["optim"]["grad_norm"] == pytest.approx(summed.metrics["grad_norm"], rel=1e-5)
