"""Forward/backward over one call's datums: micro-batches within the token budget (prefix-shared or not), each
target token's logprob, and the per-datum losses and the call's metrics.

With ``kl_coef`` in the config a reference pass runs first, over the same plan (shared prompts once), with the
adapter disabled and no gradient; it keeps only each datum's target logprobs, so the training pass after it never
holds a second set of logits. ``return_entropy`` adds each position's entropy, from the training pass's own
logits (policy_terms.entropy). Without either key the call runs exactly as it did before they existed."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from server_mock.errors import WorkerError
from server_mock.training import losses, policy_terms, prefix_planning, prefix_sharing


@dataclass(frozen=True)
class TrainModel:
    """What forward/backward needs of the model it trains: the adapted model's logits and a few facts."""

    logits: Callable[..., torch.Tensor]  # logits(**inputs) of the model with the adapter, under the host's settings
    config: Any  # the model's transformers config (the prefix caches read its layer types)
    cache_kwarg: str | None  # the forward's name for its cache argument (prefix_cache.cache_kwarg)
    device: str
    micro_batch_tokens: int
    prefix_share_min_tokens: int  # 0: this model does not share prefixes
    reference_logits: Callable[..., torch.Tensor] | None = None  # the same with the adapter disabled (the base)
    # an image-text model's image processing (engine.vision.ImageProcessing): needed by datums with images
    vision: Any = None
    # engine.vision.batch_image_inputs: the image kwargs of one forward pass
    image_inputs: Callable[..., dict[str, Any]] | None = None


def run_forward_backward(model: TrainModel, data: list[dict[str, np.ndarray]], loss_fn: str,
                         config: dict[str, float], backward: bool, loss_scale: float = 1.0) -> dict:
    """Per-datum logprobs and losses of ``data`` with the model's active adapter; with ``backward`` the gradient of
    the summed loss times ``loss_scale`` accumulates (1: the sum itself; a front end whose protocol reduces by a
    mean over a call it may split passes 1/denominator). The losses and metrics are never scaled. Datums sharing a
    prompt prefix run it once (prefix_sharing.py); a call with images runs every datum in full (the shared path
    carries no image inputs, and equal placeholder tokens may stand for different images)."""
    steps = forward_backward_steps(model, data, loss_fn, config, backward, loss_scale)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def forward_backward_steps(model: TrainModel, data: list[dict[str, np.ndarray]], loss_fn: str,
                           config: dict[str, float], backward: bool,
                           loss_scale: float = 1.0) -> Generator[int, None, dict]:
    """``run_forward_backward`` in parts, for a caller that runs other work between them (the model queue's
    slices): it yields after each part (a micro-batch, or a shared prompt with its rows, whose backward is done)
    the datum tokens that part trained (0 for a part of the reference pass) and returns the result. The same
    computations run in the same order as in one go, and no autograd graph or grad mode is held across a yield,
    so the result and the gradients are the same to the bit, whatever runs in between on other adapters; the
    caller makes this adapter the active one again before resuming."""
    share = 0 if any("images" in d for d in data) else model.prefix_share_min_tokens
    passes = prefix_planning.plan([d["tokens"] for d in data], model.micro_batch_tokens, share)
    reference = (yield from _reference_logprobs(model, data, passes)) if policy_terms.wants_reference(config) \
        else None
    entropy = policy_terms.wants_entropy(config)
    results = _Results(data, loss_fn, config, model.device, reference, loss_scale)
    for batch, chunks in passes.shared:
        with torch.set_grad_enabled(backward):
            shared = _shared_prefix(model, data, batch)
            for chunk in chunks:
                indices = [i for i, _ in chunk]
                which = torch.tensor([row for _, row in chunk], device=model.device)
                results.add(indices, *_shared_logprobs(model, shared, [data[i] for i in indices], which, entropy),
                            backward)
            if backward:
                shared.backward()
            del shared
        yield sum(len(data[i]["tokens"]) for chunk in chunks for i, _ in chunk)
    for batch in passes.rest:
        with torch.set_grad_enabled(backward):
            results.add(batch, *_target_logprobs(model, [data[i] for i in batch], entropy), backward)
        yield sum(len(data[i]["tokens"]) for i in batch)
    return results.summary()


def _reference_logprobs(model: TrainModel, data: list[dict[str, np.ndarray]],
                        passes: prefix_planning.Plan) -> Generator[int, None, list[torch.Tensor]]:
    """Each datum's target logprobs [n] under the reference model (the adapter disabled), without gradient, over
    the training pass's plan: each shared prompt runs once here too. Yields 0 after each part (nothing trained)."""
    if model.reference_logits is None:
        raise WorkerError(422, "reference_unavailable", "loss_fn_config.kl_coef: this model host cannot run the "
                                                        "reference model", "loss_fn_config.kl_coef")
    ref = replace(model, logits=model.reference_logits)
    out: list[torch.Tensor] = [torch.empty(0)] * len(data)

    def keep(indices: list[int], logprobs: torch.Tensor) -> None:
        for row, index in enumerate(indices):
            datum = data[index]
            out[index] = _datum_logprobs(logprobs[row, :len(datum["tokens"])], datum["target_tokens"]).clone()

    for batch, chunks in passes.shared:
        with torch.no_grad():
            shared = _shared_prefix(ref, data, batch)
            for chunk in chunks:
                indices = [i for i, _ in chunk]
                which = torch.tensor([row for _, row in chunk], device=model.device)
                keep(indices, _shared_logprobs(ref, shared, [data[i] for i in indices], which, False)[0])
            del shared
        yield 0
    for batch in passes.rest:
        with torch.no_grad():
            keep(batch, _target_logprobs(ref, [data[i] for i in batch], False)[0])
        yield 0
    return out


