"""kill -9 under the async GRPO recipe itself: ``recipes/02-demo-async.py``, unmodified, in its own process as a user
runs it (``python recipes/02-demo-async.py --base-url ...``), against a worker that is killed (at a crash point, or
from outside after a seeded random delay) and started again on the same storage. The recipe must exit 0 and end with
the final sampler weights, the run's durable state (weights, AdamW moments and step counts) and the per-step metrics
of a run that was never interrupted, bit for bit.

The recipe is on-policy: each step awaits its ``forward_backward`` and ``optim_step`` before the next step's sampler
snapshot, and its concurrent ``sample_async`` calls carry one seed per prompt, so nothing it sends depends on timing.

On the tiny random model (the default job and most slow cases) no completion is a ``\\boxed{}`` answer, so every
reward is 0, the reward-weighted loss is 0 and the sampler's logprobs enter no gradient; the run trains through the
recipe's KL term instead (``--kl-coef`` with the ``k1`` estimator, whose gradient is not 0 where the policy equals the
base model), so every step changes the weights and the next step samples from them. The SmolLM2-135M cases, which
train on real rewards: test_kill_restart_recipe_smollm2.py.
"""

from __future__ import annotations

import pytest

from .recipe_runs import TINY_ARGS, Setup, assert_same_run, random_kill, run_killed, run_uninterrupted


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Setup:
    return Setup(tiny_model_dir, "tiny", TINY_ARGS)


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    return run_uninterrupted(tiny, tmp_path_factory.mktemp("recipe-uninterrupted"))


def test_uninterrupted_run_trains_every_step(uninterrupted):
    # the comparison means something only if the run trains: every step has datums and a gradient, the weights
    # move (the final adapter is not the initial one: lora_B starts at 0), Adam took one step a step
    metrics = uninterrupted["metrics"]
    assert [row["step"] for row in metrics] == [0, 1, 2, 3, 4]
    assert all(row["datums"] == 12 and row["optim/grad_norm"] > 0 for row in metrics[:4])
    assert uninterrupted["optim_steps"] == 4
    assert any(name.startswith("weights:") and "lora_B" in name and any(uninterrupted["state"][name])
               for name in uninterrupted["state"])


@pytest.mark.timeout(300)
def test_recipe_survives_kill_during_forward_backward(tiny, uninterrupted, tmp_path):
    # the 2nd forward_backward, its gradients accumulated and nothing answered; the recipe sends its optim_step
    # right behind it, so the restarted worker runs both again in seq_id order
    crash_at = "forward_backward:2"
    result, restarts, context = run_killed(tiny, tmp_path, crash_at, crash_at=crash_at)
    assert restarts == 1, context
    assert_same_run(result, uninterrupted, context)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_uninterrupted_runs_are_bit_identical(tiny, uninterrupted, tmp_path):
    # what the kill tests stand on: the recipe with one seed gives the same bits on every run
    assert_same_run(run_uninterrupted(tiny, tmp_path), uninterrupted, "a second uninterrupted run")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash_at", ["forward_backward:1", "forward_backward:4", "optim_step:1", "optim_step:3",
                                      "sample:1", "sample:2", "sample:4", "sample:6", "save_weights:1",
                                      "state_write:2", "state_write:4"])
def test_recipe_survives_kill_at_each_point(crash_at, tiny, uninterrupted, tmp_path):
    # sample:n counts decode batches that finished, not requests: a step's concurrent requests usually share one,
    # so a run has at least 7 (3 evaluations, 4 steps' rollouts) and sample:6 is always reached
    result, restarts, context = run_killed(tiny, tmp_path, crash_at, crash_at=crash_at)
    assert restarts == 1, context
    assert_same_run(result, uninterrupted, context)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(8))
def test_recipe_survives_kill_at_a_random_moment(seed, tiny, uninterrupted, tmp_path):
    # SIGKILL from outside at a seeded random moment while the recipe calls the worker: any op, sample, snapshot or
    # the tokenizer download may be in flight. The restarted worker runs no crash points, so there is exactly one
    # kill; one drawn late lands, at the latest, in the second the recipe spends writing its logs after its save.
    delay, context = random_kill(seed, uninterrupted)
    result, restarts, context = run_killed(tiny, tmp_path, context, kill_after=delay)
    assert restarts == 1, context
    assert_same_run(result, uninterrupted, context)
