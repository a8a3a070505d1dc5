"""gspo, stable_reinforce and soft-target cross-entropy on hand-worked examples: each number in the assertions
is computed here from the formula (README's loss table), independently of the worker's code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from server_mock.training.losses import compute_loss, resolve_loss_config


def loss_and_grad(loss_fn: str, lp: list[float], inputs: dict, config: dict | None = None):
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    tensors = {k: torch.tensor(v, dtype=torch.int64 if k == "target_tokens" else torch.float32)
               for k, v in inputs.items()}
    res = compute_loss(loss_fn, lp_t, tensors, resolve_loss_config(loss_fn, config))
    res.loss.backward()
    return res, lp_t.grad.numpy()


# --- gspo ------------------------------------------------------------------------------------------------

def test_gspo_sequence_ratio_over_the_mask():
    lp = [-1.0, -0.5, -2.0, -1.5]
    q = [0.0, -0.7, -2.2, -1.3]  # position 0 is a prompt position: q = 0, outside the mask
    a = [0.0, 1.0, 1.0, 1.0]
    mask = [0.0, 1.0, 1.0, 1.0]
    res, g = loss_and_grad("gspo", lp, {"target_tokens": [1, 2, 3, 4], "logprobs": q, "advantages": a,
                                        "sequence_ratio_mask": mask})
    s = math.exp(((-0.5 + 0.7) + (-2.0 + 2.2) + (-1.5 + 1.3)) / 3)  # exp(0.2/3) = 1.0689, inside [0.8, 1.2]
    assert res.loss.item() == pytest.approx(-3 * s, rel=1e-6)
    np.testing.assert_allclose(g, [0.0, -s, -s, -s], rtol=1e-6)  # each token: the ratio's value, its own lp
    np.testing.assert_allclose(res.elementwise.numpy(), [0.0, -s, -s, -s], rtol=1e-6)
    assert res.token_count == 3
    # without a mask the ratio runs over the positions with A != 0: the same set here
    res2, g2 = loss_and_grad("gspo", lp, {"target_tokens": [1, 2, 3, 4], "logprobs": q, "advantages": a})
    assert res2.loss.item() == pytest.approx(res.loss.item(), rel=1e-7)
    # a mask that also takes position 0 (q = 0) changes the ratio: exp((-1 + 0.2) / 4)
    res3, _ = loss_and_grad("gspo", lp, {"target_tokens": [1, 2, 3, 4], "logprobs": q, "advantages": a,
                                         "sequence_ratio_mask": [1.0, 1.0, 1.0, 1.0]})
    assert res3.loss.item() == pytest.approx(-3 * math.exp(-0.8 / 4), rel=1e-6)


def test_gspo_clips_whole_sequences():
    lp, q = [-1.0, -1.0], [-1.5, -1.5]  # s = exp(0.5) = 1.6487 > 1.2
    inputs = {"target_tokens": [1, 2], "logprobs": q, "sequence_ratio_mask": [1.0, 1.0]}
    res, g = loss_and_grad("gspo", lp, {**inputs, "advantages": [1.0, 2.0]})  # A > 0: clipped, no gradient
    assert res.loss.item() == pytest.approx(-1.2 * 3.0, rel=1e-6)
    np.testing.assert_array_equal(g, [0.0, 0.0])
    res, g = loss_and_grad("gspo", lp, {**inputs, "advantages": [-1.0, -2.0]})  # A < 0: unclipped branch
    s = math.exp(0.5)
    assert res.loss.item() == pytest.approx(3.0 * s, rel=1e-6)
    np.testing.assert_allclose(g, [s, 2 * s], rtol=1e-6)
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}  # the configured bounds are used
    res, g = loss_and_grad("gspo", lp, {**inputs, "advantages": [1.0, 2.0]}, wide)
    assert res.loss.item() == pytest.approx(-3.0 * s, rel=1e-6)
    np.testing.assert_allclose(g, [-s, -2 * s], rtol=1e-6)


def test_gspo_empty_ratio_set_is_plain_reinforce_of_ratio_one():
    res, g = loss_and_grad("gspo", [-1.0, -2.0], {"target_tokens": [1, -100], "logprobs": [-3.0, 0.0],
                                                  "advantages": [0.5, 9.0], "sequence_ratio_mask": [0.0, 1.0]})
    assert res.loss.item() == pytest.approx(-0.5, rel=1e-7)  # s = 1; the -100 position is out
    np.testing.assert_allclose(g, [-0.5, 0.0])


# --- stable_reinforce --------------------------------------------------------------------------------------

def test_stable_reinforce_on_policy_is_reinforce():
    lp = [-1.0, -0.4, -2.5]
    res, g = loss_and_grad("stable_reinforce", lp, {
        "target_tokens": [0, 5, 6], "logprobs": [0.0, -0.4, -2.5], "advantages": [0.0, 2.0, -1.0],
        "recorded_logprobs": [0.0, -0.4, -2.5], "recorded_mask": [0.0, 1.0, 1.0]})
    assert res.loss.item() == pytest.approx(-(2.0 * -0.4 + -1.0 * -2.5), rel=1e-6)  # r = 1, KL term 0
    np.testing.assert_allclose(g, [0.0, -2.0, 1.0], rtol=1e-6)
    assert res.token_count == 2


def test_stable_reinforce_truncates_and_pulls_toward_the_sampler():
    lp, mu = [-1.0, -1.0], [-1.5, -0.5]  # r = e^0.5 (truncated to 1) and e^-0.5
    k = 0.2
    res, g = loss_and_grad("stable_reinforce", lp, {
        "target_tokens": [3, 4], "logprobs": [-9.0, -9.0],  # the client's copy is not what the loss reads
        "advantages": [1.0, 1.0], "recorded_logprobs": mu, "recorded_mask": [1.0, 1.0]}, {"kl_coeff": k})
    r0, r1 = math.exp(0.5), math.exp(-0.5)
    value = (-1.0 * 1.0 * -1.0 + k * (r0 - 1 - 0.5)) + (-r1 * 1.0 * -1.0 + k * (r1 - 1 + 0.5))
    assert res.loss.item() == pytest.approx(value, rel=1e-6)
    np.testing.assert_allclose(g, [-1.0 + k * (r0 - 1), -r1 + k * (r1 - 1)], rtol=1e-6)
    # kl_coeff = 0: the plain truncated REINFORCE term
    res0, g0 = loss_and_grad("stable_reinforce", lp, {
        "target_tokens": [3, 4], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0],
        "recorded_logprobs": mu, "recorded_mask": [1.0, 1.0]}, {"kl_coeff": 0.0})
    np.testing.assert_allclose(g0, [-1.0, -r1], rtol=1e-6)
    # the default kl_coeff is 0.01
    resd, gd = loss_and_grad("stable_reinforce", lp, {
        "target_tokens": [3, 4], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0],
        "recorded_logprobs": mu, "recorded_mask": [1.0, 1.0]})
    np.testing.assert_allclose(gd, [-1.0 + 0.01 * (r0 - 1), -r1 + 0.01 * (r1 - 1)], rtol=1e-6)


# --- soft-target cross-entropy -----------------------------------------------------------------------------

def test_soft_targets_value_gradient_and_count():
    lp = np.array([[-0.5, -1.5, -3.0], [-2.0, -0.1, -4.0], [-1.0, -1.0, -1.0]])
    w = np.array([[0.7, 0.3, 0.0], [0.0, 0.0, 0.0], [0.5, 2.0, 1.0]])
    targets = np.array([[4, 9, 4], [1, 2, 3], [5, -100, 6]])  # the -100 cell is ignored whatever its weight
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    res = compute_loss("cross_entropy", lp_t, {"target_tokens": torch.tensor(targets),
                                               "weights": torch.tensor(w, dtype=torch.float32)}, {})
    res.loss.backward()
    rows = [-(0.7 * -0.5 + 0.3 * -1.5), 0.0, -(0.5 * -1.0 + 1.0 * -1.0)]
    assert res.loss.item() == pytest.approx(sum(rows), rel=1e-6)
    np.testing.assert_allclose(res.elementwise.numpy(), rows, rtol=1e-6)
    np.testing.assert_allclose(lp_t.grad.numpy(), [[-0.7, -0.3, 0.0], [0.0, 0.0, 0.0], [-0.5, 0.0, -1.0]])
    assert res.token_count == 2  # positions with a live cell of nonzero weight


def test_soft_targets_with_k_1_equal_the_hard_loss():
    lp = [-0.3, -1.2, -2.2]
    hard, g_hard = loss_and_grad("cross_entropy", lp, {"target_tokens": [3, 4, -100], "weights": [1.0, 0.5, 1.0]})
    lp_t = torch.tensor([[v] for v in lp], dtype=torch.float32, requires_grad=True)
    soft = compute_loss("cross_entropy", lp_t, {"target_tokens": torch.tensor([[3], [4], [-100]]),
                                                "weights": torch.tensor([[1.0], [0.5], [1.0]])}, {})
    soft.loss.backward()
    assert soft.loss.item() == pytest.approx(hard.loss.item(), rel=1e-7)
    np.testing.assert_allclose(lp_t.grad.numpy()[:, 0], g_hard)
    assert soft.token_count == hard.token_count == 2