def _shared_prefix(model: TrainModel, data: list[dict[str, np.ndarray]],
                   batch: prefix_planning.PrefixBatch) -> prefix_sharing.SharedPrefix:
    prompts = np.stack([data[g.members[0]]["tokens"][:batch.prefix_len] for g in batch.groups])
    return prefix_sharing.SharedPrefix(model.logits, model.config, model.cache_kwarg,
                                       torch.from_numpy(prompts).to(model.device))


def _target_logprobs(model: TrainModel, rows: list[dict[str, np.ndarray]],
                     entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logprob of each target token, [B, T] (0 where the target is ignored or padding; [B, T, K] when a row
    has soft targets, ``_padded_targets``), and with ``entropy`` each position's entropy [B, T]."""
    ids, attention = _padded([r["tokens"] for r in rows], model.device)
    targets = _padded_targets([_targets(r) for r in rows], model.device)
    extra = {}
    if any("images" in r for r in rows):
        if model.image_inputs is None:
            raise WorkerError(400, "unsupported_input", "data: image inputs need a vision-language model", "data")
        extra = model.image_inputs(model.vision, ids, [r.get("images", ()) for r in rows], attention)
    logits = model.logits(input_ids=ids, attention_mask=attention, use_cache=False, **extra)
    return token_logprobs(logits, targets), policy_terms.entropy(logits) if entropy else None


def _shared_logprobs(model: TrainModel, shared: prefix_sharing.SharedPrefix, rows: list[dict[str, np.ndarray]],
                     which: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like ``_target_logprobs``, for rows that start with ``shared``'s prefixes (row i with prefix which[i])."""
    n = shared.prefix_len
    ids, attention = _padded([r["tokens"][n:] for r in rows], model.device)
    targets = _padded_targets([_targets(r)[n:] for r in rows], model.device)
    prefix_targets = _padded_targets([_targets(r)[:n] for r in rows], model.device, targets.shape[2:])
    logits = shared.remainder_logits(ids, attention, which)
    logprobs = torch.cat([token_logprobs(shared.logits, prefix_targets, which),
                          token_logprobs(logits, targets)], dim=1)
    if not entropy:
        return logprobs, None
    return logprobs, torch.cat([policy_terms.entropy(shared.logits, which), policy_terms.entropy(logits)], dim=1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 log-probability of each target token: logits [B, T, V], targets [B, T] -> [B, T] (or soft targets
    [B, T, K] -> [B, T, K]). With ``rows``, target row i reads logits row rows[i] (prefix logits shared by several
    datums, never copied per datum). No second (B, T, V) tensor in the forward pass."""
    logits = logits.float()
    norm = torch.logsumexp(logits, dim=-1)
    if targets.ndim == 3:
        return _soft_token_logprobs(logits, norm, targets, rows)
    if rows is None:
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    positions = torch.arange(targets.shape[1], device=targets.device)
    return logits[rows[:, None], positions[None, :], targets] - norm[rows]


def _soft_token_logprobs(logits: torch.Tensor, norm: torch.Tensor, targets: torch.Tensor,
                         rows: torch.Tensor | None) -> torch.Tensor:
    """``token_logprobs`` for K targets per position: [B, T, K]."""
    if rows is None:
        return logits.gather(-1, targets) - norm[..., None]
    positions = torch.arange(targets.shape[1], device=targets.device)
    return logits[rows[:, None, None], positions[None, :, None], targets] - norm[rows][..., None]


def _padded_targets(rows: list[np.ndarray], device: str, trailing: tuple = ()) -> torch.Tensor:
    """Right-padded targets: [B, T] when every row is 1-D (and ``trailing`` is empty), else [B, T, K] with K the
    widest row (``trailing`` forces it), a 1-D row in column 0; padding points at token 0 (masked by the loss)."""
    width = max([r.shape[1] for r in rows if r.ndim == 2] + list(trailing), default=0)
    if not width:
        return _padded(rows, device)[0]
    longest = max(len(r) for r in rows)
    out = torch.zeros((len(rows), longest, width), dtype=torch.long)
    for i, r in enumerate(rows):
        cells = torch.from_numpy(np.asarray(r, dtype=np.int64))
        if r.ndim == 1:
            out[i, :len(r), 0] = cells
        else:
            out[i, :len(r), :r.shape[1]] = cells
    return out.to(device)


def _targets(datum: dict[str, np.ndarray]) -> np.ndarray:
    """The datum's target tokens with ignored positions (-100) pointing at token 0 (masked by the loss)."""
    t = datum["target_tokens"]
    return np.where(t == losses.IGNORE_INDEX, 0, t).astype(np.int64)


def _padded(rows: list[np.ndarray], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token rows [B, T] and their attention mask."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.long)
    attention = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        attention[i, :len(r)] = 1
    return ids.to(device), attention.to(device)


def _datum_logprobs(logprobs: torch.Tensor, targets: np.ndarray) -> torch.Tensor:
    """One datum's rows of a micro-batch's logprobs ([n] or [n, K_max]) in its targets' shape ([n] or [n, K])."""
    if logprobs.ndim == 1:
        return logprobs
    return logprobs[:, 0] if targets.ndim == 1 else logprobs[:, :targets.shape[1]]


class _Results:
    """Per-datum losses, logprobs and the call's metrics, filled one micro-batch at a time."""

    def __init__(self, data: list[dict[str, np.ndarray]], loss_fn: str, config: dict[str, float], device: str,
                 reference: list[torch.Tensor] | None = None, loss_scale: float = 1.0):
        self.data, self.loss_fn, self.config, self.device = data, loss_fn, config, device
        self.reference = reference
        self.loss_scale = loss_scale
        self.outputs: list[dict[str, np.ndarray] | None] = [None] * len(data)
        self.loss_sum = 0.0
        self.token_count = 0
        self.sums: dict[str, float] = {}  # kl, entropy: summed over the counted positions
        if reference is not None:
            self.sums["kl"] = 0.0
        if policy_terms.wants_entropy(config):
            self.sums["entropy"] = 0.0

    def add(self, indices: list[int], logprobs: torch.Tensor, entropy: torch.Tensor | None, backward: bool) -> None:
        """Losses of the datums ``indices`` (row i of ``logprobs`` is datum indices[i]); backward of their sum."""
        total = None
        for row, index in enumerate(indices):
            datum = self.data[index]
            n = len(datum["tokens"])
            inputs = {k: torch.from_numpy(v).to(self.device) for k, v in datum.items() if k not in ("tokens", "images")}
            row_lp = _datum_logprobs(logprobs[row, :n], datum["target_tokens"])
            ref = self.reference[index] if self.reference is not None else None
            result = losses.compute_loss(self.loss_fn, row_lp, inputs, self.config, ref)
            if not torch.isfinite(result.loss):
                raise WorkerError(422, "non_finite_loss",
                                  f"data[{index}]: the loss is not finite; check logprobs/advantages", "data")
            total = result.loss if total is None else total + result.loss
            self.loss_sum += float(result.loss.detach())
            self.token_count += result.token_count
            mask = inputs["target_tokens"] != losses.IGNORE_INDEX
            lp = torch.where(mask, row_lp.detach(), torch.zeros_like(row_lp))
            self.outputs[index] = {"logprobs": lp.float().cpu().numpy(),
                                   "elementwise_loss": result.elementwise.float().cpu().numpy()}
            if ref is not None or entropy is not None:
                self._extras(index, mask, result, ref, entropy[row, :n] if entropy is not None else None)
        if backward and total is not None and total.requires_grad:
            (total if self.loss_scale == 1.0 else total * self.loss_scale).backward()

    def _extras(self, index: int, mask: torch.Tensor, result: losses.LossResult, ref: torch.Tensor | None,
                entropy: torch.Tensor | None) -> None:
        """The datum's ``ref_logprobs`` / ``entropy`` outputs (0 where the target is ignored), and their sums
        over the counted positions."""
        zero = torch.zeros((), dtype=torch.float32)
        if mask.ndim == 2:  # soft targets: a position counts when any of its cells does
            mask = mask.any(-1)
        if ref is not None:
            self.outputs[index]["ref_logprobs"] = torch.where(mask, ref.float(), zero).cpu().numpy()
            if result.kl is not None:
                self.sums["kl"] += float(result.kl.double().sum())
        if entropy is not None:
            self.outputs[index]["entropy"] = torch.where(mask, entropy.float(), zero).cpu().numpy()
            counted = result.counted if result.counted is not None else mask
            self.sums["entropy"] += float(torch.where(counted, entropy.float(), zero).double().sum())

    def summary(self) -> dict:
        return {"outputs": self.outputs, "metrics": call_metrics(self.loss_sum, self.token_count, self.sums)}


def call_metrics(loss_sum: float, token_count: float, sums: dict[str, float] | None = None) -> dict[str, float]:
    """A call's metrics from its sums (also how the data-parallel shards' results merge): the loss, and with
    kl_coef / return_entropy ``kl_sum``/``kl_mean`` / ``entropy_sum``/``entropy_mean`` over the counted positions,
    each also as Tinker's ``name:sum`` / ``name:mean``."""
    metrics = {
        "loss_sum": loss_sum,
        "loss_mean": loss_sum / token_count if token_count else 0.0,
        "token_count": float(token_count),
        "loss:sum": loss_sum,
    }
    for name, total in (sums or {}).items():
        mean = total / token_count if token_count else 0.0
        metrics.update({f"{name}_sum": total, f"{name}_mean": mean, f"{name}:sum": total, f"{name}:mean": mean})
    return metrics
