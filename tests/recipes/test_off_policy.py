"""`--max-steps-off-policy` of the async demo, against the fake service (conftest.FakeService): which sampler
each step's samples come from, when they are started, and what is logged."""

from pathlib import Path

import pytest

from recipes.grpo_lib import sample_seed

STEPS, BATCH = 4, 3


def demo_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--dataset", "arithmetic", "--steps", str(STEPS), "--batch-size", str(BATCH), "--group-size", "4",
            "--max-tokens", "32", "--seed", "7", "--eval-every", "0", "--log-dir", str(tmp_path / "run"), *extra]


def calls_by_step(fake_service) -> dict[int, list[dict]]:
    """The sample calls of each step, told apart by their seeds."""
    step_of = {sample_seed(7, step, i): step for step in range(STEPS) for i in range(BATCH)}
    out: dict[int, list[dict]] = {}
    for call in fake_service.sample_calls:
        out.setdefault(step_of[call["params"].seed], []).append(call)
    return out


@pytest.mark.parametrize("off_policy", [0, 1])
def test_each_step_samples_from_weights_at_most_the_bound_old(off_policy, tmp_path, fake_service, load_demo):
    fake_service.p_truncate = 0.0
    summary = load_demo("02-demo-async.py").main(demo_args(tmp_path, "--max-steps-off-policy", str(off_policy)))
    by_step = calls_by_step(fake_service)
    assert sorted(by_step) == list(range(STEPS)) and all(len(c) == BATCH for c in by_step.values())
    history = summary["history"]
    for step in range(STEPS):
        versions = {c["version"] for c in by_step[step]}  # updates in the sampler's weights
        expected = step if off_policy == 0 or step == 0 else step - 1
        assert versions == {expected}, step
        assert min(versions) >= step - off_policy  # never older than the bound
        assert history[step]["sampler/staleness"] == step - expected
    if off_policy == 0:
        # on-policy: a step's samples are drawn only after the previous step's update has come back
        assert all(c["updates_done"] == step for step in range(STEPS) for c in by_step[step])
    else:
        # one step ahead: step k+1's samples are drawn while step k's update is still awaited
        assert all(c["updates_done"] == step - 1 for step in range(1, STEPS) for c in by_step[step])
    assert fake_service.snapshots == STEPS  # a sampler of the current weights every step, as on-policy
    assert fake_service.optim_steps == sum(1 for row in history if row["datums"] > 0)


def test_off_policy_samples_are_trained_with_their_sampler_logprobs(tmp_path, fake_service, load_demo):
    """The datums carry the logprobs of the sampler that drew them (the losses' importance ratio is
    against those), the same datums as on-policy for the first step."""
    on = load_demo("02-demo-async.py").main(demo_args(tmp_path / "on"))
    fake_service.sample_calls.clear()
    fake_service.fb_datums.clear()
    off = load_demo("02-demo-async.py").main(demo_args(tmp_path / "off", "--max-steps-off-policy", "1"))
    assert [d.model_dump() for d in on["first_step_datums"]] == [d.model_dump() for d in off["first_step_datums"]]
    # the fake sampler's answers depend only on the seed: the same samples, so the same datums every step
    assert [{k: v for k, v in a.items() if not k.startswith(("time/", "sampler/"))} for a in on["history"]] == [
        {k: v for k, v in b.items() if not k.startswith(("time/", "sampler/"))} for b in off["history"]]
    assert [row["sampler/staleness"] for row in off["history"]] == [0.0] + [1.0] * (STEPS - 1)
    assert [row["sampler/staleness"] for row in on["history"]] == [0.0] * STEPS


@pytest.mark.parametrize("value", ["-1", "2"])
def test_off_policy_bound_refused_past_it(value, tmp_path, fake_service, load_demo, capsys):
    with pytest.raises(SystemExit):
        load_demo("02-demo-async.py").main(demo_args(tmp_path, "--max-steps-off-policy", value))
    assert "--max-steps-off-policy must be 0 or 1" in capsys.readouterr().err
    assert fake_service.sample_calls == [] and fake_service.snapshots == 0


def test_sync_demo_refuses_off_policy(tmp_path, fake_service, load_demo, capsys):
    with pytest.raises(SystemExit):
        load_demo("01-demo-sync.py").main(demo_args(tmp_path, "--max-steps-off-policy", "1"))
    assert "--max-steps-off-policy is for 02-demo-async.py" in capsys.readouterr().err
    assert fake_service.training_kwargs is None


def test_one_step_off_policy_trains_against_the_worker(demo_on_worker):
    """The async demo one step off-policy against a real worker on the tiny model (its reward alternating 1, 0 so
    every group trains): step 0 is on-policy (sampler and learner agree), later steps train on samples of the
    weights before the last update, so the learner's logprobs have moved away from the sampler's."""
    import math

    summary, calls = demo_on_worker("02-demo-async.py", "--dataset", "arithmetic", "--steps", "3",
                                    "--learning-rate", "1e-2", "--eval-every", "0", "--max-steps-off-policy", "1")
    history = summary["history"]
    assert len(calls) == 3 * 2 * 4
    assert [row["sampler/staleness"] for row in history] == [0.0, 1.0, 1.0]
    assert abs(history[0]["kl_sample_train"]) < 1e-3
    assert all(abs(row["kl_sample_train"]) > 1e-4 for row in history[1:])  # samples of the weights before
    for row in history:
        assert row["datums"] == 8 and math.isfinite(row["loss_mean"])
