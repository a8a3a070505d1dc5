"""The active PEFT adapter is set only when another one is active: a run's requests, or a sampler's, in a row call
PEFT's ``set_adapter`` once; every LoRA layer still runs the adapter asked for, also after adapters are added and
deleted; the losses are those of setting it every time."""

from __future__ import annotations

import numpy as np
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from pytrio_compat.wire import LoraSpec
from server_mock.engine.local_host import LocalModelHost


def _layers_active(host: LocalModelHost) -> set[tuple[str, ...]]:
    return {tuple(m.active_adapters) for m in host.peft.modules() if isinstance(m, BaseTunerLayer)}


def _counting(host: LocalModelHost) -> list[str]:
    calls: list[str] = []
    original = host.peft.set_adapter

    def set_adapter(name, *args, **kwargs):
        calls.append(name)
        return original(name, *args, **kwargs)

    host.peft.set_adapter = set_adapter
    return calls


DATA = [{"tokens": np.arange(10, 26, dtype=np.int64), "target_tokens": np.arange(11, 27, dtype=np.int64)}]


def test_set_adapter_runs_only_when_the_active_adapter_changes(tiny_model_dir):
    host = LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.float32)
    a = host.create_adapter("run-a", LoraSpec(rank=4, seed=1))
    b = host.create_adapter("run-b", LoraSpec(rank=4, seed=2))
    calls = _counting(host)
    for _ in range(3):
        host.forward_backward(a, DATA, "cross_entropy", {}, backward=False)
    assert calls == ["run-a"]
    host.forward_backward(b, DATA, "cross_entropy", {}, backward=False)
    assert calls == ["run-a", "run-b"] and _layers_active(host) == {("run-b",)}
    snapshot = host.snapshot(a)
    host.sampling_model(snapshot)
    host.sampling_model(snapshot)
    slot = host._slot_name(snapshot)
    assert calls[2:] == [slot] and _layers_active(host) == {(slot,)}
    host.forward_backward(b, DATA, "cross_entropy", {}, backward=False)
    assert calls[3:] == ["run-b"]
    # an adapter added (or deleted) may change a layer's active adapter: the next request sets it again
    host.create_adapter("run-c", LoraSpec(rank=8, seed=3, train_attn=False))
    host.forward_backward(b, DATA, "cross_entropy", {}, backward=False)
    assert calls[4:] == ["run-b"] and _layers_active(host) == {("run-b",)}
    host.drop_adapter("run-a")
    host.forward_backward(b, DATA, "cross_entropy", {}, backward=False)
    assert calls[5:] == ["run-b"] and _layers_active(host) == {("run-b",)}


def test_losses_are_those_of_setting_the_adapter_every_time(tiny_model_dir):
    def losses(skip: bool) -> list[float]:
        host = LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.float32)
        if not skip:
            host._set_active = lambda name: host.peft.set_adapter(name)
        a = host.create_adapter("run-a", LoraSpec(rank=4, seed=1))
        b = host.create_adapter("run-b", LoraSpec(rank=4, seed=2))
        with torch.no_grad():
            for adapter in (a, b):
                for name, p in adapter.params.items():
                    if "lora_B" in name:
                        p.copy_(torch.full(p.shape, 0.01 if adapter is a else -0.02))
        out = []
        for adapter in (a, a, b, b, a):
            result = host.forward_backward(adapter, DATA, "cross_entropy", {}, backward=True)
            out.append(repr(result["metrics"]))
        out.append(float(sum(p.grad.abs().sum() for p in a.params.values() if p.grad is not None)))
        return out

    assert losses(skip=True) == losses(skip=False)
