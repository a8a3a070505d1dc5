"""Group advantages, the right-shifted policy datum, train-token counting, kl_sample_train, CISPO, step metrics,
and the step bookkeeping (seeds, batches) the two demos share."""

from types import SimpleNamespace

import pytest
import torch

from pytrio_compat.types import TensorData
from recipes.grpo_lib import (
    StepStats,
    batch_rows,
    build_datum,
    count_train_tokens,
    group_advantages,
    is_degenerate,
    kl_sample_train,
    make_custom_cispo_loss,
    num_steps,
    sample_seed,
    shuffle_rows,
)

# ---- advantages -------------------------------------------------------------------------------------------


def test_group_advantages_worked_example():
    rewards = [1, 0, 0, -0.1, 1, 0, 0, -0.1]  # mean 0.225
    adv = group_advantages(rewards)
    assert adv == pytest.approx([0.775, -0.225, -0.225, -0.325, 0.775, -0.225, -0.225, -0.325])
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)


def test_group_advantages_binary_group():
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_equal_rewards_are_degenerate_with_zero_advantages():
    for rewards in ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0], [0.3] * 5):
        assert is_degenerate(rewards)
        assert group_advantages(rewards) == [0.0] * len(rewards)
    assert not is_degenerate([1.0, 0.0, 0.0, 0.0])
    assert not is_degenerate([0.0, 0.0, 0.0, 1.0])


# ---- datums -----------------------------------------------------------------------------------------------


def test_build_datum_worked_example():
    d = build_datum([10, 11, 12], [20, 21], [-0.5, -0.7], 0.5)
    assert d.model_input.to_ints() == [10, 11, 12, 20]
    target = d.loss_fn_inputs["target_tokens"]
    assert target.dtype == "int64" and target.data == [0, 0, 20, 21]
    assert d.loss_fn_inputs["logprobs"].dtype == "float32"
    assert d.loss_fn_inputs["logprobs"].data == pytest.approx([0.0, 0.0, -0.5, -0.7])
    assert d.loss_fn_inputs["advantages"].data == pytest.approx([0.0, 0.0, 0.5, 0.5])
    assert all(len(t.data) == 4 for t in d.loss_fn_inputs.values())  # P + C - 1


def test_build_datum_alignment_general():
    prompt, completion = list(range(100, 107)), [5, 6, 7, 8, 9]
    logprobs = [-0.1, -0.2, -0.3, -0.4, -0.5]
    d = build_datum(prompt, completion, logprobs, -0.25)
    inputs = d.model_input.to_ints()
    targets = d.loss_fn_inputs["target_tokens"].data
    n = len(prompt) + len(completion) - 1
    assert len(inputs) == len(targets) == n
    # Position t predicts token t+1 of the full sequence on every completion position.
    full = prompt + completion
    for t in range(len(prompt) - 1, n):
        assert targets[t] == full[t + 1]
    assert d.loss_fn_inputs["advantages"].data[: len(prompt) - 1] == [0.0] * (len(prompt) - 1)
    assert d.loss_fn_inputs["advantages"].data[len(prompt) - 1:] == pytest.approx([-0.25] * len(completion))


def test_build_datum_one_token_prompt_has_no_padding():
    d = build_datum([7], [8, 9], [-1.0, -2.0], 1.0)
    assert d.model_input.to_ints() == [7, 8]
    assert d.loss_fn_inputs["target_tokens"].data == [8, 9]
    assert d.loss_fn_inputs["advantages"].data == [1.0, 1.0]


def test_build_datum_integer_advantage_is_float():
    d = build_datum([1, 2], [3], [-0.5], 1)
    assert d.loss_fn_inputs["advantages"].dtype == "float32"


@pytest.mark.parametrize(
    "prompt, completion, logprobs",
    [([1, 2], [], []), ([], [3], [-0.1]), ([1, 2], [3, 4], [-0.1])],
)
def test_build_datum_rejects_bad_inputs(prompt, completion, logprobs):
    with pytest.raises(ValueError):
        build_datum(prompt, completion, logprobs, 1.0)


