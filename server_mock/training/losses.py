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

LOSS_FUNCTIONS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")

_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    **{name: _POLICY_INPUTS for name in LOSS_FUNCTIONS[1:]},
}
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {name: () for name in LOSS_FUNCTIONS}
OPTIONAL_INPUTS["cross_entropy"] = ("weights",)
for _name in policy_terms.KL_LOSSES:
    OPTIONAL_INPUTS[_name] = ("weights",)

# ppo bounds are ratio bounds (not epsilons). cispo defaults are Tinker's documented
# ones. Tinker documents no default beta for dro; 0.05 is the example in its docs.
DEFAULT_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
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
    if loss_fn in ("ppo", "cispo"):
        lo, hi = out["clip_low_threshold"], out["clip_high_threshold"]
        if lo < 0:
            raise LossConfigError(
                "loss_fn_config.clip_low_threshold", f"must be >= 0 (a ratio bound), got {lo}"
            )
        if hi < lo or (loss_fn == "ppo" and hi == lo):
            rel = "<" if loss_fn == "ppo" else "<="
            raise LossConfigError(
                "loss_fn_config.clip_high_threshold",
                f"need clip_low_threshold {rel} clip_high_threshold, got {lo} and {hi}",
            )
    if loss_fn == "dro" and out["beta"] < 0:
        raise LossConfigError("loss_fn_config.beta", f"must be >= 0, got {out['beta']}")
    out.update(extras)  # only the keys given: without them the call runs exactly as before
    return out


@dataclass
class LossResult:
    loss: torch.Tensor  # scalar, the summed loss, differentiable
    elementwise: torch.Tensor  # [N] per-token loss, detached, 0 at masked positions
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


def compute_loss(
    loss_fn: str, target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float],
    ref_logprobs: torch.Tensor | None = None,
) -> LossResult:
    """Summed loss of one datum. ``config`` must come from resolve_loss_config; ``ref_logprobs`` [N] are the
    reference model's, needed with ``kl_coef``.

    token_count: mask & (w != 0) for cross_entropy; mask & (A != 0) for
    importance_sampling / ppo / cispo (& (w != 0) with weights; with kl_coef and weights,
    mask & (w != 0): the KL term trains every weighted token); mask for dro.
    """
    if loss_fn not in DEFAULT_CONFIG:
        raise LossConfigError("loss_fn", f"unknown loss {loss_fn!r}; use one of {', '.join(LOSS_FUNCTIONS)}")
    for key in REQUIRED_INPUTS[loss_fn]:
        if key not in inputs:
            raise LossConfigError(
                f"loss_fn_inputs.{key}", f"{loss_fn} needs inputs {REQUIRED_INPUTS[loss_fn]}"
            )
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
