"""Losses checked against independent references: plain Python loops for values,
hand-derived per-token gradients, and float64 finite differences of the loop reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from server_mock.training.losses import (
    LOSS_FUNCTIONS,
    OPTIONAL_INPUTS,
    REQUIRED_INPUTS,
    LossConfigError,
    compute_loss,
    resolve_loss_config,
)

N = 23


def make_datum(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, 1000, N)
    targets[rng.random(N) < 0.3] = -100
    targets[0] = -100  # at least one masked position
    targets[1] = 7  # at least one live one
    lp = -3.0 * rng.random(N)
    q = lp + 0.6 * rng.standard_normal(N)  # ratios spread on both sides of the clip range
    adv = rng.standard_normal(N)
    adv[rng.random(N) < 0.2] = 0.0
    w = rng.random(N)
    w[rng.random(N) < 0.2] = 0.0
    recorded = (rng.random(N) < 0.7).astype(float)  # stable_reinforce: the positions the sampler recorded
    mu = lp + 0.5 * rng.standard_normal(N)  # their recorded sampler logprobs (ratios on both sides of 1)
    ratio_mask = (rng.random(N) < 0.6).astype(float)  # gspo: the positions of the sequence ratio
    return {"target_tokens": targets, "lp": lp, "logprobs": q, "advantages": adv, "weights": w,
            "recorded_mask": recorded, "recorded_logprobs": mu * recorded, "sequence_ratio_mask": ratio_mask}


def gspo_ratio(d: dict, lp: np.ndarray) -> float:
    """GSPO's sequence ratio: exp of the mean log-ratio over the live positions of the ratio mask."""
    live = [i for i in range(len(lp)) if d["target_tokens"][i] != -100 and d["sequence_ratio_mask"][i] != 0]
    return math.exp(sum(lp[i] - d["logprobs"][i] for i in live) / len(live)) if live else 1.0


def ref_token(loss_fn: str, lp: float, q: float, a: float, w: float, cfg: dict, r: float | None = None,
              mu: float | None = None) -> float:
    """Per-token loss, written straight from the formulas (policy losses scaled by their optional weight; gspo:
    ``r`` is the sequence ratio; stable_reinforce: ``mu`` the recorded sampler logprob, None off the recorded
    positions)."""
    r = math.exp(lp - q) if r is None else r
    if loss_fn == "gspo":
        clipped = min(max(r, cfg["clip_low_threshold"]), cfg["clip_high_threshold"])
        return -min(r * a, clipped * a)
    if loss_fn == "stable_reinforce":
        if mu is None:
            return 0.0
        ratio = math.exp(lp - mu)
        return -min(ratio, 1.0) * a * lp + cfg["kl_coeff"] * (ratio - 1.0 - (lp - mu))
    if loss_fn == "cross_entropy":
        return -w * lp
    if loss_fn == "importance_sampling":  # the policy losses are scaled by their optional weight
        return -w * r * a
    if loss_fn == "ppo":
        clipped = min(max(r, cfg["clip_low_threshold"]), cfg["clip_high_threshold"])
        return -w * min(r * a, clipped * a)
    if loss_fn == "cispo":
        clipped = min(max(r, cfg["clip_low_threshold"]), cfg["clip_high_threshold"])
        return -w * clipped * lp * a
    if loss_fn == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2)
    raise AssertionError(loss_fn)


def ref_grad_token(loss_fn: str, lp: float, q: float, a: float, w: float, cfg: dict, r: float | None = None,
                   mu: float | None = None) -> float:
    """d(per-token loss)/d lp, derived by hand (ratio is stop-gradient in cispo; gspo's token ratio has the
    sequence ratio's value and d/d lp_t = that value; stable_reinforce's weight min(r, 1) is stop-gradient)."""
    r = math.exp(lp - q) if r is None else r
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    if loss_fn == "stable_reinforce":
        if mu is None:
            return 0.0
        ratio = math.exp(lp - mu)
        return -min(ratio, 1.0) * a + cfg["kl_coeff"] * (ratio - 1.0)
    if loss_fn == "cross_entropy":
        return -w
    if loss_fn == "importance_sampling":
        return -w * r * a
    if loss_fn in ("ppo", "gspo"):
        scale = w if loss_fn == "ppo" else 1.0  # gspo takes no per-token weights
        clipped = min(max(r, lo), hi)
        if r * a <= clipped * a or lo < r < hi:  # unclipped branch active
            return -scale * r * a
        return 0.0
    if loss_fn == "cispo":
        return -w * min(max(r, lo), hi) * a
    if loss_fn == "dro":
        return -(a - cfg["beta"] * (lp - q))
    raise AssertionError(loss_fn)


