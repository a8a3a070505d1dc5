"""kill -9 under ``recipes/02-demo-async.py`` on SmolLM2-135M-Instruct (slow): the recipe trains on real rewards
(mixed groups, non-zero advantages), so the sampler's logprobs enter the importance-sampling loss and the logged
``kl_sample_train``; a killed and restarted run must end with the bits of one never interrupted. The same check on
the tiny model, at every crash point: test_kill_restart_recipe.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from .recipe_runs import SMOL_ARGS, Setup, assert_same_run, random_kill, run_killed, run_uninterrupted


@pytest.fixture(scope="module")
def smol() -> Setup:
    from server_mock.engine.loading import SMOLLM2_ID, resolve_source

    return Setup(Path(resolve_source(SMOLLM2_ID)), "smol", SMOL_ARGS)


@pytest.fixture(scope="module")
def smol_uninterrupted(smol, tmp_path_factory):
    return run_uninterrupted(smol, tmp_path_factory.mktemp("recipe-smol-uninterrupted"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kill", ["forward_backward:2", "sample:2", "random:0", "random:1"])
def test_recipe_on_smollm2_survives_a_kill(kill, smol, smol_uninterrupted, tmp_path):
    # real rewards: both steps train on non-zero advantages, the sampler's logprobs in the loss and in the metrics
    assert all(row["train_tokens"] > 0 and "kl_sample_train" in row for row in smol_uninterrupted["metrics"][:2])
    if kill.startswith("random:"):
        delay, context = random_kill(int(kill.partition(":")[2]), smol_uninterrupted)
        result, restarts, context = run_killed(smol, tmp_path, context, kill_after=delay)
    else:
        result, restarts, context = run_killed(smol, tmp_path, kill, crash_at=kill)
    assert restarts == 1, context
    assert_same_run(result, smol_uninterrupted, context)
