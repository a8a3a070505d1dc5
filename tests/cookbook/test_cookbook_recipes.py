"""tinker-cookbook 0.6.1's recipes, unmodified, on tiny random models and local data, each in its own process
against one real worker (conftest.py): the minimal SL and RL loops, math_rl synchronous and asynchronous with
its default loss (stable_reinforce), the SL trainer with a resume, DPO and on-policy distillation.

What each asserts is read from the recipe's own logs (metrics.jsonl, checkpoints.jsonl) and the worker's REST
API: the steps ran, the numbers are finite and where a resume must reproduce a step, it does exactly.
Each recipe starts its own Python process (imports alone take seconds) and together they take minutes on two
CPU cores: they are ``slow`` tests (``-m slow``).
"""

from __future__ import annotations

import math

import pytest
import tinker


def trained(rows: list[dict]) -> list[dict]:
    """The rows of training steps (the trainers also log a closing row without optimizer metrics)."""
    return [r for r in rows if "step:max" in r]


def finite(rows: list[dict], key: str) -> list[float]:
    values = [r[key] for r in rows if key in r]
    assert values and all(math.isfinite(v) for v in values), (key, rows)
    return values


@pytest.mark.slow
def test_sl_loop_and_its_exact_resume(cookbook):
    """sl_loop (default model, under its hub id): 3 steps saving at step 2, then a resume from that checkpoint
    reproduces step 2 exactly (its loop is not pipelined)."""
    args = ("batch_size=4", "max_steps=3", "save_every=2", "max_length=128", "lora_rank=8", "ttl_seconds=None")
    cookbook.run("tinker_cookbook.recipes.sl_loop", *args, f"log_path={cookbook.runs / 'sl'}")
    first = cookbook.metrics("sl")
    assert [r["step"] for r in first] == [0, 1, 2]
    finite(first, "train_mean_nll")
    saved = cookbook.checkpoints("sl")
    assert [c["name"] for c in saved] == ["000002", "final"]
    # resume from the step-2 state: drop the final record (its loop_state says "done")
    (cookbook.runs / "sl" / "checkpoints.jsonl").write_text(
        (cookbook.runs / "sl" / "checkpoints.jsonl").read_text().splitlines()[0] + "\n")
    cookbook.run("tinker_cookbook.recipes.sl_loop", *args[:1], "max_steps=4", *args[2:],
                 f"log_path={cookbook.runs / 'sl'}")
    resumed = cookbook.metrics("sl")[3:]
    assert [r["step"] for r in resumed] == [2, 3]
    assert resumed[0]["grad_norm:mean"] == first[2]["grad_norm:mean"]  # bit-identical: the same float
    assert resumed[0]["train_mean_nll"] == first[2]["train_mean_nll"]
    assert resumed[0]["step:max"] == first[2]["step:max"]  # Adam's step count came back with the state
    run = rest_client(cookbook).get_training_run_by_tinker_path(saved[0]["state_path"]).result(30)
    assert run.base_model == cookbook.hub_id and run.last_checkpoint is not None


def rest_client(cookbook) -> tinker.RestClient:
    return tinker.RestClient(base_url=cookbook.worker.base_url, api_key=cookbook.key)


RL_LOOP = """
import tinker_cookbook.recipes.rl_loop as m
m.get_reward = lambda response, answer: float(len(response))  # a random model never writes \\boxed{{}}
m.main(m.Config(batch_size=2, group_size=4, max_tokens=12, lora_rank=8, save_every=0, max_steps=2,
                ttl_seconds=None, log_path={log!r}{loss}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("loss", [None, "gspo"])
def test_rl_loop_with_its_default_loss(cookbook, loss):
    """rl_loop with stable_reinforce (its default: sampling with record_stability_info, datums with provenance)
    and with gspo (its sequence_ratio_mask); the reward is the response length, so every group varies."""
    name = f"rl-{loss or 'default'}"
    extra = f", loss_fn={loss!r}" if loss else ""
    cookbook.run(RL_LOOP.format(log=str(cookbook.runs / name), loss=extra), code=True)
    rows = cookbook.metrics(name)
    steps = [r for r in rows if "grad_norm:mean" in r]
    assert [r["step"] for r in steps] == [0, 1]  # both steps trained (no all-zero-advantage skip)
    assert all(r["grad_norm:mean"] > 0 for r in steps)
    finite(rows, "reward/total")


MATH_RL = ("env=arithmetic", "renderer_name=role_colon", "group_size=4", "groups_per_batch=2", "max_tokens=5",
           "lora_rank=8", "eval_every=0")


@pytest.mark.slow
def test_math_rl_sync_with_stable_reinforce_and_a_resume(cookbook):
    """math_rl (rl.train, synchronous) with its default loss, saving at step 2; the resume continues at step 3
    and reads the run's renderer name from the worker (GET /training_runs/{id}: no fallback warning)."""
    log = f"log_path={cookbook.runs / 'math'}"
    out = cookbook.run("tinker_cookbook.recipes.math_rl.train", f"model_name={cookbook.tiny}", *MATH_RL,
                       "max_steps=3", "save_every=2", log, "behavior_if_log_dir_exists=delete")
    assert "unknown loss" not in out
    first = trained(cookbook.metrics("math"))
    assert [r["step"] for r in first] == [0, 1, 2] and [r["step:max"] for r in first] == [1, 2, 3]
    assert all(abs(v) < 1e-4 for v in finite(first, "optim/kl_sample_train_v1"))  # sampler == trainer (float32)
    out = cookbook.run("tinker_cookbook.recipes.math_rl.train", f"model_name={cookbook.tiny}", *MATH_RL,
                       "max_steps=5", "save_every=2", log, "behavior_if_log_dir_exists=resume")
    assert "Could not fetch renderer metadata" not in out
    resumed = trained(cookbook.metrics("math"))[3:]
    # the step-2 save holds the weights and Adam state after 3 optimizer steps: the resumed steps are Adam's 4, 5
    assert [r["step"] for r in resumed] == [3, 4] and [r["step:max"] for r in resumed] == [4, 5]


