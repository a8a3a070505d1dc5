"""Advantages and datums: group-relative advantages, right-shifted policy-loss datums, CISPO as a custom loss."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytrio_compat as trio


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO advantages of one group: each reward minus the group mean (no std scaling)."""
    mean = sum(rewards) / len(rewards)
    return [float(r) - mean for r in rewards]


def is_degenerate(rewards: Sequence[float]) -> bool:
    """True when every reward in the group is the same: all advantages are 0, nothing to learn."""
    return all(r == rewards[0] for r in rewards)


def build_datum(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    completion_logprobs: Sequence[float],
    advantage: float,
    weight: float | None = None,
) -> trio.Datum:
    """One training example for a policy loss (length P+C-1, position t predicts token t+1).

    model_input   = prompt + completion[:-1]
    target_tokens = [0]*(P-1)   + completion
    logprobs      = [0.0]*(P-1) + sampler logprobs of the completion
    advantages    = [0.0]*(P-1) + [A]*C
    weights       = [0.0]*(P-1) + [weight]*C   (only when `weight` is given: grpo_variants.py)
    """
    image_prompt = isinstance(prompt_tokens, trio.ModelInput)  # image + text (shapes.py), its images counted
    prompt = prompt_tokens if image_prompt else [int(t) for t in prompt_tokens]
    completion = [int(t) for t in completion_tokens]
    if not (prompt.chunks if image_prompt else prompt) or not completion:
        raise ValueError("build_datum needs a non-empty prompt and completion")
    if len(completion_logprobs) != len(completion):
        raise ValueError(f"{len(completion)} completion tokens but {len(completion_logprobs)} logprobs")
    pad = (prompt.length if image_prompt else len(prompt)) - 1
    inputs = {
        "target_tokens": [0] * pad + completion,
        "logprobs": [0.0] * pad + [float(x) for x in completion_logprobs],
        "advantages": [0.0] * pad + [float(advantage)] * len(completion),
    }
    if weight is not None:
        inputs["weights"] = [0.0] * pad + [float(weight)] * len(completion)
    if image_prompt:
        model_input = trio.ModelInput(chunks=[*prompt.chunks, trio.types.EncodedTextChunk(tokens=completion[:-1])])
    else:
        model_input = trio.ModelInput.from_ints(prompt + completion[:-1])
    return trio.Datum(model_input=model_input, loss_fn_inputs=inputs)


def count_train_tokens(datums: Sequence[trio.Datum]) -> int:
    """Positions that carry a learning signal (advantage != 0)."""
    return sum(sum(1 for a in d.loss_fn_inputs["advantages"].data if a != 0.0) for d in datums)


def kl_sample_train(datums: Sequence[trio.Datum], fb_output: Any) -> float | None:
    """Mean of (sampler logprob - learner logprob) over trained positions (advantage != 0).

    The learner logprobs come from `fb_output.loss_fn_outputs[i]["logprobs"]`; near 0 means the sampler and
    the trainer agree on the policy. None when there is nothing to compare.
    """
    total, count = 0.0, 0
    outputs = getattr(fb_output, "loss_fn_outputs", None) or []
    for datum, out in zip(datums, outputs):
        if "logprobs" not in out:
            return None
        learner = out["logprobs"].data
        sampler = datum.loss_fn_inputs["logprobs"].data
        for q, lp, a in zip(sampler, learner, datum.loss_fn_inputs["advantages"].data):
            if a != 0.0:
                total += float(q) - float(lp)
                count += 1
    return total / count if count else None


def _trained_ratios(datums: Sequence[trio.Datum], fb_output: Any) -> list[tuple[float, float]] | None:
    """(exp(learner - sampler logprob), advantage) at each trained position (advantage != 0), from
    `fb_output.loss_fn_outputs[i]["logprobs"]`; None when an output has no logprobs."""
    pairs = []
    outputs = getattr(fb_output, "loss_fn_outputs", None) or []
    for datum, out in zip(datums, outputs):
        if "logprobs" not in out:
            return None
        sampler = datum.loss_fn_inputs["logprobs"].data
        for q, lp, a in zip(sampler, out["logprobs"].data, datum.loss_fn_inputs["advantages"].data):
            if a != 0.0:
                pairs.append((math.exp(float(lp) - float(q)), a))
    return pairs


