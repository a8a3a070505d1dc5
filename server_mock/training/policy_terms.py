"""Terms beside a policy loss: the KL divergence to the reference model and the policy's entropy.

GRPO as DeepSeekMath, verl and TRL teach it adds ``beta * KL(policy || reference)`` per trained token to the
surrogate, where the reference is the base model (here: the same model with the LoRA adapter disabled). The
worker hosts both, so it computes the reference log-probabilities in the same call, exactly and without
gradient, and the KL term's gradient goes into the loss. Per token, with ``lp`` the learner's and ``ref``
the reference's log-probability of the target token (``d = ref - lp``):

  k1   lp - ref                    (unbiased, high variance, can be negative)
  k2   (lp - ref)^2 / 2            (verl's ``mse``)
  k3   exp(d) - d - 1              (unbiased, >= 0, low variance: verl's ``low_var_kl``, TRL's estimator)

``loss_fn_config`` keys, accepted on top of a loss's own keys and returned by ``resolve_loss_config`` only
when given, so a request without them runs exactly as before (no reference pass, the same numbers):

  ``kl_coef``        beta >= 0, for importance_sampling / ppo / cispo. Given (even 0), the worker runs the
                     reference pass and reports the KL; beta > 0 also adds beta * KL to the loss.
  ``kl_estimator``   ``k1``, ``k2`` or ``k3`` (default k3); needs ``kl_coef``.
  ``return_entropy`` true / 1: every datum's output carries the per-token entropy of the full next-token
                     distribution (any loss; no gradient; float32).

Entropy is computed block by block of positions under no_grad, so it never holds a second [B, T, V] tensor
beside the logits.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_LOSSES = ("importance_sampling", "ppo", "cispo")
KEYS = ("kl_coef", "kl_estimator", "return_entropy")
ENTROPY_BLOCK_TOKENS = 256  # positions per block of the entropy computation: a [256, V] float32 temporary


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled token's log-probabilities."""
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * (lp - ref) ** 2
    if estimator == "k3":
        d = ref - lp
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r}")


@torch.no_grad()
def entropy(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 entropy -sum_v p log p of each position's distribution: logits [B, T, V] -> [B, T]; with ``rows``,
    row i is logits row rows[i] (shared prefix logits, computed once per prefix row)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], ENTROPY_BLOCK_TOKENS):
        block = flat[start:start + ENTROPY_BLOCK_TOKENS].float()
        logp = torch.log_softmax(block, dim=-1)
        p = logp.exp()
        out[start:start + ENTROPY_BLOCK_TOKENS] = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    out = out.reshape(logits.shape[:-1])
    return out if rows is None else out[rows]


def wants_reference(config: dict) -> bool:
    """Whether the call needs the reference log-probabilities (``kl_coef`` given)."""
    return "kl_coef" in config


def wants_entropy(config: dict) -> bool:
    return bool(config.get("return_entropy"))


def resolve(loss_fn: str, config: dict, error) -> tuple[dict, dict]:
    """Split ``config`` into the loss's own keys and the checked keys of this module; ``error(field, message)``
    builds the exception to raise (losses.LossConfigError)."""
    own = {k: v for k, v in config.items() if k not in KEYS}
    extras: dict = {}
    if "return_entropy" in config:
        value = config["return_entropy"]
        if not (isinstance(value, bool) or (isinstance(value, Real) and value in (0, 1))):
            raise error("loss_fn_config.return_entropy", f"must be true/false (or 1/0), got {value!r}")
        if value:
            extras["return_entropy"] = True
    for key in ("kl_coef", "kl_estimator"):
        if key in config and loss_fn not in KL_LOSSES:
            raise error(f"loss_fn_config.{key}", f"the KL to the reference is for {', '.join(KL_LOSSES)}, "
                                                 f"not {loss_fn}")
    if "kl_estimator" in config and "kl_coef" not in config:
        raise error("loss_fn_config.kl_estimator", "needs kl_coef too (kl_coef 0 reports the KL without adding "
                                                   "it to the loss)")
    if "kl_coef" in config:
        beta = config["kl_coef"]
        if isinstance(beta, bool) or not isinstance(beta, Real) or not math.isfinite(beta) or beta < 0:
            raise error("loss_fn_config.kl_coef", f"must be a finite number >= 0, got {beta!r}")
        estimator = config.get("kl_estimator", "k3")
        if estimator not in KL_ESTIMATORS:
            raise error("loss_fn_config.kl_estimator", f"must be one of {', '.join(KL_ESTIMATORS)}, "
                                                       f"got {estimator!r}")
        extras["kl_coef"], extras["kl_estimator"] = float(beta), estimator
    return own, extras
