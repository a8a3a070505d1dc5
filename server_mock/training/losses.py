"""Training losses, one small function each, with Tinker semantics.

Every loss is token-wise and SUMMED over the tokens of a datum (and, by the
caller, over the datums of a batch): no mean, no length normalisation.

Notation for one datum of length N (all tensors are [N]):
  lp   learner logprob of the target token at each position (float32, grad)
  q    the ``logprobs`` input (sampler logprobs)
  A    the ``advantages`` input,  w  the ``weights`` input
  r    exp(lp - q), the importance ratio
  mask target_tokens != -100

Positions whose target is -100 (the ignore index) contribute nothing, ever:
no loss, no gradient, no token count, even if lp / q / A hold NaN or inf there.

In RL datums the prompt positions normally carry A = 0, so they contribute
nothing to importance_sampling / ppo / cispo. They DO contribute the
beta/2 * (lp - q)^2 term to dro unless their target is -100.

``token_count`` is the number of positions that can contribute; the worker
reports ``loss_mean = loss_sum / token_count``.

Two losses are not plain token-wise functions of the datum's inputs:
  gspo              one sequence ratio per datum (the mean log-ratio over the datum's ratio mask)
  stable_reinforce  reads ``recorded_logprobs`` / ``recorded_mask``: the sampler's logprobs of the datum's
                    sampled tokens as the worker recorded them at sampling time, filled in by the front end
                    from the datum's provenance spans (never sent by the client)
and ``cross_entropy`` also takes soft targets: ``target_tokens`` and ``weights`` of shape [N, K].

Policy losses (importance_sampling / ppo / cispo) take optional per-token ``weights``
w: each token's loss becomes w * (surrogate + beta * KL), so any normalisation (a
token mean, a per-sequence mean, a constant) is exact on top of the sum. The KL to
the reference model and the entropy: policy_terms.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from server_mock.training import policy_terms

IGNORE_INDEX = -100

LOSS_FUNCTIONS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                                    "stable_reinforce")

# stable_reinforce's inputs that the worker fills in from its sampling-time records (see the module docstring)
RECORDED_INPUTS: tuple[str, ...] = ("recorded_logprobs", "recorded_mask")

_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    **{name: _POLICY_INPUTS for name in LOSS_FUNCTIONS[1:]},
}
REQUIRED_INPUTS["stable_reinforce"] = _POLICY_INPUTS + RECORDED_INPUTS
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {name: () for name in LOSS_FUNCTIONS}
OPTIONAL_INPUTS["cross_entropy"] = ("weights",)
OPTIONAL_INPUTS["gspo"] = ("sequence_ratio_mask",)
# inputs that may carry K values per position ([N, K]): soft-target cross-entropy
SOFT_TARGET_INPUTS: dict[str, tuple[str, ...]] = {"cross_entropy": ("target_tokens", "weights")}
for _name in policy_terms.KL_LOSSES:
    OPTIONAL_INPUTS[_name] = ("weights",)

# ppo bounds are ratio bounds (not epsilons). cispo defaults are Tinker's documented
# ones. Tinker documents no default beta for dro; 0.05 is the example in its docs.
# gspo: Tinker's page names clip(s, 1 - eps_low, 1 + eps_high) like its ppo page; the worker takes ppo's keys and
# defaults. stable_reinforce: kl_coeff is the only key the SDK names, with 0.01 as its example value.
DEFAULT_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "stable_reinforce": {"kl_coeff": 0.01},
}


class LossConfigError(ValueError):
    """A bad loss name, config key or value; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def resolve_loss_config(loss_fn: str, config: dict | None) -> dict[str, float]:
    """Validate ``config`` for ``loss_fn`` and fill defaults; returns a dict of floats."""
    if loss_fn not in DEFAULT_CONFIG:
        raise LossConfigError("loss_fn", f"unknown loss {loss_fn!r}; use one of {', '.join(LOSS_FUNCTIONS)}")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise LossConfigError("loss_fn_config", f"must be a dict of numbers, got {type(config).__name__}")
    config, extras = policy_terms.resolve(loss_fn, config, LossConfigError)
    defaults = DEFAULT_CONFIG[loss_fn]
    accepted = ", ".join(defaults) or "none of its own (pass no loss_fn_config)"
    accepted += "; and return_entropy" + (", kl_coef, kl_estimator" if loss_fn in policy_terms.KL_LOSSES else "")
    out = dict(defaults)
    for key, value in config.items():
        field = f"loss_fn_config.{key}"
        if key not in defaults:
            raise LossConfigError(field, f"not a key of {loss_fn}; accepted keys: {accepted}")
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise LossConfigError(field, f"must be a finite number, got {value!r}")
        out[key] = float(value)
    if loss_fn in ("ppo", "cispo", "gspo"):
        lo, hi = out["clip_low_threshold"], out["clip_high_threshold"]
        if lo < 0:
            raise LossConfigError(
                "loss_fn_config.clip_low_threshold", f"must be >= 0 (a ratio bound), got {lo}"
            )
        if hi < lo or (loss_fn != "cispo" and hi == lo):
            rel = "<=" if loss_fn == "cispo" else "<"
            raise LossConfigError(
                "loss_fn_config.clip_high_threshold",
                f"need clip_low_threshold {rel} clip_high_threshold, got {lo} and {hi}",
            )
    if loss_fn == "dro" and out["beta"] < 0:
        raise LossConfigError("loss_fn_config.beta", f"must be >= 0, got {out['beta']}")
    if loss_fn == "stable_reinforce" and out["kl_coeff"] < 0:
        raise LossConfigError("loss_fn_config.kl_coeff", f"must be >= 0, got {out['kl_coeff']}")
    out.update(extras)  # only the keys given: without them the call runs exactly as before
    return out


