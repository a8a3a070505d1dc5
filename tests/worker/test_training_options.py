"""Activation checkpointing changes nothing but memory; bf16 autocast stays close to float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pytrio_compat.wire import LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine.local_host import LocalModelHost


def run_step(model_dir, options: TrainOptions):
    host = LocalModelHost("tiny", str(model_dir), "cpu", torch.float32, 512, options)
    adapter = host.create_adapter("run-a", LoraSpec(rank=4, seed=3))
    generator = torch.Generator().manual_seed(0)
    for p in adapter.params.values():  # non-zero B so every LoRA weight gets a gradient
        p.data.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    rng = np.random.default_rng(0)
    data = []
    for n in (9, 17, 30):
        tokens = rng.integers(3, 500, n)
        data.append({"tokens": tokens.astype(np.int64), "target_tokens": rng.integers(3, 500, n).astype(np.int64),
                     "weights": rng.uniform(0, 1, n).astype(np.float32)})
    out = host.forward_backward(adapter, data, "cross_entropy", {}, backward=True)
    grads = {n: p.grad.clone() for n, p in adapter.params.items()}
    return out, grads


def test_checkpointing_and_micro_batching_give_the_same_gradients(tiny_model_dir):
    plain_out, plain = run_step(tiny_model_dir, TrainOptions())
    for options in (TrainOptions(activation_checkpointing=True), TrainOptions(micro_batch_tokens=20)):
        out, grads = run_step(tiny_model_dir, options)
        assert out["metrics"]["loss_sum"] == pytest.approx(plain_out["metrics"]["loss_sum"], rel=1e-5)
        worst = max(float((grads[n] - plain[n]).abs().max()) for n in plain)
        assert worst < 1e-5, (options, worst)


def test_bf16_autocast_is_close_to_float32(tiny_model_dir):
    plain_out, plain = run_step(tiny_model_dir, TrainOptions())
    out, grads = run_step(tiny_model_dir, TrainOptions(autocast_bf16=True))
    assert out["metrics"]["loss_sum"] == pytest.approx(plain_out["metrics"]["loss_sum"], rel=2e-2)
    assert out["metrics"]["loss_sum"] != plain_out["metrics"]["loss_sum"]  # it really ran in bf16
    cos = [float(torch.nn.functional.cosine_similarity(grads[n].flatten(), plain[n].flatten(), dim=0))
           for n in plain]
    assert min(cos) > 0.95
