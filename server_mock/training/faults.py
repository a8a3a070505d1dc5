"""Fault injection for reliability tests: make one training request fail *inside* its torch computation.

Off unless the worker starts with ``PYTRIO_WORKER_FAULT_INJECTION=1``. Then a forward/forward_backward
request may carry ``loss_fn_config={"fault_injection": {...}}`` with:

  ``error``           ``"runtime_error"`` or ``"out_of_memory"`` (``torch.OutOfMemoryError``): raised during
                      the backward pass, once ``after_fraction`` of the adapter's gradient tensors have been
                      accumulated (so the failure leaves partly accumulated gradients behind it)
  ``after_fraction``  in [0, 1), default 0.5
  ``delay_seconds``   sleep this long on the model's thread first (a slow request), at most 60

With the switch off, ``fault_injection`` is an unknown loss_fn_config key and the request is rejected.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from server_mock.errors import bad_request

ENV_VAR = "PYTRIO_WORKER_FAULT_INJECTION"
CONFIG_KEY = "fault_injection"
ERRORS = {"runtime_error": RuntimeError, "out_of_memory": torch.OutOfMemoryError}


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def split_config(config: dict[str, Any], enabled: bool, backward: bool) -> tuple[dict[str, Any], dict | None]:
    """The loss config without the fault key, and the validated fault (None when there is none)."""
    if not enabled or CONFIG_KEY not in config:
        return config, None
    field = f"loss_fn_config.{CONFIG_KEY}"
    fault = config[CONFIG_KEY]
    if not isinstance(fault, dict) or set(fault) - {"error", "after_fraction", "delay_seconds"}:
        raise bad_request(field, "must be an object with keys error, after_fraction, delay_seconds")
    error = fault.get("error")
    if error is not None and error not in ERRORS:
        raise bad_request(f"{field}.error", f"must be one of {', '.join(ERRORS)}, got {error!r}")
    if error is not None and not backward:
        raise bad_request(f"{field}.error", "errors are injected during the backward pass: use forward_backward")
    fraction, delay = fault.get("after_fraction", 0.5), fault.get("delay_seconds", 0.0)
    if not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise bad_request(f"{field}.after_fraction", f"must be in [0, 1), got {fraction!r}")
    if not isinstance(delay, (int, float)) or not math.isfinite(delay) or not 0 <= delay <= 60:
        raise bad_request(f"{field}.delay_seconds", f"must be in [0, 60], got {delay!r}")
    rest = {k: v for k, v in config.items() if k != CONFIG_KEY}
    return rest, {"error": error, "after_fraction": float(fraction), "delay_seconds": float(delay)}


@contextlib.contextmanager
def injected(fault: dict | None, params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Apply ``fault`` to the torch work run inside this block (on the model's thread)."""
    if fault is None:
        yield
        return
    if fault["delay_seconds"]:
        time.sleep(fault["delay_seconds"])
    handles = []
    if fault["error"] is not None and params:
        error_type = ERRORS[fault["error"]]
        threshold = min(len(params) - 1, int(len(params) * fault["after_fraction"]))
        accumulated = [0]

        def count(_param: torch.Tensor) -> None:
            accumulated[0] += 1

        def fail(grad: torch.Tensor) -> None:
            # runs before this tensor's gradient is accumulated; the ones counted above already were
            if accumulated[0] >= threshold:
                raise error_type(f"injected {fault['error']} during backward, after {accumulated[0]} of "
                                 f"{len(params)} adapter gradients were accumulated")

        for param in params:
            param.requires_grad_(True)  # as forward_backward's adapter activation does
            handles.append(param.register_post_accumulate_grad_hook(count))
            handles.append(param.register_hook(fail))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
