"""AdamW for a LoRA adapter: the update step, and its state (moments, step counts) saved and loaded in a
layout independent of the adapter's name."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from pytrio_compat.wire import AdamParams
from server_mock.errors import WorkerError, bad_request

if TYPE_CHECKING:
    from server_mock.lora import Adapter


def optim_step(adapter: Adapter, adam: AdamParams) -> dict[str, float]:
    """AdamW, the same update as ``torch.optim.AdamW`` (decoupled decay), then gradients reset.

    As in torch, a parameter without a gradient is skipped: no decay, no moment update, and its own
    step count (which drives the bias correction) does not advance."""
    grads = {n: p.grad for n, p in adapter.params.items() if p.grad is not None}
    if grads:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))
        grad_norm = float(norm)
    else:
        grad_norm = 0.0
    if not math.isfinite(grad_norm):
        raise WorkerError(422, "non_finite_gradient", "the accumulated gradient is not finite; nothing applied")
    scale = 1.0
    if adam.grad_clip_norm > 0 and grad_norm > adam.grad_clip_norm:
        scale = adam.grad_clip_norm / (grad_norm + 1e-6)
    adapter.optim_steps += 1
    lr, b1, b2, eps, wd = adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay
    with torch.no_grad():
        for name, grad in grads.items():
            param = adapter.params[name]
            if scale != 1.0:
                grad = grad * scale
            step = adapter.param_steps.get(name, 0) + 1
            adapter.param_steps[name] = step
            m, v = adapter.exp_avg[name], adapter.exp_avg_sq[name]
            if wd:
                param.mul_(1 - lr * wd)
            m.lerp_(grad, 1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
            param.addcdiv_(m, denom, value=-lr / (1 - b1**step))
            param.grad = None
    adapter.version += 1
    return {"grad_norm": grad_norm, "learning_rate": lr, "step": float(adapter.optim_steps)}


def optimizer_state(adapter: Adapter) -> dict[str, torch.Tensor]:
    """Adam moments and per-parameter step counts keyed by adapter-independent names, so a checkpoint
    resumes into any new run."""
    state = {}
    for name in adapter.params:
        key = _portable(name, adapter.adapter_id)
        state[f"exp_avg::{key}"] = adapter.exp_avg[name]
        state[f"exp_avg_sq::{key}"] = adapter.exp_avg_sq[name]
        state[f"step::{key}"] = torch.tensor([adapter.param_steps.get(name, 0)], dtype=torch.int64)
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
    optim_steps = int(state["optim_steps"][0]) if state is not None else 0
    for name, param in adapter.params.items():
        key = keys[name]
        if state is None:
            adapter.exp_avg[name] = torch.zeros_like(param, dtype=torch.float32)
            adapter.exp_avg_sq[name] = torch.zeros_like(param, dtype=torch.float32)
            adapter.param_steps.pop(name, None)
        else:
            adapter.exp_avg[name] = state[f"exp_avg::{key}"].to(device, torch.float32).clone()
            adapter.exp_avg_sq[name] = state[f"exp_avg_sq::{key}"].to(device, torch.float32).clone()
            step = state.get(f"step::{key}")
            adapter.param_steps[name] = int(step[0]) if step is not None else optim_steps
    adapter.optim_steps = optim_steps


def _portable(param_name: str, adapter_id: str) -> str:
    return param_name.replace(f".{adapter_id}.", ".")