def token_args(loss_fn: str, d: dict, i: int, lp: np.ndarray) -> dict:
    """The per-datum quantities ref_token needs beyond the position's own inputs."""
    if loss_fn == "gspo":
        return {"r": gspo_ratio(d, lp)}
    if loss_fn == "stable_reinforce":
        return {"mu": d["recorded_logprobs"][i] if d["recorded_mask"][i] else None}
    return {}


def ref_loss(loss_fn: str, d: dict, cfg: dict, lp: np.ndarray | None = None) -> float:
    lp = d["lp"] if lp is None else lp
    total = 0.0
    for i in range(N):
        if d["target_tokens"][i] == -100:
            continue
        total += ref_token(loss_fn, lp[i], d["logprobs"][i], d["advantages"][i], d["weights"][i], cfg,
                           **token_args(loss_fn, d, i, lp))
    return total


def run(loss_fn: str, d: dict, cfg: dict, lp: np.ndarray | None = None, drop_weights: bool = False):
    lp_t = torch.tensor(d["lp"] if lp is None else lp, dtype=torch.float32, requires_grad=True)
    inputs = {"target_tokens": torch.tensor(d["target_tokens"], dtype=torch.int64)}
    for key in REQUIRED_INPUTS[loss_fn] + OPTIONAL_INPUTS[loss_fn]:
        if key != "target_tokens" and not (drop_weights and key == "weights"):
            inputs[key] = torch.tensor(d[key], dtype=torch.float32)
    res = compute_loss(loss_fn, lp_t, inputs, cfg)
    res.loss.backward()
    return res, lp_t.grad.numpy()


CFGS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "stable_reinforce": {"kl_coeff": 0.3},  # large enough that the KL term weighs in the comparison
}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("loss_fn", LOSS_FUNCTIONS)
def test_value_and_grad_match_reference(loss_fn, seed):
    d = make_datum(seed)
    cfg = dict(CFGS[loss_fn])
    if loss_fn == "cispo":
        cfg["clip_high_threshold"] = 1.3  # make the upper clip actually bite on random data
    res, grad = run(loss_fn, d, cfg)
    assert res.loss.item() == pytest.approx(ref_loss(loss_fn, d, cfg), rel=1e-5, abs=1e-5)

    mask = d["target_tokens"] != -100
    expected_grad = np.zeros(N)
    expected_elem = np.zeros(N)
    for i in np.flatnonzero(mask):
        args = (d["lp"][i], d["logprobs"][i], d["advantages"][i], d["weights"][i], cfg)
        extra = token_args(loss_fn, d, i, d["lp"])
        expected_grad[i] = ref_grad_token(loss_fn, *args, **extra)
        expected_elem[i] = ref_token(loss_fn, *args, **extra)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.elementwise.numpy(), expected_elem, rtol=1e-5, atol=1e-5)
    assert not res.elementwise.requires_grad

    # stop-gradients make cispo's, gspo's and stable_reinforce's gradients differ from d(value)/d lp
    if loss_fn not in ("cispo", "gspo", "stable_reinforce"):
        eps = 1e-6
        fd = np.zeros(N)
        for i in range(N):
            up, down = d["lp"].copy(), d["lp"].copy()
            up[i] += eps
            down[i] -= eps
            fd[i] = (ref_loss(loss_fn, d, cfg, up) - ref_loss(loss_fn, d, cfg, down)) / (2 * eps)
        np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-4)