@pytest.mark.slow
def test_math_rl_async_off_policy_with_stable_reinforce(cookbook):
    """math_rl with max_steps_off_policy=1: rl.train's asynchronous loop, whose default loss is stable_reinforce
    (the cookbook's recommendation for off-policy data)."""
    log = f"log_path={cookbook.runs / 'math-async'}"
    out = cookbook.run("tinker_cookbook.recipes.math_rl.train", f"model_name={cookbook.tiny}", *MATH_RL,
                       "max_steps=3", "save_every=0", "max_steps_off_policy=1", log,
                       "behavior_if_log_dir_exists=delete")
    assert "unknown loss" not in out
    rows = trained(cookbook.metrics("math-async"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]  # trained on data one step old
    assert all(abs(v) < 1e-3 for v in finite(rows, "optim/kl_sample_train_v1"))


@pytest.mark.slow
def test_sl_trainer_with_rolling_checkpoints_and_a_resume(cookbook):
    """chat_sl (supervised.train) on the cookbook's example conversations: rolling checkpoints are deleted as
    it goes (DELETE /training_runs/.../checkpoints/...), and a resume from the step-2 save continues. The trainer
    pipelines one batch ahead of its saves, so the resumed step 2 repeats a batch (the cookbook's design)."""
    import tinker_cookbook

    data = f"{tinker_cookbook.__path__[0]}/example_data/conversations.jsonl"
    args = (f"model_name={cookbook.tiny}", "renderer_name=role_colon", f"dataset={data}", "batch_size=4",
            "max_length=256", "lora_rank=8", "save_every=2", "eval_every=0", "infrequent_eval_every=0",
            "rolling_save_every=1", f"log_path={cookbook.runs / 'chat-sl'}")
    out = cookbook.run("tinker_cookbook.recipes.chat_sl.train", *args, "max_steps=3",
                       "behavior_if_log_dir_exists=delete")
    assert "Failed to delete rolling checkpoint" not in out
    first = trained(cookbook.metrics("chat-sl"))
    assert [r["step"] for r in first] == [0, 1, 2]
    finite(first, "train_mean_nll")
    saved = cookbook.checkpoints("chat-sl")
    run_id = saved[-1]["state_path"].split("/")[2]
    names = [c.checkpoint_id for c in rest_client(cookbook).list_checkpoints(run_id).result(30).checkpoints]
    assert not [n for n in names if "rolling" in n], names  # every rolling checkpoint was deleted
    (cookbook.runs / "chat-sl" / "checkpoints.jsonl").write_text(
        "".join(line + "\n" for line in (cookbook.runs / "chat-sl" / "checkpoints.jsonl").read_text().splitlines()
                if '"final"' not in line))
    cookbook.run("tinker_cookbook.recipes.chat_sl.train", *args, "max_steps=5", "behavior_if_log_dir_exists=resume")
    rows = trained(cookbook.metrics("chat-sl"))  # the resume rewrites the log from its step on
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # the "batch 2" save was made after batch 2 was trained (Adam step 3): resumed, batch 2 trains again as step 4
    assert [r["step:max"] for r in rows] == [1, 2, 4, 5, 6] and first[2]["step:max"] == 3
    finite(rows, "train_mean_nll")


@pytest.mark.slow
def test_dpo(cookbook):
    """DPO on local HH-style pairs: forward_backward_custom with the reference model's compute_logprobs."""
    cookbook.run("tinker_cookbook.recipes.preference.dpo.train", f"model_name={cookbook.tiny}",
                 "renderer_name=role_colon", "dataset=hhh", "batch_size=4", "max_length=256", "max_steps=2",
                 f"log_path={cookbook.runs / 'dpo'}", "behavior_if_log_dir_exists=delete")
    rows = [r for r in cookbook.metrics("dpo") if "dpo_loss" in r]
    assert [r["step"] for r in rows] == [0, 1]
    losses = finite(rows, "dpo_loss")
    assert abs(losses[0] - math.log(2)) < 1e-3  # policy == reference at step 0: -log sigmoid(0)


@pytest.mark.slow
def test_on_policy_distillation(cookbook):
    """The student (the tiny model) samples; a second served model (other weights) is the teacher."""
    cookbook.run("tinker_cookbook.recipes.distillation.on_policy_distillation", f"model_name={cookbook.tiny}",
                 f"teacher_model={cookbook.teacher}", "renderer_name=role_colon", "dataset=deepmath",
                 "group_size=2", "groups_per_batch=2", "max_tokens=12", "lora_rank=8", "max_steps=2", "eval_every=0",
                 "save_every=0", f"log_path={cookbook.runs / 'distill'}", "behavior_if_log_dir_exists=delete")
    rows = trained(cookbook.metrics("distill"))
    assert [r["step"] for r in rows] == [0, 1]
    kl = [r[k] for r in rows for k in r if "teacher_kl" in k]
    assert kl and all(math.isfinite(v) and v != 0 for v in kl)  # the two models differ (a sampled estimate)

