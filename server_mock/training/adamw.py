"""AdamW for a LoRA adapter: ``torch.optim.AdamW`` (one per adapter; its hyper-parameters are set per call, as
Tinker's ``optim_step`` takes them), global-norm clipping with ``torch.nn.utils``, and the optimizer's state
saved and loaded under names independent of the adapter's, so a checkpoint resumes into any new run.

What is ours: refusing a non-finite gradient, or a step that would make weights non-finite or too large for the
forward pass, before anything changes, ``grad_norm`` reported before clipping,
and the portable state names (``exp_avg::<param>``, ``exp_avg_sq::<param>``, ``step::<param>``, ``optim_steps``).
As in torch, a parameter without a gradient is skipped: no decay, no moment update, and its own step count
(which drives the bias correction) does not advance.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from pytrio_compat.wire import AdamParams
from server_mock.errors import WorkerError, bad_request

if TYPE_CHECKING:
    from server_mock.lora import Adapter


def new_optimizer(params: list[nn.Parameter]) -> torch.optim.AdamW:
    """The adapter's optimizer (hyper-parameters come with each step). ``foreach`` is torch's default: the
    per-parameter loop on CPU, the multi-tensor kernels on CUDA."""
    return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)


def optim_step(adapter: Adapter, adam: AdamParams) -> dict[str, float]:
    """One AdamW step with ``adam``'s hyper-parameters, then gradients reset; ``grad_norm`` is the global norm
    of the accumulated gradient before clipping."""
    grads = [p.grad for p in adapter.params.values() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    grad_norm = float(norm)
    if not math.isfinite(grad_norm):
        raise WorkerError(422, "non_finite_gradient", "the accumulated gradient is not finite; nothing applied")
    with_grad = [p for p in adapter.params.values() if p.grad is not None]
    blown = _first_non_finite(adapter, adam, norm)
    if blown is not None:
        raise WorkerError(422, "non_finite_update", f"adam_params.learning_rate: this step would make weights "
                                                    f"non-finite or larger than {MAX_WEIGHT:g}, which the forward "
                                                    f"pass overflows on (first {blown}); nothing applied: use a "
                                                    "smaller learning_rate or weight_decay",
                          "adam_params.learning_rate")
    if adam.grad_clip_norm > 0 and with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, adam.grad_clip_norm, norm)
    optimizer = adapter.optimizer
    for group in optimizer.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    adapter.optim_steps += 1
    adapter.version += 1
    return {"grad_norm": grad_norm, "learning_rate": adam.learning_rate, "step": float(adapter.optim_steps)}


# The largest weight a step may leave: a LoRA's output multiplies two of its weights (B A x), and float32
# overflows at 3.4e38, so weights much past 1e16 make logits infinite (real LoRA weights are O(1)).
MAX_WEIGHT = 1e16


def _first_non_finite(adapter: Adapter, adam: AdamParams, norm: torch.Tensor) -> str | None:
    """The first parameter (by name) that this step would make non-finite or larger than ``MAX_WEIGHT``, or None;
    nothing is changed.

    AdamW moves a weight ``p`` to ``p (1 - lr wd) - lr / (1 - b1^t) * m' / (sqrt(v') / sqrt(1 - b2^t) + eps)``.
    Since the denominator is at least ``eps``, ``|p| |1 - lr wd| + lr / (1 - b1^t) * max|m'| / eps`` bounds the
    result, and ``max|m'| <= b1 max|m| + (1 - b1) max|g|``: three maxima per parameter, no copies. Only a
    parameter whose bound passes ``MAX_WEIGHT`` is stepped for real, on a copy of it and its state, by
    ``torch.optim.AdamW`` itself (so the verdict is the optimizer's own arithmetic)."""
    scale = 1.0
    if adam.grad_clip_norm > 0:
        scale = min(1.0, adam.grad_clip_norm / (float(norm) + 1e-6))
    state = adapter.optimizer.state
    for name, param in adapter.params.items():
        if param.grad is None:
            continue
        entry = state.get(param, {})
        step = int(entry["step"]) + 1 if "step" in entry else 1
        moment = _max_abs(entry["exp_avg"]) if "exp_avg" in entry else 0.0
        m_next = adam.beta1 * moment + (1 - adam.beta1) * _max_abs(param.grad) * scale
        try:
            bound = (_max_abs(param) * abs(1 - adam.learning_rate * adam.weight_decay)
                     + adam.learning_rate / (1 - adam.beta1 ** step) * m_next / adam.eps)
        except (OverflowError, ZeroDivisionError):
            bound = math.inf
        if bound <= MAX_WEIGHT:
            continue
        if not _stays_finite(param, entry, adam, norm):
            return name
    return None


def _max_abs(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor.detach(), ord=math.inf)) if tensor.numel() else 0.0