@dataclass
class LossResult:
    loss: torch.Tensor  # scalar, the summed loss, differentiable
    elementwise: torch.Tensor  # [N] per-position loss, detached, 0 at masked positions
    token_count: int  # positions that can contribute (see compute_loss)
    counted: torch.Tensor | None = None  # [N] bool, the positions counted in token_count
    kl: torch.Tensor | None = None  # [N] per-token KL estimate (detached, 0 where not counted); with kl_coef


def cross_entropy(lp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per token: -w * lp."""
    return -w * lp


def importance_sampling(lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per token: -r * A, r = exp(lp - q)."""
    return -torch.exp(lp - q) * a


def ppo(lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Per token: -min(r * A, clip(r, lo, hi) * A), r = exp(lp - q)."""
    r = torch.exp(lp - q)
    return -torch.minimum(r * a, torch.clamp(r, lo, hi) * a)


def cispo(lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Per token: -sg(clip(r, lo, hi)) * lp * A, sg = stop-gradient, r = exp(lp - q)."""
    return -torch.clamp(torch.exp(lp - q), lo, hi).detach() * lp * a


def dro(lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor, beta: float) -> torch.Tensor:
    """Per token: -(lp * A - beta/2 * (lp - q)^2)."""
    return -(lp * a - 0.5 * beta * (lp - q) ** 2)


def gspo(lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor, in_ratio: torch.Tensor, lo: float,
         hi: float) -> torch.Tensor:
    """Per token (GSPO-token, Tinker's form): -min(s_t * A, clip(s_t, lo, hi) * A), where the sequence ratio
    s = exp(mean_{t in M}(sg(lp_t) - q_t)) over the ratio mask M, and s_t = sg(s) * exp(lp_t - sg(lp_t)): every
    token carries s's value and the gradient of its own logprob. M empty: s = 1."""
    log_ratio = torch.where(in_ratio, lp.detach() - q, torch.zeros_like(lp)).sum() / in_ratio.sum().clamp(min=1)
    ratio = torch.exp(log_ratio + lp - lp.detach())
    return -torch.minimum(ratio * a, torch.clamp(ratio, lo, hi) * a)


# stable_reinforce: pytrio's reading. Tinker documents the loss's purpose (a REINFORCE variant that stays
# stable when the sampling policy differs from the trained one, using information recorded at sampling time,
# configured by kl_coeff) but not its formula. Replace these two lines if Tinker publishes its objective.
STABLE_REINFORCE_TRUNCATION = 1.0  # the importance weight is truncated at this value (never up-weights)


def stable_reinforce(lp: torch.Tensor, mu: torch.Tensor, a: torch.Tensor, kl_coeff: float) -> torch.Tensor:
    """Per sampled token: -sg(min(r, 1)) * A * lp + kl_coeff * (r - 1 - log r), r = exp(lp - mu), mu the
    sampler's recorded logprob. REINFORCE with a truncated stop-gradient importance weight, plus the k3
    estimate of KL(sampler || learner) pulling the learner back toward the sampler (gradient kl_coeff * (r - 1))."""
    log_r = lp - mu
    r = torch.exp(log_r)
    weight = torch.clamp(r, max=STABLE_REINFORCE_TRUNCATION).detach()
    return -weight * a * lp + kl_coeff * (r - 1.0 - log_r)


def soft_cross_entropy(lp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per position, targets [N, K]: -sum_k w_k * lp_k."""
    return -(w * lp).sum(-1)


def compute_loss(
    loss_fn: str, target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float],
    ref_logprobs: torch.Tensor | None = None,
) -> LossResult:
    """Summed loss of one datum. ``config`` must come from resolve_loss_config; ``ref_logprobs`` [N] are the
    reference model's, needed with ``kl_coef``.

    token_count: mask & (w != 0) for cross_entropy (soft targets: positions with a live cell of nonzero
    weight); mask & (A != 0) for importance_sampling / ppo / cispo / gspo (& (w != 0) with weights; with kl_coef
    and weights, mask & (w != 0): the KL term trains every weighted token); mask for dro; for stable_reinforce
    the recorded (sampled) positions, when kl_coeff > 0, else those with A != 0.
    """
    if loss_fn not in DEFAULT_CONFIG:
        raise LossConfigError("loss_fn", f"unknown loss {loss_fn!r}; use one of {', '.join(LOSS_FUNCTIONS)}")
    for key in REQUIRED_INPUTS[loss_fn]:
        if key not in inputs:
            raise LossConfigError(
                f"loss_fn_inputs.{key}", f"{loss_fn} needs inputs {REQUIRED_INPUTS[loss_fn]}"
            )
    if inputs["target_tokens"].ndim == 2:
        return _soft_cross_entropy_loss(loss_fn, target_logprobs, inputs)
    mask = inputs["target_tokens"] != IGNORE_INDEX
    if mask.shape != target_logprobs.shape:
        raise ValueError(
            f"target_tokens shape {tuple(mask.shape)} != logprobs shape {tuple(target_logprobs.shape)}"
        )
    zero = torch.zeros((), dtype=target_logprobs.dtype)
    # torch.where (not multiplication) so NaN/inf at masked positions never reach loss or grads.
    lp = torch.where(mask, target_logprobs, zero)

    def given(key: str, default: float = 0.0) -> torch.Tensor:
        t = inputs.get(key)
        if t is None:
            return torch.full_like(lp, default).detach()
        return torch.where(mask, t.to(lp.dtype), zero)

    if loss_fn == "cross_entropy":
        w = given("weights", 1.0)
        per_token, counted = cross_entropy(lp, w), mask & (w != 0)
    else:
        q, a = given("logprobs"), given("advantages")
        counted = mask if loss_fn == "dro" else mask & (a != 0)
        if loss_fn == "importance_sampling":
            per_token = importance_sampling(lp, q, a)
        elif loss_fn == "gspo":
            ratio_mask = inputs.get("sequence_ratio_mask")
            in_ratio = mask & (ratio_mask != 0 if ratio_mask is not None else a != 0)
            per_token = gspo(lp, q, a, in_ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        elif loss_fn == "stable_reinforce":
            sampled = mask & (inputs["recorded_mask"] != 0)
            mu = torch.where(sampled, inputs["recorded_logprobs"].to(lp.dtype), zero)
            per_token = torch.where(sampled, stable_reinforce(torch.where(sampled, lp, zero), mu, a,
                                                              config["kl_coeff"]), zero)
            counted = sampled if config["kl_coeff"] > 0 else sampled & (a != 0)
        elif loss_fn == "dro":
            per_token = dro(lp, q, a, config["beta"])
        else:
            per_token = {"ppo": ppo, "cispo": cispo}[loss_fn](
                lp, q, a, config["clip_low_threshold"], config["clip_high_threshold"]
            )
    kl = None
    if loss_fn in policy_terms.KL_LOSSES:
        w = given("weights") if "weights" in inputs else None
        per_token, counted, kl = _weights_and_kl(per_token, counted, lp, mask, w, config, ref_logprobs)
    per_token = torch.where(mask, per_token, zero)
    return LossResult(per_token.sum(), per_token.detach(), int(counted.sum()), counted, kl)


def _weights_and_kl(per_token: torch.Tensor, counted: torch.Tensor, lp: torch.Tensor, mask: torch.Tensor,
                    w: torch.Tensor | None, config: dict, ref: torch.Tensor | None):
    """A policy loss's per-token w * (surrogate + beta * KL); returns it, the counted positions and the
    detached KL estimate. Without weights nor kl_coef the surrogate comes back untouched."""
    kl = None
    if "kl_coef" in config:
        if ref is None:
            raise ValueError("kl_coef needs the reference model's logprobs")
        if w is not None:
            counted = mask & (w != 0)
        zero = torch.zeros((), dtype=lp.dtype)
        # both sides zeroed off the counted positions (every estimator is 0 at lp == ref), so an extreme value
        # there can never reach the gradient as inf * 0
        term = policy_terms.kl_estimate(torch.where(counted, lp, zero), torch.where(counted, ref.to(lp.dtype), zero),
                                        config["kl_estimator"])
        if config["kl_coef"] > 0:
            per_token = per_token + config["kl_coef"] * term
        kl = term.detach()
    if w is not None:
        per_token = w * per_token
        counted = counted & (w != 0)
    return per_token, counted, kl


def _soft_cross_entropy_loss(loss_fn: str, target_logprobs: torch.Tensor,
                             inputs: dict[str, torch.Tensor]) -> LossResult:
    """cross_entropy with targets and weights [N, K]; a cell whose target is -100 contributes nothing."""
    if loss_fn != "cross_entropy":
        raise LossConfigError("loss_fn_inputs.target_tokens", f"{loss_fn} takes 1-D targets only")
    cells = inputs["target_tokens"] != IGNORE_INDEX
    weights = inputs.get("weights")
    if cells.shape != target_logprobs.shape or weights is None or weights.shape != cells.shape:
        raise ValueError(f"soft targets: target_tokens {tuple(cells.shape)}, logprobs "
                         f"{tuple(target_logprobs.shape)} and weights must have one shape")
    zero = torch.zeros((), dtype=target_logprobs.dtype)
    lp = torch.where(cells, target_logprobs, zero)
    w = torch.where(cells, weights.to(lp.dtype), zero)
    per_position = soft_cross_entropy(lp, w)
    counted = (cells & (w != 0)).any(-1)
    return LossResult(per_position.sum(), per_position.detach(), int(counted.sum()), counted)
