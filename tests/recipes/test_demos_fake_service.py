"""The two demo scripts run in-process against a fake service (see conftest.FakeService).

These check the scripts' own logic: what they send (sampling params, seeds, datums, loss), in what order,
and what they log. Runs against a real worker are separate (end-to-end tests)."""

import json
from pathlib import Path

import pytest

from recipes.grpo_lib import (
    DATASET_DEFAULTS,
    FEWSHOT,
    build_datum,
    grade,
    group_advantages,
    is_degenerate,
    load_rows,
    render_prompt,
    sample_seed,
    shuffle_rows,
)

STEP_KEYS = {
    "reward", "frac_degenerate", "rollout/avg_gen_len", "rollout/frac_truncated", "datums", "train_tokens",
    "time/sample", "time/train", "time/sync", "time/step",
}
DEMOS = ["01-demo-sync.py", "02-demo-async.py"]


def demo_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--dataset", "arithmetic", "--steps", "2", "--batch-size", "3", "--group-size", "4",
            "--max-tokens", "32", "--seed", "7", "--eval-every", "0", "--log-dir", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("script", DEMOS)
def test_demo_step_logic(script, tmp_path, fake_service, load_demo, recipe_tokenizer):
    summary = load_demo(script).main(demo_args(tmp_path, "--temperature", "0.9", "--top-p", "0.95"))

    assert fake_service.configure_kwargs == {"actor_event_wait_timeout": 600, "actor_event_request_timeout": 600,
                                             "timeout": 600, "sampling_request_max_in_flight": 256,
                                             "embedded_worker_args": ("--autocast", "bf16")}
    assert fake_service.service_kwargs == {}  # no --api-key / --base-url: the SDK's own defaults
    defaults = DATASET_DEFAULTS["arithmetic"]  # options not given come from the dataset's defaults
    assert fake_service.training_kwargs == {"base_model": defaults["base_model"], "rank": defaults["lora_rank"],
                                            "seed": 7, "train_unembed": defaults["train_unembed"]}

    # Sampling: one request per prompt, group_size samples, the step's prompts in shuffled-data order.
    train_rows = shuffle_rows(load_rows("arithmetic", "train", seed=7), 7)
    assert len(fake_service.sample_calls) == 2 * 3
    for k, call in enumerate(fake_service.sample_calls):
        step, i = divmod(k, 3)
        params = call["params"]
        assert call["num_samples"] == 4
        question = train_rows[step * 3 + i]["question"]
        assert call["prompt"] == render_prompt(recipe_tokenizer, question, FEWSHOT["arithmetic"])
        assert (params.max_tokens, params.temperature, params.top_p) == (32, 0.9, 0.95)
        assert params.stop == ["<|im_end|>"]
        assert params.seed == sample_seed(7, step, i)
    assert fake_service.snapshots == 2  # a fresh sampler every step

    # Training: forward_backward then optim_step each step (when there were datums), then the final save.
    trained_steps = [row for row in summary["history"] if row["datums"] > 0]
    expected_calls = []
    for row in summary["history"]:
        if row["datums"] > 0:
            expected_calls += [("forward_backward", "importance_sampling", int(row["datums"])),
                               ("optim_step", defaults["learning_rate"], None)]
    assert fake_service.calls == expected_calls + [("save_weights_for_sampler", "final", None)]
    assert trained_steps, "the fake's seeded coin flips should give at least one mixed group"
    assert summary["final_path"] == "trio://fake/final"

    # Logged metrics
    history = summary["history"]
    assert [row["step"] for row in history] == [0, 1]
    for row in history:
        assert STEP_KEYS <= set(row)
        if row["datums"] > 0:
            assert row["loss_mean"] == -0.25
            assert row["kl_sample_train"] == pytest.approx(0.01, abs=1e-5)  # the fake learner is 0.01 lower
            assert row["optim/grad_norm"] == 0.5
    run = Path(summary["log_dir"])
    assert [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == history
    assert json.loads((run / "config.json").read_text())["seed"] == 7
    assert (run / "curves.png").exists()


@pytest.mark.parametrize("script", DEMOS)
def test_first_step_datums_rebuilt_independently(script, tmp_path, fake_service, load_demo, recipe_tokenizer):
    summary = load_demo(script).main(demo_args(tmp_path))
    # Re-sample step 0 through the fake sampler and build the datums by hand from the library pieces.
    from recipe_fakes import FakeSampler

    import pytrio_compat as trio

    sampler = FakeSampler(fake_service)
    rows = shuffle_rows(load_rows("arithmetic", "train", seed=7), 7)[:3]
    expected, rewards_all = [], []
    for i, row in enumerate(rows):
        prompt = render_prompt(recipe_tokenizer, row["question"], FEWSHOT["arithmetic"])
        params = trio.SamplingParams(max_tokens=32, temperature=1.0, top_p=1.0, stop=["<|im_end|>"],
                                     seed=sample_seed(7, 0, i))
        result = sampler.sample(trio.ModelInput.from_ints(prompt), 4, params).result()
        rewards = [grade(s.text, row["answer"]) for s in result.sequences]
        rewards_all += rewards
        if is_degenerate(rewards):
            continue
        for s, adv in zip(result.sequences, group_advantages(rewards)):
            expected.append(build_datum(prompt, s.tokens, s.logprobs, adv))
    assert [d.model_dump() for d in summary["first_step_datums"]] == [d.model_dump() for d in expected]
    assert summary["history"][0]["reward"] == pytest.approx(sum(rewards_all) / len(rewards_all))


def test_sync_and_async_build_identical_first_step(tmp_path, fake_service, load_demo):
    sync = load_demo("01-demo-sync.py").main(demo_args(tmp_path / "sync"))
    sync_samples = list(fake_service.sample_calls)
    fake_service.sample_calls.clear()
    async_ = load_demo("02-demo-async.py").main(demo_args(tmp_path / "async"))
    assert [d.model_dump() for d in sync["first_step_datums"]] == [d.model_dump() for d in async_["first_step_datums"]]
    assert sync["first_step_datums"]
    assert [c["params"].seed for c in sync_samples] == [c["params"].seed for c in fake_service.sample_calls]
    for a, b in zip(sync["history"], async_["history"]):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")}


@pytest.mark.parametrize("script", DEMOS)
def test_all_degenerate_groups_skip_the_update(script, tmp_path, fake_service, load_demo, capsys):
    fake_service.p_right, fake_service.p_truncate = 1.0, 0.0  # every completion right: nothing to learn
    summary = load_demo(script).main(demo_args(tmp_path))
    assert "no datums: skipping update" in capsys.readouterr().out
    assert fake_service.calls == [("save_weights_for_sampler", "final", None)]
    for row in summary["history"]:
        assert row["datums"] == 0 and row["frac_degenerate"] == 1.0 and row["reward"] == 1.0
        assert "loss_mean" not in row
    assert summary["first_step_datums"] == []


@pytest.mark.parametrize("script", DEMOS)
def test_cispo_uses_the_workers_builtin_loss(script, tmp_path, fake_service, load_demo):
    load_demo(script).main(demo_args(tmp_path, "--loss-fn", "cispo", "--cispo-clip-high", "3"))
    kinds = [c[0] for c in fake_service.calls]
    assert "forward_backward_custom" not in kinds
    assert {c[1] for c in fake_service.calls if c[0] == "forward_backward"} == {"cispo"}
    assert fake_service.loss_fn_configs
    assert all(c == {"clip_low_threshold": 0.0, "clip_high_threshold": 3.0} for c in fake_service.loss_fn_configs)


@pytest.mark.parametrize("script", DEMOS)
def test_custom_cispo_goes_through_forward_backward_custom(script, tmp_path, fake_service, load_demo):
    summary = load_demo(script).main(demo_args(tmp_path, "--loss-fn", "cispo", "--custom-cispo"))
    kinds = [c[0] for c in fake_service.calls]
    assert "forward_backward" not in kinds and "forward_backward_custom" in kinds
    trained = [row for row in summary["history"] if row["datums"] > 0]
    assert trained
    for row in trained:
        assert row["cispo/clip_fraction"] == 0.0  # fake learner ratio exp(0) = 1: never clipped
        assert row["loss_mean"] != -0.25  # the custom loss's own loss_mean replaces the backend one


@pytest.mark.parametrize("script", DEMOS)
def test_evaluation_every_step_and_at_the_end(script, tmp_path, fake_service, load_demo):
    summary = load_demo(script).main(demo_args(tmp_path, "--eval-every", "1", "--eval-size", "9"))
    eval_rows = load_rows("arithmetic", "test", n=9)
    # the fake's greedy answer is right exactly when the sum is even
    expected = sum(1 for r in eval_rows if int(r["answer"].rsplit("#### ", 1)[1]) % 2 == 0) / 9
    history = summary["history"]
    assert [row["step"] for row in history] == [0, 1, 2]
    assert [row["eval/accuracy"] for row in history] == pytest.approx([expected] * 3)
    assert summary["final_eval_accuracy"] == pytest.approx(expected)
    greedy = [c for c in fake_service.sample_calls if c["params"].temperature == 0]
    assert len(greedy) == 3 * 9 and all(c["num_samples"] == 1 for c in greedy)
    assert fake_service.snapshots == 3  # two steps + one for the final evaluation


def test_evaluate_sync_and_async_agree(fake_service, recipe_tokenizer):
    import asyncio

    from recipe_fakes import FakeSampler

    from recipes.grpo_lib import evaluate, evaluate_async

    rows = load_rows("arithmetic", "test", n=10)
    expected = sum(1 for r in rows if int(r["answer"].rsplit("#### ", 1)[1]) % 2 == 0) / 10
    assert 0 < expected < 1
    sampler = FakeSampler(fake_service)
    assert evaluate(sampler, recipe_tokenizer, rows, 16, FEWSHOT["arithmetic"]) == pytest.approx(expected)
    coro = evaluate_async(sampler, recipe_tokenizer, rows, 16, FEWSHOT["arithmetic"])
    assert asyncio.run(coro) == pytest.approx(expected)
    assert len(fake_service.sample_calls) == 20
    for call in fake_service.sample_calls:
        assert call["num_samples"] == 1
        assert (call["params"].temperature, call["params"].max_tokens, call["params"].stop) == (0.0, 16, ["<|im_end|>"])
    with pytest.raises(ValueError):
        evaluate(sampler, recipe_tokenizer, [], 16)