def test_count_train_tokens_counts_nonzero_advantages():
    datums = [build_datum([1, 2, 3], [4, 5], [-0.1, -0.2], 0.5), build_datum([1, 2], [4, 5, 6], [-0.1] * 3, -1.0)]
    assert count_train_tokens(datums) == 5
    assert count_train_tokens([build_datum([1, 2], [3], [-0.1], 0.0)]) == 0


# ---- kl_sample_train ----------------------------------------------------------------------------------------


def fb_output(*learner_logprobs):
    return SimpleNamespace(
        loss_fn_outputs=[{"logprobs": TensorData(data=list(lp), dtype="float32")} for lp in learner_logprobs],
        metrics={"loss_mean": 0.1},
    )


def test_kl_sample_train_mean_over_trained_positions():
    d = build_datum([10, 11, 12], [20, 21], [-0.5, -0.7], 0.5)
    # prompt positions differ wildly but carry no advantage, so they must not count
    out = fb_output([-9.0, -9.0, -0.6, -0.5])
    # (-0.5 - -0.6) = 0.1 and (-0.7 - -0.5) = -0.2  ->  mean -0.05
    assert kl_sample_train([d], out) == pytest.approx(-0.05, abs=1e-6)


def test_kl_sample_train_pools_datums_by_token():
    d1 = build_datum([1, 2], [3], [-1.0], 1.0)
    d2 = build_datum([1, 2], [3, 4, 5], [-1.0, -1.0, -1.0], -1.0)
    out = fb_output([0.0, -1.4], [0.0, -1.0, -1.0, -1.0])
    # token-weighted: (0.4 + 0 + 0 + 0) / 4 = 0.1 (a per-datum mean would give 0.2)
    assert kl_sample_train([d1, d2], out) == pytest.approx(0.1, abs=1e-6)


def test_kl_sample_train_none_without_trained_positions():
    d = build_datum([1, 2], [3], [-1.0], 0.0)
    assert kl_sample_train([d], fb_output([0.0, -2.0])) is None
    assert kl_sample_train([], fb_output()) is None


# ---- CISPO -----------------------------------------------------------------------------------------------------


def test_custom_cispo_loss_value_gradient_and_clip_fraction():
    # positions: [prompt pad, tok a, tok b]; q = sampler logprobs
    d = build_datum([1, 2], [3, 4], [-2.0, -0.5], 0.5)
    lp = torch.tensor([-3.0, 0.0, -0.5], requires_grad=True)  # ratios: e^2 (> 4, clipped), 1
    loss, metrics = make_custom_cispo_loss(0.0, 4.0)([d], [lp])
    # loss = -(4 * 0 * 0.5 + 1 * -0.5 * 0.5) = 0.25 ; the pad position has A = 0
    assert float(loss.detach()) == pytest.approx(0.25, abs=1e-6)
    loss.backward()
    # d loss / d lp_t = -sg(clip(r_t)) * A_t : the ratio is a constant weight, not differentiated
    assert lp.grad.tolist() == pytest.approx([0.0, -2.0, -0.5], abs=1e-6)
    assert metrics["cispo/clip_fraction"] == pytest.approx(0.5)
    assert metrics["loss_mean"] == pytest.approx(0.25 / 2, abs=1e-6)  # over the two trained positions


def test_custom_cispo_loss_sums_over_datums():
    d1 = build_datum([1, 2], [3], [-1.0], 1.0)
    d2 = build_datum([1, 2], [3], [-1.0], -1.0)
    lps = [torch.tensor([0.0, -1.0], requires_grad=True), torch.tensor([0.0, -1.0], requires_grad=True)]
    loss, metrics = make_custom_cispo_loss()([d1, d2], lps)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)  # -(1*-1*1) - (1*-1*-1) = 1 - 1
    loss.backward()
    assert lps[0].grad.tolist() == pytest.approx([0.0, -1.0])
    assert lps[1].grad.tolist() == pytest.approx([0.0, 1.0])
    assert metrics["cispo/clip_fraction"] == 0.0


def test_custom_cispo_rejects_bad_bounds_and_mismatch():
    with pytest.raises(ValueError):
        make_custom_cispo_loss(2.0, 1.0)
    with pytest.raises(ValueError):
        make_custom_cispo_loss()([build_datum([1, 2], [3], [-1.0], 1.0)], [])


