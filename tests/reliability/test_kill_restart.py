"""kill -9 at chosen moments of a training loop (our SDK): the worker restarts on the same storage, the unchanged
loop carries on without an error, and the run ends with weights and Adam state bit-identical to a loop that was
never interrupted, its samples the same tokens."""

from __future__ import annotations

import pytest
from support import WorkerProcess

import pytrio_compat as trio
from server_mock.storage.checkpoints import CheckpointStore, parse_path

from .kill_helpers import Supervised
from .reliability_helpers import datum

STEPS = 3


def training_loop(client: trio.ServiceClient) -> tuple[str, list[list[int]]]:
    """A GRPO-shaped loop: snapshot -> seeded samples -> two forward_backward -> optim_step, then save_state."""
    tc = client.create_lora_training_client("tiny", rank=4, seed=5)
    tokens = []
    for step in range(STEPS):
        sampler = tc.save_weights_and_get_sampling_client()
        result = sampler.sample(trio.ModelInput.from_ints([3, 4, 5 + step]), num_samples=2,
                                sampling_params=trio.SamplingParams(max_tokens=4, seed=11 + step)).result()
        tokens += [list(s.tokens) for s in result.sequences]
        first = tc.forward_backward([datum(step)])
        second = tc.forward_backward([datum(step + 50)])
        first.result(), second.result()
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    return tc.save_state("final").result().path, tokens


def fingerprint(storage, path: str) -> dict[str, bytes]:
    return CheckpointStore(storage).fingerprint(parse_path(path))


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    worker = WorkerProcess(tiny_model_dir, root / "storage").start()
    client = trio.ServiceClient(base_url=worker.base_url)
    try:
        path, tokens = training_loop(client)
        return fingerprint(root / "storage", path), tokens
    finally:
        client.close()
        worker.stop()


def run_killed(tiny_model_dir, root, crash_at: str = "", kill_after: float | None = None):
    supervised = Supervised(tiny_model_dir, root / "storage", crash_at=crash_at)
    client = trio.ServiceClient(base_url=supervised.base_url)
    try:
        if kill_after is not None:
            supervised.kill_after(kill_after)
        path, tokens = training_loop(client)
        return fingerprint(root / "storage", path), tokens, supervised.restarts
    finally:
        client.close()
        supervised.stop()


def test_kill_during_forward_backward_loses_nothing(uninterrupted, tiny_model_dir, tmp_path, fast_retries,
                                                    client_cache):
    # the 3rd forward_backward: its gradients accumulated, its result not yet recorded, another one pending before it
    state, tokens, restarts = run_killed(tiny_model_dir, tmp_path, crash_at="forward_backward:3")
    assert restarts == 1
    assert tokens == uninterrupted[1]
    assert state.keys() == uninterrupted[0].keys() and state == uninterrupted[0]


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["forward_backward:1", "forward_backward:4", "optim_step:2", "save_state:1",
                                      "sample:2", "state_write:2"])
def test_kill_at_each_point_loses_nothing(crash_at, uninterrupted, tiny_model_dir, tmp_path, fast_retries,
                                          client_cache):
    state, tokens, restarts = run_killed(tiny_model_dir, tmp_path, crash_at=crash_at)
    assert restarts == 1
    assert tokens == uninterrupted[1]
    assert state == uninterrupted[0]
