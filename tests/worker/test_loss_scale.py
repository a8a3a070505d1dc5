"""``loss_scale`` of a forward/backward op: the accumulated gradient is that of the summed loss times the scale (on
the plain and the prefix-shared path), the losses and metrics are unscaled, and scale 1 is exactly the sum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pytrio_compat.wire import LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine.local_host import LocalModelHost


NAMES = itertools.count()


@pytest.fixture(scope="module")
def host(tiny_model_dir):
    return LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.float32, 512, TrainOptions())


def _data(shared_prefix: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 40)  # >= 32 shared leading tokens: the datums run their prompt once
    data = []
    for n in (9, 17, 30):
        tokens = np.concatenate([prompt, rng.integers(3, 500, n)]) if shared_prefix else rng.integers(3, 500, n)
        data.append({"tokens": tokens.astype(np.int64),
                     "target_tokens": rng.integers(3, 500, len(tokens)).astype(np.int64),
                     "logprobs": -rng.uniform(0.5, 3, len(tokens)).astype(np.float32),
                     "advantages": rng.normal(0, 1, len(tokens)).astype(np.float32)})
    return data


def _step(host, data, loss_fn: str, **scale) -> tuple[dict, dict]:
    name = f"run-scale-{next(NAMES)}"  # PEFT keeps its last adapter around: a new name each time
    adapter = host.create_adapter(name, LoraSpec(rank=4, seed=3))
    try:
        generator = torch.Generator().manual_seed(0)
        for p in adapter.params.values():  # non-zero B: every LoRA weight gets a gradient
            p.data.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        out = host.forward_backward(adapter, data, loss_fn, {"beta": 0.05} if loss_fn == "dro" else {}, True, **scale)
        return out, {n.replace(f".{name}.", "."): p.grad.clone() for n, p in adapter.params.items()}
    finally:
        host.drop_adapter(name)


@pytest.mark.parametrize("loss_fn,shared_prefix", [("importance_sampling", False), ("dro", True)])
def test_gradient_is_scaled_and_metrics_are_not(host, loss_fn, shared_prefix):
    data = _data(shared_prefix)
    plain_out, plain = _step(host, data, loss_fn)
    one_out, one = _step(host, data, loss_fn, loss_scale=1.0)
    assert all(torch.equal(one[n], plain[n]) for n in plain)  # scale 1 is the sum, bit for bit
    scaled_out, scaled = _step(host, data, loss_fn, loss_scale=1 / 56)
    assert scaled_out["metrics"] == plain_out["metrics"] == one_out["metrics"]
    for a, b in zip(scaled_out["outputs"], plain_out["outputs"]):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
    for name in plain:  # float32 sums in another order: within 1e-5 of the tensor's scale
        expected = plain[name] / 56
        torch.testing.assert_close(scaled[name], expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert max(float(g.abs().max()) for g in plain.values()) > 0