# ---- step metrics ----------------------------------------------------------------------------------------------


def seq(n_tokens, stop_reason="stop"):
    return SimpleNamespace(tokens=list(range(n_tokens)), stop_reason=stop_reason)


def test_step_stats_metrics():
    stats = StepStats()
    with stats.timer("time/sample"):
        pass
    stats.add_group([1.0, 0.0, 0.0, 0.0], [seq(4), seq(6), seq(8, "length"), seq(2)])
    stats.add_group([1.0, 1.0, 1.0, 1.0], [seq(3), seq(3), seq(3), seq(3)])
    datums = [build_datum([1, 2, 3], [4, 5], [-0.5, -0.5], 0.75), build_datum([1, 2], [4], [-0.5], -0.25)]
    out = fb_output([0.0, 0.0, -0.6, -0.6], [0.0, -0.5])
    m = stats.metrics(datums, out, SimpleNamespace(metrics={"grad_norm": 2.5}))
    assert m["reward"] == pytest.approx(5 / 8)
    assert m["frac_degenerate"] == pytest.approx(0.5)
    assert m["rollout/avg_gen_len"] == pytest.approx((4 + 6 + 8 + 2 + 12) / 8)
    assert m["rollout/frac_truncated"] == pytest.approx(1 / 8)
    assert m["datums"] == 2 and m["train_tokens"] == 3
    assert m["loss_mean"] == pytest.approx(0.1)
    assert m["kl_sample_train"] == pytest.approx((0.1 + 0.1 + 0.0) / 3, abs=1e-6)
    assert m["optim/grad_norm"] == 2.5
    assert set(m) >= {"time/sample", "time/train", "time/sync", "time/step"}
    assert m["time/train"] == 0.0 and m["time/step"] >= m["time/sample"] >= 0.0


def test_step_stats_without_training_has_no_loss():
    stats = StepStats()
    stats.add_group([0.0, 0.0], [seq(1), seq(1)])
    m = stats.metrics([])
    assert m["datums"] == 0 and m["train_tokens"] == 0 and m["frac_degenerate"] == 1.0
    assert "loss_mean" not in m and "kl_sample_train" not in m


def test_step_stats_keeps_cispo_metrics():
    stats = StepStats()
    stats.add_group([1.0, 0.0], [seq(1), seq(1)])
    d = build_datum([1, 2], [3], [-1.0], 0.5)
    out = SimpleNamespace(loss_fn_outputs=[{"logprobs": TensorData(data=[0.0, -1.0], dtype="float32")}],
                          metrics={"loss_mean": 0.3, "cispo/clip_fraction": 0.25, "loss_sum": 9.0})
    m = stats.metrics([d], out)
    assert m["cispo/clip_fraction"] == 0.25 and m["loss_mean"] == 0.3 and "loss_sum" not in m


# ---- step bookkeeping ----------------------------------------------------------------------------------------


def test_sample_seed_is_deterministic_and_distinct():
    assert sample_seed(0, 3, 1) == sample_seed(0, 3, 1)
    seeds = {sample_seed(s, step, i) for s in range(3) for step in range(20) for i in range(16)}
    assert len(seeds) == 3 * 20 * 16
    assert all(0 <= x < 2**31 for x in seeds)


def test_shuffle_rows_deterministic_and_seeded():
    rows = [{"i": i} for i in range(50)]
    assert shuffle_rows(rows, 1) == shuffle_rows(rows, 1)
    assert shuffle_rows(rows, 1) != shuffle_rows(rows, 2)
    assert sorted(r["i"] for r in shuffle_rows(rows, 1)) == list(range(50))
    assert rows == [{"i": i} for i in range(50)]  # input untouched


def test_batch_rows_wraps_unless_all_data():
    rows = list(range(10))
    assert batch_rows(rows, 0, 4, False) == [0, 1, 2, 3]
    assert batch_rows(rows, 2, 4, False) == [8, 9, 0, 1]
    assert batch_rows(rows, 2, 4, True) == [8, 9]


def test_num_steps():
    args = SimpleNamespace(all_data=False, steps=7, batch_size=4)
    assert num_steps(args, 100) == 7
    args.all_data = True
    assert num_steps(args, 10) == 3
    assert num_steps(args, 12) == 3