def ratio_clip_fraction(datums: Sequence[trio.Datum], fb_output: Any, low: float, high: float) -> float | None:
    """Share of trained positions (advantage != 0) whose ratio exp(learner - sampler logprob) lies outside
    [low, high]; None when there is nothing to compare."""
    pairs = _trained_ratios(datums, fb_output)
    return sum(r < low or r > high for r, _ in pairs) / len(pairs) if pairs else None


def ppo_clip_fraction(datums: Sequence[trio.Datum], fb_output: Any, low: float, high: float) -> float | None:
    """Share of trained positions (advantage != 0) where ppo's clipped branch binds: r > high with A > 0, or
    r < low with A < 0 (TRL's clip_ratio/region_mean), from the learner logprobs of `fb_output`."""
    pairs = _trained_ratios(datums, fb_output)
    return sum((r > high and a > 0) or (r < low and a < 0) for r, a in pairs) / len(pairs) if pairs else None


def logprob_gap_max(datums: Sequence[trio.Datum], fb_output: Any) -> float | None:
    """Largest |sampler logprob - learner logprob| over trained positions (advantage != 0); None without any."""
    gap = None
    outputs = getattr(fb_output, "loss_fn_outputs", None) or []
    for datum, out in zip(datums, outputs):
        if "logprobs" not in out:
            return None
        sampler = datum.loss_fn_inputs["logprobs"].data
        for q, lp, a in zip(sampler, out["logprobs"].data, datum.loss_fn_inputs["advantages"].data):
            if a != 0.0:
                gap = max(gap or 0.0, abs(float(q) - float(lp)))
    return gap


def make_custom_cispo_loss(clip_low: float = 0.0, clip_high: float = 4.0) -> Callable:
    """CISPO as a client-side loss for `training_client.forward_backward_custom(datums, loss_fn)`.

    loss = -sum_t sg(clip(r_t, clip_low, clip_high)) * lp_t * A_t,  r_t = exp(lp_t - q_t)
    with lp the learner logprobs (differentiable), q the sampler logprobs and A the advantages, both read
    from each datum's loss_fn_inputs. Metrics: `loss_mean` (loss / trained positions, those with A != 0, as the
    worker's built-in losses report it) and `cispo/clip_fraction`
    (share of trained positions whose ratio was clipped).
    """
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= clip_high, got {clip_low}, {clip_high}")

    def loss_fn(data: list[trio.Datum], logprobs_list: list[Any]) -> tuple[Any, dict[str, float]]:
        import torch

        if len(data) != len(logprobs_list):
            raise ValueError(f"{len(data)} datums but {len(logprobs_list)} logprob tensors")
        total = None
        trained, clipped = 0, 0
        for datum, lp in zip(data, logprobs_list):
            lp = lp.float().reshape(-1)
            q = torch.tensor(datum.loss_fn_inputs["logprobs"].data, dtype=torch.float32, device=lp.device)
            adv = torch.tensor(datum.loss_fn_inputs["advantages"].data, dtype=torch.float32, device=lp.device)
            ratio = torch.exp(lp.detach() - q)
            weight = ratio.clamp(min=clip_low, max=clip_high)
            term = -(weight * lp * adv).sum()
            total = term if total is None else total + term
            mask = adv != 0
            trained += int(mask.sum())
            clipped += int(((ratio != weight) & mask).sum())
        if total is None:
            raise ValueError("CISPO loss got no datums")
        metrics = {
            "loss_mean": float(total.detach()) / max(trained, 1),
            "cispo/clip_fraction": clipped / trained if trained else 0.0,
        }
        return total, metrics

    return loss_fn