def one_token(r: float, a: float, q: float = -1.0) -> dict:
    return {
        "target_tokens": np.array([5]),
        "lp": np.array([q + math.log(r)]),
        "logprobs": np.array([q]),
        "advantages": np.array([a]),
        "weights": np.array([1.0]),
    }


@pytest.mark.parametrize(
    "r, a, loss, grad",
    [
        (1.5, 1.0, -1.2, 0.0),  # A>0, r>hi: clipped -> -hi*A, no gradient
        (0.5, -1.0, 0.8, 0.0),  # A<0, r<lo: min(-0.5, -0.8) = -0.8 clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # A<0, r>hi: min(-1.5, -1.2) = -1.5 unclipped, grad -r*A
        (0.5, 1.0, -0.5, -0.5),  # A>0, r<lo: min(0.5, 0.8) = 0.5 unclipped, grad -r*A
        (1.1, 2.0, -2.2, -2.2),  # inside the clip range: plain -r*A
    ],
)
def test_ppo_clip_both_signs(r, a, loss, grad):
    res, g = run("ppo", one_token(r, a), resolve_loss_config("ppo", None))
    assert res.loss.item() == pytest.approx(loss, abs=1e-6)
    assert g[0] == pytest.approx(grad, abs=1e-6)


def test_ppo_custom_thresholds_change_result():
    d = one_token(1.5, 1.0)
    wide = resolve_loss_config("ppo", {"clip_low_threshold": 0.4, "clip_high_threshold": 2.0})
    res, g = run("ppo", d, wide)
    assert res.loss.item() == pytest.approx(-1.5, abs=1e-6)  # no longer clipped
    assert g[0] == pytest.approx(-1.5, abs=1e-6)
    res, g = run("ppo", d, resolve_loss_config("ppo", {"clip_high_threshold": 1.4}))
    assert res.loss.item() == pytest.approx(-1.4, abs=1e-6)
    assert g[0] == 0.0


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage():
    q = np.array([-1.0, -2.0, -0.5, -1.5])
    r = np.array([5.0, 0.5, 1.0, 3.0])
    a = np.array([1.5, -2.0, 0.7, -0.3])
    d = {
        "target_tokens": np.array([1, 2, 3, -100]),
        "lp": q + np.log(r),
        "logprobs": q,
        "advantages": a,
        "weights": np.ones(4),
    }
    res, g = run("cispo", d, resolve_loss_config("cispo", None))  # clip to [0, 4]
    np.testing.assert_allclose(g, [-4.0 * 1.5, -0.5 * -2.0, -1.0 * 0.7, 0.0], rtol=1e-6)
    lp = d["lp"]
    expected = -(4.0 * lp[0] * 1.5 + 0.5 * lp[1] * -2.0 + 1.0 * lp[2] * 0.7)
    assert res.loss.item() == pytest.approx(expected, rel=1e-6)
    narrow = resolve_loss_config("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.0})
    res, g = run("cispo", d, narrow)
    np.testing.assert_allclose(g, [-1.0 * 1.5, -0.9 * -2.0, -1.0 * 0.7, 0.0], rtol=1e-6)


def test_dro_beta_term():
    # A = 0 everywhere: only the penalty remains, loss = beta/2 * sum (lp - q)^2, grad = beta * (lp - q).
    lp = np.array([-1.0, -2.0, -0.5, -3.0])
    q = np.array([-1.5, -1.0, -0.5, 9.0])
    d = {
        "target_tokens": np.array([1, 2, 3, -100]),
        "lp": lp,
        "logprobs": q,
        "advantages": np.zeros(4),
        "weights": np.ones(4),
    }
    res, g = run("dro", d, resolve_loss_config("dro", {"beta": 0.2}))
    assert res.loss.item() == pytest.approx(0.1 * (0.5**2 + 1.0**2 + 0.0), rel=1e-6)  # 0.125
    np.testing.assert_allclose(g, [0.2 * 0.5, 0.2 * -1.0, 0.0, 0.0], atol=1e-7)
    assert res.token_count == 3  # A = 0 positions still count for dro (the -100 one does not)
    # beta = 0: plain -sum lp*A
    d["advantages"] = np.array([1.0, -1.0, 3.0, 5.0])
    res, g = run("dro", d, resolve_loss_config("dro", {"beta": 0}))
    assert res.loss.item() == pytest.approx(0.5, rel=1e-6)  # -(-1*1 + -2*-1 + -0.5*3) = -(-1 + 2 - 1.5)
    np.testing.assert_allclose(g, [-1.0, 1.0, -3.0, 0.0])


def test_token_count_rules():
    d = {
        "target_tokens": np.array([-100, 4, 4, 4, 4, -100]),
        "lp": np.full(6, -1.0),
        "logprobs": np.full(6, -1.2),
        "advantages": np.array([1.0, 0.0, 1.0, -1.0, 0.0, 2.0]),
        "weights": np.array([1.0, 1.0, 0.0, 0.5, 1.0, 1.0]),
    }
    assert run("cross_entropy", d, {})[0].token_count == 3  # mask & w != 0: positions 1, 3, 4
    assert run("cross_entropy", d, {}, drop_weights=True)[0].token_count == 4  # weights default to ones
    for loss_fn in ("importance_sampling", "ppo", "cispo", "gspo"):
        d["sequence_ratio_mask"] = np.ones(6)
        assert run(loss_fn, d, CFGS[loss_fn], drop_weights=True)[0].token_count == 2  # mask & A != 0: positions 2, 3
        # & w != 0: position 3 (gspo takes no per-token weights: still 2, 3)
        assert run(loss_fn, d, CFGS[loss_fn])[0].token_count == (2 if loss_fn == "gspo" else 1)
    assert run("dro", d, CFGS["dro"])[0].token_count == 4  # mask only
    # stable_reinforce: the recorded (sampled) positions; with kl_coeff = 0 only those with A != 0
    d["recorded_mask"] = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    d["recorded_logprobs"] = np.full(6, -1.1) * d["recorded_mask"]
    assert run("stable_reinforce", d, {"kl_coeff": 0.5})[0].token_count == 3  # positions 1, 2, 4
    assert run("stable_reinforce", d, {"kl_coeff": 0.0})[0].token_count == 1  # position 2


def test_cross_entropy_default_weights():
    d = make_datum(7)
    res, g = run("cross_entropy", d, {}, drop_weights=True)
    mask = d["target_tokens"] != -100
    assert res.loss.item() == pytest.approx(-sum(d["lp"][mask]), rel=1e-5)
    np.testing.assert_array_equal(g, np.where(mask, -1.0, 0.0))


@pytest.mark.parametrize("loss_fn", LOSS_FUNCTIONS)
def test_masked_garbage_does_not_leak(loss_fn):
    d = make_datum(11)
    masked = d["target_tokens"] == -100
    lp = d["lp"].copy()
    lp[masked] = np.nan
    lp[np.flatnonzero(masked)[0]] = np.inf
    d["logprobs"] = np.where(masked, -np.inf, d["logprobs"])
    d["advantages"] = np.where(masked, np.nan, d["advantages"])
    d["weights"] = np.where(masked, np.nan, d["weights"])
    d["recorded_logprobs"] = np.where(masked, np.nan, d["recorded_logprobs"])
    d["sequence_ratio_mask"] = np.where(masked, 1.0, d["sequence_ratio_mask"])  # masked: never in the ratio
    res, g = run(loss_fn, d, CFGS[loss_fn], lp=lp)
    assert math.isfinite(res.loss.item())
    assert np.all(np.isfinite(g)) and np.all(g[masked] == 0)
    assert np.all(res.elementwise.numpy()[masked] == 0)
    clean = make_datum(11)
    assert res.loss.item() == pytest.approx(ref_loss(loss_fn, clean, CFGS[loss_fn]), rel=1e-5, abs=1e-5)


def group_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def test_group_advantage_importance_sampling_example():
    rewards = [1, 0, 0, -0.1, 1, 0, 0, -0.1]
    adv = group_advantages(rewards)  # mean = 1.8 / 8 = 0.225
    assert adv == pytest.approx([0.775, -0.225, -0.225, -0.325, 0.775, -0.225, -0.225, -0.325])
    completion_lens = [3, 1, 2, 2, 1, 4, 2, 1]
    total, count = 0.0, 0
    for a, n in zip(adv, completion_lens):
        # 2 prompt tokens (A = 0), n completion tokens (A = a), lp == q so r = 1; first target is -100.
        lp = np.linspace(-2.0, -0.1, 2 + n)
        d = {
            "target_tokens": np.array([-100] + [9] * (1 + n)),
            "lp": lp,
            "logprobs": lp.copy(),
            "advantages": np.array([0.0, 0.0] + [a] * n),
            "weights": np.ones(2 + n),
        }
        res, g = run("importance_sampling", d, {})
        np.testing.assert_allclose(g, [0.0, 0.0] + [-a] * n, atol=1e-7)
        total += res.loss.item()
        count += res.token_count
    # loss = -sum A over tokens
    #      = -(0.775*3 - 0.225*1 - 0.225*2 - 0.325*2 + 0.775*1 - 0.225*4 - 0.225*2 - 0.325*1)
    #      = -(3.1 - 3.0) = -0.1
    assert total == pytest.approx(-0.1, abs=1e-6)
    assert count == 16  # prompt tokens have A = 0 and do not count


def test_missing_required_input():
    lp = torch.zeros(3, requires_grad=True)
    with pytest.raises(LossConfigError) as e:
        inputs = {"target_tokens": torch.tensor([1, 2, 3]), "logprobs": torch.zeros(3)}
        compute_loss("ppo", lp, inputs, resolve_loss_config("ppo", None))
    assert e.value.field == "loss_fn_inputs.advantages"


def test_resolve_defaults():
    assert resolve_loss_config("cross_entropy", None) == {}
    assert resolve_loss_config("importance_sampling", {}) == {}
    assert resolve_loss_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss_config("cispo", None) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_loss_config("dro", None) == {"beta": 0.05}
    assert resolve_loss_config("gspo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss_config("stable_reinforce", None) == {"kl_coeff": 0.01}
    assert resolve_loss_config("stable_reinforce", {"kl_coeff": 0}) == {"kl_coeff": 0.0}
    out = resolve_loss_config("ppo", {"clip_high_threshold": 2})
    assert out == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}
    assert isinstance(out["clip_high_threshold"], float)
    equal = resolve_loss_config("cispo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0})
    assert equal == {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}  # lo == hi is fine for cispo


def test_resolve_unknown_loss_name():
    with pytest.raises(LossConfigError) as e:
        resolve_loss_config("grpo", None)
    assert e.value.field == "loss_fn"
    assert isinstance(e.value, ValueError)
    for name in LOSS_FUNCTIONS:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "loss_fn, key, accepted",
    [
        ("ppo", "epsilon", "clip_high_threshold"),
        ("dro", "clip_low_threshold", "beta"),
        ("cross_entropy", "beta", "none"),
    ],
)
def test_resolve_unknown_key(loss_fn, key, accepted):
    with pytest.raises(LossConfigError) as e:
        resolve_loss_config(loss_fn, {key: 1.0})
    assert e.value.field == f"loss_fn_config.{key}"
    assert accepted in str(e.value)


@pytest.mark.parametrize(
    "loss_fn, config, field",
    [
        ("ppo", {"clip_low_threshold": "0.8"}, "clip_low_threshold"),
        ("ppo", {"clip_high_threshold": float("nan")}, "clip_high_threshold"),
        ("dro", {"beta": float("inf")}, "beta"),
        ("dro", {"beta": True}, "beta"),
        ("dro", {"beta": None}, "beta"),
        ("dro", {"beta": -0.1}, "beta"),
        ("ppo", {"clip_low_threshold": -0.1}, "clip_low_threshold"),
        ("ppo", {"clip_low_threshold": 1.3}, "clip_high_threshold"),
        ("ppo", {"clip_low_threshold": 1.2}, "clip_high_threshold"),  # lo == hi not allowed for ppo
        ("cispo", {"clip_low_threshold": 5.0}, "clip_high_threshold"),
        ("cispo", {"clip_low_threshold": -1.0}, "clip_low_threshold"),
        ("gspo", {"clip_low_threshold": 1.2}, "clip_high_threshold"),
        ("gspo", {"epsilon": 0.2}, "epsilon"),
        ("stable_reinforce", {"kl_coeff": -0.01}, "kl_coeff"),
        ("stable_reinforce", {"kl_coeff": float("nan")}, "kl_coeff"),
        ("stable_reinforce", {"beta": 0.1}, "beta"),
    ],
)
def test_resolve_bad_values(loss_fn, config, field):
    with pytest.raises(LossConfigError) as e:
        resolve_loss_config(loss_fn, config)
    assert e.value.field == f"loss_fn_config.{field}"
    assert field in str(e.value)


def test_resolve_config_not_a_dict():
    with pytest.raises(LossConfigError) as e:
        resolve_loss_config("ppo", [0.8, 1.2])
    assert e.value.field == "loss_fn_config"


# --- the KL to the reference and the entropy (policy_terms.py) ---------------------------------------------------

def test_resolve_kl_and_entropy_keys():
    # only the keys given come back: a request without them resolves exactly as before
    assert resolve_loss_config("ppo", {"kl_coef": 0}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2,
                                                          "kl_coef": 0.0, "kl_estimator": "k3"}
    assert resolve_loss_config("importance_sampling", {"kl_coef": 0.05, "kl_estimator": "k1"}) == {
        "kl_coef": 0.05, "kl_estimator": "k1"}
    assert resolve_loss_config("cross_entropy", {"return_entropy": True}) == {"return_entropy": True}
    assert resolve_loss_config("dro", {"return_entropy": 1.0}) == {"beta": 0.05, "return_entropy": True}
    assert resolve_loss_config("cispo", {"return_entropy": False}) == {"clip_low_threshold": 0.0,
                                                                       "clip_high_threshold": 4.0}


@pytest.mark.parametrize(
    "loss_fn, config, field",
    [
        ("ppo", {"kl_coef": -1e-12}, "kl_coef"),  # one past the bound 0
        ("ppo", {"kl_coef": float("nan")}, "kl_coef"),
        ("ppo", {"kl_coef": float("inf")}, "kl_coef"),
        ("ppo", {"kl_coef": True}, "kl_coef"),
        ("ppo", {"kl_coef": "0.1"}, "kl_coef"),
        ("ppo", {"kl_coef": 0.1, "kl_estimator": "k4"}, "kl_estimator"),
        ("ppo", {"kl_coef": 0.1, "kl_estimator": 3}, "kl_estimator"),
        ("ppo", {"kl_estimator": "k3"}, "kl_estimator"),  # without kl_coef
        ("cross_entropy", {"kl_coef": 0.1}, "kl_coef"),
        ("dro", {"kl_coef": 0.1}, "kl_coef"),
        ("ppo", {"return_entropy": 2}, "return_entropy"),
        ("ppo", {"return_entropy": "yes"}, "return_entropy"),
    ],
)
def test_resolve_bad_kl_and_entropy_values(loss_fn, config, field):
    with pytest.raises(LossConfigError) as e:
        resolve_loss_config(loss_fn, config)
    assert e.value.field == f"loss_fn_config.{field}"


def test_unknown_key_message_lists_the_shared_keys():
    with pytest.raises(LossConfigError) as e:
        resolve_loss_config("ppo", {"beta": 0.1})
    assert "kl_coef" in str(e.value) and "return_entropy" in str(e.value)
    with pytest.raises(LossConfigError) as e:
        resolve_loss_config("cross_entropy", {"kl": 0.1})
    assert "return_entropy" in str(e.value) and "kl_coef" not in str(e.value)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_value_gradient_and_token_count(estimator):
    """w * (surrogate + beta * KL) per token against the formulas; the KL trains tokens whose advantage is 0 when
    weights mark them, and only the tokens with A != 0 without weights."""
    lp = np.array([-1.0, -2.0, -0.5, -3.0, -1.5])
    ref = np.array([-1.2, -1.0, -0.5, 2.0, -1.0])
    d = {"target_tokens": np.array([1, 2, 3, -100, 5]), "lp": lp, "logprobs": lp.copy(),
         "advantages": np.array([1.0, 0.0, -2.0, 1.0, 0.5]), "weights": np.array([0.5, 1.0, 1.0, 1.0, 0.0])}
    beta = 0.3

    def kl(x, r):
        return {"k1": x - r, "k2": 0.5 * (x - r) ** 2, "k3": math.exp(r - x) - (r - x) - 1}[estimator]

    def dkl(x, r):
        return {"k1": 1.0, "k2": x - r, "k3": 1 - math.exp(r - x)}[estimator]

    cfg = resolve_loss_config("importance_sampling", {"kl_coef": beta, "kl_estimator": estimator})
    for weighted in (True, False):
        lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
        inputs = {"target_tokens": torch.tensor(d["target_tokens"]),
                  "logprobs": torch.tensor(lp, dtype=torch.float32),
                  "advantages": torch.tensor(d["advantages"], dtype=torch.float32)}
        if weighted:
            inputs["weights"] = torch.tensor(d["weights"], dtype=torch.float32)
        res = compute_loss("importance_sampling", lp_t, inputs, cfg, torch.tensor(ref, dtype=torch.float32))
        res.loss.backward()
        want, grad, kls = 0.0, np.zeros(5), np.zeros(5)
        for i in range(5):
            a, w = d["advantages"][i], d["weights"][i] if weighted else 1.0
            trained = d["target_tokens"][i] != -100 and (w != 0 if weighted else a != 0)
            if not trained:
                continue
            want += w * (-a + beta * kl(lp[i], ref[i]))  # r = 1 here: lp == q
            grad[i] = w * (-a + beta * dkl(lp[i], ref[i]))
            kls[i] = kl(lp[i], ref[i])
        assert res.loss.item() == pytest.approx(want, rel=1e-6, abs=1e-6)
        np.testing.assert_allclose(lp_t.grad.numpy(), grad, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(res.kl.numpy(), kls, rtol=1e-5, atol=1e-6)
        # weighted: positions 0, 1, 2 (position 1 has A = 0 but a weight); unweighted: A != 0 -> 0, 2, 4
        assert res.token_count == 3


def test_kl_coef_needs_reference_logprobs():
    cfg = resolve_loss_config("ppo", {"kl_coef": 0.1})
    inputs = {"target_tokens": torch.tensor([1]), "logprobs": torch.zeros(1), "advantages": torch.ones(1)}
    with pytest.raises(ValueError, match="reference"):
        compute_loss("ppo", torch.zeros(1, requires_grad=True), inputs, cfg)


def test_extreme_values_off_the_trained_tokens_never_reach_the_kl_gradient():
    """A prompt position (A = 0, no weights) whose policy and reference disagree wildly: exp(ref - lp) is inf
    in float32 there, yet the loss and the gradient stay finite and that position's gradient is 0."""
    lp = torch.tensor([-1.0, -100.0, -0.5], requires_grad=True)
    inputs = {"target_tokens": torch.tensor([1, 2, 3]), "logprobs": torch.tensor([-1.0, -1.0, -0.5]),
              "advantages": torch.tensor([1.0, 0.0, 1.0])}
    res = compute_loss("importance_sampling", lp, inputs, resolve_loss_config("importance_sampling", {"kl_coef": 1}),
                       torch.tensor([-1.0, 0.0, -0.5]))
    res.loss.backward()
    assert math.isfinite(res.loss.item()) and torch.isfinite(lp.grad).all() and lp.grad[1] == 0
