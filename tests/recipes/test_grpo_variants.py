"""The GRPO variants of the recipes (recipes/grpo_variants.py): std-normalised advantages, the loss aggregations
as per-token weights, the KL and entropy requests, ppo's bounds, dynamic sampling, Countdown's reward parts.
Numbers against independent numpy computations; the demos run in-process against the fake service."""

import math

import numpy as np
import pytest

from recipes.grpo_lib import (
    DATASET_DEFAULTS,
    LOSS_AGGS,
    aggregation_weights,
    build_arg_parser,
    group_advantages,
    group_advantages_std,
    loss_fn_config,
)

DEMOS = ["01-demo-sync.py", "02-demo-async.py"]


def demo_args(tmp_path, *extra):
    return ["--dataset", "arithmetic", "--steps", "2", "--batch-size", "3", "--group-size", "4",
            "--max-tokens", "32", "--seed", "7", "--eval-every", "0", "--log-dir", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 1.0], [0.1, 1.0, 0.0, 0.0, 0.1], [3.0, 3.0, 3.0], [2.0, 5.0]])
def test_std_advantages_match_numpy(rewards):
    r = np.asarray(rewards)
    std = r.std(ddof=1)
    want = (r - r.mean()) / (std + 1e-6)
    np.testing.assert_allclose(group_advantages_std(rewards), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(group_advantages(rewards), r - r.mean(), rtol=1e-12, atol=1e-12)


def verl_aggregate(matrix: np.ndarray, mask: np.ndarray, mode: str, horizon: int) -> float:
    masked = matrix * mask
    if mode == "token-sum":
        return float(masked.sum())
    if mode == "token-mean":
        return float(masked.sum() / mask.sum())
    if mode == "seq-mean-token-sum":
        return float(masked.sum(-1).mean())
    if mode == "seq-mean-token-mean":
        return float((masked.sum(-1) / mask.sum(-1)).mean())
    return float(masked.sum() / (len(matrix) * horizon))


@pytest.mark.parametrize("mode", LOSS_AGGS)
def test_weights_make_the_summed_loss_each_aggregation(mode):
    """sum_i sum_t w_i * l_it equals verl's aggregation of the padded [B, T] loss matrix."""
    rng = np.random.default_rng(LOSS_AGGS.index(mode))
    lengths = [3, 9, 1, 16, 7]
    matrix = rng.normal(size=(len(lengths), 16))
    mask = np.zeros_like(matrix)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    weights = aggregation_weights(mode, lengths, 16)
    if mode == "token-sum":
        assert weights is None
        weights = [1.0] * len(lengths)
    summed = sum(w * matrix[i, :n].sum() for i, (w, n) in enumerate(zip(weights, lengths)))
    assert summed == pytest.approx(verl_aggregate(matrix, mask, mode, 16), rel=1e-12)


def test_default_request_is_unchanged():
    """No variant flag: no loss_fn_config for importance_sampling / ppo, CISPO's bounds only for cispo."""
    parser = build_arg_parser("t")
    assert loss_fn_config(parser.parse_args([])) is None
    assert loss_fn_config(parser.parse_args(["--loss-fn", "ppo"])) is None
    assert loss_fn_config(parser.parse_args(["--loss-fn", "cispo"])) == {"clip_low_threshold": 0.0,
                                                                         "clip_high_threshold": 4.0}
    args = parser.parse_args(["--loss-fn", "ppo", "--clip-high", "1.28", "--kl-coef", "0", "--kl-estimator", "k2",
                              "--log-entropy"])
    assert loss_fn_config(args) == {"clip_high_threshold": 1.28, "kl_coef": 0.0, "kl_estimator": "k2",
                                    "return_entropy": True}


@pytest.mark.parametrize("argv", [
    ["--clip-high", "1.28"],  # importance_sampling has no clip
    ["--loss-fn", "cispo", "--clip-low", "0.5"],
    ["--loss-fn", "cispo", "--custom-cispo", "--kl-coef", "0.1"],
    ["--loss-fn", "cispo", "--custom-cispo", "--loss-agg", "token-mean"],
    ["--kl-coef", "-0.01"],
    ["--kl-estimator", "k4"],
    ["--loss-agg", "mean"],
    ["--advantage", "rank"],
    ["--max-sampling-rounds", "21"],
    ["--max-sampling-rounds", "-1"],
])
def test_bad_variant_options_are_refused(argv):
    with pytest.raises(SystemExit):
        build_arg_parser("t").parse_args(argv)


def test_sampling_rounds_bound_is_inclusive():
    assert build_arg_parser("t").parse_args(["--max-sampling-rounds", "20"]).max_sampling_rounds == 20
    assert build_arg_parser("t").parse_args(["--max-sampling-rounds", "0"]).max_sampling_rounds == 0


@pytest.mark.parametrize("script", DEMOS)
def test_variant_flags_reach_the_datums_and_the_request(script, tmp_path, fake_service, load_demo):
    summary = load_demo(script).main(demo_args(
        tmp_path, "--loss-fn", "ppo", "--clip-high", "1.28", "--advantage", "std", "--loss-agg", "token-mean",
        "--kl-coef", "0.05", "--log-entropy"))
    assert fake_service.loss_fn_configs
    assert all(c == {"clip_high_threshold": 1.28, "kl_coef": 0.05, "kl_estimator": "k3", "return_entropy": True}
               for c in fake_service.loss_fn_configs)
    datums = fake_service.fb_datums[0]
    completion = [int(np.sum(np.asarray(d.loss_fn_inputs["weights"].data) != 0)) for d in datums]
    total = sum(completion)
    for d, n in zip(datums, completion):
        w = np.asarray(d.loss_fn_inputs["weights"].data)
        a = np.asarray(d.loss_fn_inputs["advantages"].data)
        pad = len(w) - n
        assert np.all(w[:pad] == 0) and np.allclose(w[pad:], 1.0 / total)
        assert np.all(a[:pad] == 0) and len(set(a[pad:].tolist())) == 1
    # std advantages: within each group of 4 the advantages have sample std 1 (up to the 1e-6) and mean 0
    per_datum = [float(d.loss_fn_inputs["advantages"].data[-1]) for d in datums]
    for start in range(0, len(per_datum), 4):
        group = per_datum[start:start + 4]
        if len(group) == 4 and any(group):
            assert statistics_ok(group)
    for row in summary["history"]:
        if row["datums"] > 0:
            assert row["kl"] == 0.02 and row["entropy"] == 0.7 and row["kl/sum"] == 0.12
            assert 0.0 <= row["clip_frac"] <= 1.0


def statistics_ok(group) -> bool:
    g = np.asarray(group)
    return abs(g.mean()) < 1e-6 and abs(g.std(ddof=1) - 1.0) < 1e-5  # float32 on the wire


@pytest.mark.parametrize("script", DEMOS)
def test_with_kl_equal_reward_groups_still_train(script, tmp_path, fake_service, load_demo):
    fake_service.p_right, fake_service.p_truncate = 1.0, 0.0  # every group: all rewards 1
    summary = load_demo(script).main(demo_args(tmp_path, "--kl-coef", "0.05"))
    assert all(row["frac_reward_zero_std"] == 1.0 and row["datums"] == 12 for row in summary["history"])
    for datum in fake_service.fb_datums[0]:
        assert not any(datum.loss_fn_inputs["advantages"].data)  # the KL term alone trains them
        assert any(datum.loss_fn_inputs["weights"].data)


@pytest.mark.parametrize("script", DEMOS)
@pytest.mark.parametrize("rounds", [0, 2])
def test_dynamic_sampling_rounds_are_bounded_and_logged(script, rounds, tmp_path, fake_service, load_demo):
    """Every group degenerate: each step takes exactly --max-sampling-rounds extra rounds, each asking for the
    3 missing prompts again, and trains nothing."""
    fake_service.p_right, fake_service.p_truncate = 1.0, 0.0
    summary = load_demo(script).main(demo_args(tmp_path, "--dynamic-sampling", "--max-sampling-rounds",
                                               str(rounds)))
    assert len([c for c in fake_service.sample_calls if c["params"].temperature > 0]) == 2 * 3 * (1 + rounds)
    for row in summary["history"]:
        assert row["dynamic/extra_rounds"] == rounds and row["dynamic/groups_sampled"] == 3 * (1 + rounds)
        assert row["dynamic/informative_groups"] == 0 and row["datums"] == 0


@pytest.mark.parametrize("script", DEMOS)
def test_dynamic_sampling_fills_the_batch_with_informative_groups(script, tmp_path, fake_service, load_demo):
    fake_service.p_right = 0.8  # many groups all right
    summary = load_demo(script).main(demo_args(tmp_path, "--dynamic-sampling", "--max-sampling-rounds", "6",
                                               "--steps", "3"))
    for row, datums in zip([r for r in summary["history"] if r["datums"] > 0], fake_service.fb_datums):
        groups = [datums[i:i + 4] for i in range(0, len(datums), 4)]
        assert row["dynamic/informative_groups"] == 3 == len(groups) or row["dynamic/extra_rounds"] == 6
        for group in groups:  # only groups whose rewards differ: advantages not all zero
            assert any(d.loss_fn_inputs["advantages"].data[-1] != 0 for d in group)
    assert any(row["dynamic/extra_rounds"] > 0 for row in summary["history"])


def test_sync_and_async_agree_with_variants(tmp_path, fake_service, load_demo):
    flags = ("--advantage", "std", "--loss-agg", "seq-mean-token-mean", "--kl-coef", "0", "--dynamic-sampling")
    fake_service.p_right = 0.8
    sync = load_demo("01-demo-sync.py").main(demo_args(tmp_path / "sync", *flags))
    fake_service.sample_calls.clear()
    async_ = load_demo("02-demo-async.py").main(demo_args(tmp_path / "async", *flags))
    assert [d.model_dump() for d in sync["first_step_datums"]] == [d.model_dump() for d in async_["first_step_datums"]]
    for a, b in zip(sync["history"], async_["history"]):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")}


@pytest.mark.parametrize("script", DEMOS)
def test_countdown_logs_format_and_correctness_apart(script, tmp_path, fake_service, load_demo):
    """The fake answers every question with a boxed number ("0 + 0 = 0. \\boxed{0}"): well-formed unless cut
    short, never a solution; so reward/format = 1 - frac_truncated, reward/correct = 0, reward = 0.1 * format."""
    args = demo_args(tmp_path, "--dataset", "countdown")
    summary = load_demo(script).main(args)
    for row in summary["history"]:
        assert row["reward/format"] == pytest.approx(1.0 - row["rollout/frac_truncated"])
        assert row["reward/correct"] == 0.0
        assert row["reward"] == pytest.approx(0.1 * row["reward/format"])
        assert math.isfinite(row["reward/std"]) and row["rollout/max_gen_len"] >= row["rollout/avg_gen_len"]
    assert DATASET_DEFAULTS["countdown"]["max_tokens"] == 96


def test_variants_train_against_the_worker(demo_on_worker):
    """The async demo with every variant flag against a real worker on the tiny model (the demo's reward
    replaced by one alternating 1, 0 within each group, so every group trains)."""
    summary, _ = demo_on_worker(
        "02-demo-async.py", "--dataset", "arithmetic", "--steps", "2", "--learning-rate", "1e-2", "--eval-every", "0",
        "--loss-fn", "ppo", "--clip-high", "1.28", "--advantage", "std", "--loss-agg", "seq-mean-token-mean",
        "--kl-coef", "0.05", "--kl-estimator", "k3", "--log-entropy", "--dynamic-sampling")
    first, second = summary["history"]
    assert first["kl"] == 0.0  # a fresh adapter is the base model exactly (LoRA B = 0)
    assert second["kl"] > 0.0 and math.isfinite(second["kl"])
    assert first["entropy"] > 0 and second["entropy"] > 0
    for row in summary["history"]:
        assert row["datums"] == 8 and row["dynamic/extra_rounds"] == 0 and 0.0 <= row["clip_frac"] <= 1.0
        assert math.isfinite(row["loss_mean"]) and abs(row["kl_sample_train"]) < 1e-3


_ANSWER = "(25 + 8) * 2 - 3 = 63\n#### 63"


def _completion_texts():
    from hypothesis import strategies as st

    pieces = st.sampled_from(["25", "8", "2", "3", "+", "-", "*", "/", "(", ")", " ", "**", "x", "\\times", "9"])
    return st.lists(pieces, max_size=20).map(lambda p: "so \\boxed{" + "".join(p) + "}")


def test_countdown_parts_add_up_to_the_reward():
    from hypothesis import given, settings

    from recipes.countdown import countdown_parts, countdown_reward

    @settings(max_examples=300, deadline=None)
    @given(_completion_texts())
    def check(text):
        parts = countdown_parts(text, _ANSWER)
        assert parts.reward() == countdown_reward(text, _ANSWER)
        assert parts.format_ok or not parts.correct  # a solution is always well-formed

    check()
    assert countdown_parts("\\boxed{(25 + 8) * 2 - 3}", _ANSWER).correct
    assert not countdown_parts("\\boxed{25 ** 2}", _ANSWER).format_ok