def _stays_finite(param: nn.Parameter, entry: dict, adam: AdamParams, norm: torch.Tensor) -> bool:
    """Whether one AdamW step of a copy of ``param`` (its gradient clipped as the real step clips it) and of its
    state leaves every weight finite and within ``MAX_WEIGHT``."""
    copy = nn.Parameter(param.detach().clone())
    copy.grad = param.grad.detach().clone()
    if adam.grad_clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([copy], adam.grad_clip_norm, norm)
    trial = torch.optim.AdamW([copy], lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                              weight_decay=adam.weight_decay)
    if entry:
        trial.state[copy] = {key: value.clone() for key, value in entry.items()}
    trial.step()
    return bool(torch.isfinite(copy).all()) and _max_abs(copy) <= MAX_WEIGHT


def optimizer_state(adapter: Adapter) -> dict[str, torch.Tensor]:
    """Adam moments and per-parameter step counts keyed by adapter-independent names (zeros and 0 for a
    parameter that never had a gradient)."""
    state = {}
    for name, param in adapter.params.items():
        key = _portable(name, adapter.adapter_id)
        entry = adapter.optimizer.state.get(param, {})
        state[f"exp_avg::{key}"] = entry.get("exp_avg", torch.zeros_like(param, dtype=torch.float32))
        state[f"exp_avg_sq::{key}"] = entry.get("exp_avg_sq", torch.zeros_like(param, dtype=torch.float32))
        state[f"step::{key}"] = torch.tensor([int(entry["step"]) if "step" in entry else 0], dtype=torch.int64)
    state["optim_steps"] = torch.tensor([adapter.optim_steps], dtype=torch.int64)
    return state


def load_optimizer_state(adapter: Adapter, state: dict[str, torch.Tensor] | None, device: str) -> None:
    """Restore Adam moments (onto ``device``) and step counts; ``None`` resets them (a fresh optimizer).
    Checkpoints from before per-parameter step counts give every parameter the adapter's step count."""
    keys = {name: _portable(name, adapter.adapter_id) for name in adapter.params}
    if state is not None:
        moments = {f"{kind}::{key}" for key in keys.values() for kind in ("exp_avg", "exp_avg_sq")}
        steps = {f"step::{key}" for key in keys.values()}
        if set(state) not in (moments | steps | {"optim_steps"}, moments | {"optim_steps"}):
            raise bad_request("path", "the checkpoint's optimizer state does not match this adapter's layout",
                              code="checkpoint_mismatch")
    optimizer = adapter.optimizer
    optimizer.state.clear()
    optim_steps = int(state["optim_steps"][0]) if state is not None else 0
    if state is not None:
        for name, param in adapter.params.items():
            key = keys[name]
            step = state.get(f"step::{key}")
            optimizer.state[param] = {
                # torch keeps the step as a float32 scalar tensor (on the CPU unless capturable or fused)
                "step": torch.tensor(float(int(step[0]) if step is not None else optim_steps)),
                "exp_avg": state[f"exp_avg::{key}"].to(device, torch.float32).clone(),
                "exp_avg_sq": state[f"exp_avg_sq::{key}"].to(device, torch.float32).clone(),
            }
    adapter.optim_steps = optim_steps


def _portable(param_name: str, adapter_id: str) -> str:
    return param_name.replace(f".{adapter_id}.", ".")
