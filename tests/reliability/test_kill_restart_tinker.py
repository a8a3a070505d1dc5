"""kill -9 at chosen moments of a training loop driven by the official, unmodified ``tinker`` SDK: the worker
restarts on the same storage, the SDK's pending futures resolve (it retries the connection meanwhile), later ops
continue in seq_id order, and the loop ends with the weights and Adam state of a loop that was never interrupted,
bit for bit, its seeded samples the same tokens."""

from __future__ import annotations

import warnings

import pytest
import tinker
from support import WorkerProcess
from tinker import types

from server_mock.api.tinker.paths import to_trio_path
from server_mock.storage.checkpoints import CheckpointStore, parse_path

from .kill_helpers import Supervised

WORKER_KEY = "secret-key"
CLIENT_KEY = "tml-" + WORKER_KEY
STEPS = 3


def datum(offset: int) -> types.Datum:
    tokens = [(offset * 7 + i * 3) % 50 + 2 for i in range(12)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})


def tinker_loop(base_url: str) -> tuple[str, list[list[int]], list[float]]:
    """A GRPO-shaped loop through the SDK: weights for a sampler -> seeded samples -> forward_backward and
    optim_step sent together (the SDK's recommended pattern), then save_state. The sampled tokens, the losses, and
    the final checkpoint's path."""
    warnings.simplefilter("ignore", FutureWarning)
    client = tinker.ServiceClient(base_url=base_url, api_key=CLIENT_KEY)
    try:
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5)
        tokens, losses = [], []
        for step in range(STEPS):
            sampler = tc.save_weights_and_get_sampling_client()
            result = sampler.sample(types.ModelInput.from_ints([3, 4, 5 + step]), num_samples=2,
                                    sampling_params=types.SamplingParams(max_tokens=4, seed=11 + step)).result()
            tokens += [list(s.tokens) for s in result.sequences]
            fwd = tc.forward_backward([datum(step), datum(step + 50)], "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
            losses.append(fwd.result().metrics["loss:sum"])
            opt.result()
        path = tc.save_state("final").result().path
    finally:
        client.close("success").result(timeout=30)
    return path, tokens, losses


def fingerprint(storage, path: str) -> dict[str, bytes]:
    return CheckpointStore(storage).fingerprint(parse_path(to_trio_path(path)))


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-uninterrupted")
    worker = WorkerProcess(tiny_model_dir, root / "storage", api_keys=[WORKER_KEY]).start()
    try:
        path, tokens, losses = tinker_loop(worker.base_url)
        return fingerprint(root / "storage", path), tokens, losses
    finally:
        worker.stop()


def run_killed(tiny_model_dir, root, crash_at: str):
    supervised = Supervised(tiny_model_dir, root / "storage", crash_at=crash_at, api_keys=[WORKER_KEY])
    try:
        path, tokens, losses = tinker_loop(supervised.base_url)
        return fingerprint(root / "storage", path), tokens, losses, supervised.restarts
    finally:
        supervised.stop()


@pytest.mark.timeout(180)
def test_kill_between_forward_backward_and_optim_step(uninterrupted, tiny_model_dir, tmp_path):
    # the 2nd optim_step as it starts: its forward_backward answered (its gradients pending, never written), the
    # step accepted; both futures are polled across the restart
    state, tokens, losses, restarts = run_killed(tiny_model_dir, tmp_path, "optim_step:2")
    assert restarts == 1
    assert tokens == uninterrupted[1] and losses == uninterrupted[2]
    assert state.keys() == uninterrupted[0].keys() and state == uninterrupted[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("crash_at", ["forward_backward:1", "forward_backward:2", "forward_backward:3",
                                      "optim_step:1", "optim_step:3", "save_state:1", "sample:2",
                                      "state_write:2"])
def test_kill_at_each_point_with_the_tinker_sdk(crash_at, uninterrupted, tiny_model_dir, tmp_path):
    state, tokens, losses, restarts = run_killed(tiny_model_dir, tmp_path, crash_at)
    assert restarts == 1
    assert tokens == uninterrupted[1] and losses == uninterrupted[2]
    assert state == uninterrupted[0]
