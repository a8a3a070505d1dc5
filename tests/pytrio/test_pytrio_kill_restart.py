"""kill -9 at chosen moments of a GRPO-shaped loop driven by the official, unmodified ``pytrio`` SDK: the worker
restarts on the same storage (``--durability full``), the SDK retries its connections meanwhile, its actor tokens,
runs and events are there again, and the loop ends with the weights and Adam state of a loop that was never
interrupted, bit for bit, its seeded samples the same tokens and its metrics the same numbers."""

from __future__ import annotations

import ast

import pytest
from pytrio_support import KEY_A, run_sdk
from reliability.kill_helpers import Supervised
from support import WorkerProcess

from server_mock.storage.checkpoints import CheckpointStore, parse_path

STEPS = 3


def plan() -> dict:
    def row(offset: int) -> list[int]:
        return [(offset * 7 + i * 3) % 50 + 2 for i in range(12)]

    return {"model": "tiny", "prompts": [[3, 4, 5 + step] for step in range(STEPS)],
            "batches": [[row(step), row(step + 50)] for step in range(STEPS)]}


def fingerprint(storage, path: str) -> dict[str, bytes]:
    return CheckpointStore(storage).fingerprint(parse_path(path))


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pytrio-uninterrupted")
    worker = WorkerProcess(tiny_model_dir, root / "storage", api_keys=[KEY_A]).start()
    try:
        report = run_sdk(worker, KEY_A, "kill_loop", plan(), root / "sdk", timeout=240)
        return report, fingerprint(root / "storage", report["path"])
    finally:
        worker.stop()


def run_killed(tiny_model_dir, root, crash_at: str, *flags: str) -> tuple[dict, dict, Supervised]:
    supervised = Supervised(tiny_model_dir, root / "storage", *flags, crash_at=crash_at, api_keys=[KEY_A])
    try:
        report = run_sdk(supervised, KEY_A, "kill_loop", plan(), root / "sdk", timeout=240)
        return report, fingerprint(root / "storage", report["path"]), supervised
    finally:
        supervised.stop()


def check(uninterrupted, report, state, supervised) -> None:
    expected, expected_state = uninterrupted
    assert supervised.restarts == 1
    assert report["tokens"] == expected["tokens"]
    assert report["metrics"] == expected["metrics"] and report["optim"] == expected["optim"]
    assert state.keys() == expected_state.keys() and state == expected_state


@pytest.mark.timeout(300)
def test_kill_between_forward_backward_and_optim_step(uninterrupted, tiny_model_dir, tmp_path):
    # the 2nd optim_step as it starts: its forward_backward answered (its gradients pending, never written), the
    # step's event accepted and being polled; both events answer across the restart
    report, state, supervised = run_killed(tiny_model_dir, tmp_path, "optim_step:2")
    check(uninterrupted, report, state, supervised)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash_at", ["forward_backward:1", "forward_backward:3", "optim_step:1", "optim_step:3",
                                      "save_state:1", "sample:2", "state_write:2"])
def test_kill_at_each_point_with_the_pytrio_sdk(crash_at, uninterrupted, tiny_model_dir, tmp_path):
    report, state, supervised = run_killed(tiny_model_dir, tmp_path, crash_at)
    check(uninterrupted, report, state, supervised)


def recovered(root) -> dict:
    """What the restarted worker logged it took up again (service/recovery.py's counts)."""
    line = [x for x in (root / "worker.log").read_text().splitlines() if "recovered from" in x][-1]
    return ast.literal_eval(line.split(": ", 1)[1].strip())


@pytest.mark.timeout(300)
def test_kill_before_the_adapter_exists_runs_the_recorded_init_again(uninterrupted, tiny_model_dir, tmp_path):
    # killed as the first trainer.init_run starts: acknowledged (its body recorded), no adapter made. After the
    # restart it runs again from its record, and the SDK's poll of it gets its answer
    report, state, supervised = run_killed(tiny_model_dir, tmp_path, "init_run:1")
    check(uninterrupted, report, state, supervised)
    counts = recovered(tmp_path)
    assert (counts["runs"], counts["pytrio_training_runs"], counts["pytrio_events_rerun"]) == (0, 1, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_events_recorded_and_journaled_both_run_once(uninterrupted, tiny_model_dir, tmp_path):
    # --pytrio-ack-wait 0: every event is acknowledged with its body recorded before it is handed to the service
    # too; after the kill, an event whose op was journaled answers from the journal, never runs twice (a second
    # forward_backward would double the pending gradients, and the weights would differ), and only the event the
    # SDK sent behind the running one (the optim_step; when the kill came before its hand-off) runs again from its body
    report, state, supervised = run_killed(tiny_model_dir, tmp_path, "forward_backward:2", "--pytrio-ack-wait", "0")
    check(uninterrupted, report, state, supervised)
    counts = recovered(tmp_path)
    assert counts["pytrio_events"] >= 4 and counts["pytrio_events_rerun"] <= 1, counts
