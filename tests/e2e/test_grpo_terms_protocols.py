"""The KL to the reference and the entropy through a real HTTP worker: the native SDK and the official tinker SDK
both get the per-datum ``ref_logprobs`` / ``entropy`` arrays and the KL / entropy metrics (Tinker's
``name:reduction`` keys there).

The reference is the base model: a fresh adapter (LoRA B = 0) computes exactly its logprobs, so the
``ref_logprobs`` a trained run reports must equal a fresh run's ``logprobs``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import pytrio_compat as trio

pytestmark = pytest.mark.timeout(300)
PROMPT = list(range(40, 60))
COMPLETIONS = [[61, 62, 63, 64], [70, 71], [80, 81, 82]]


def policy_datums(module, kl_weights: bool = True):
    """Policy datums in the module's types (pytrio_compat or tinker), completion positions weighted 1."""
    out = []
    for i, completion in enumerate(COMPLETIONS):
        seq = PROMPT + completion
        pad, n = len(PROMPT) - 1, len(completion)
        inputs = {"target_tokens": [0] * pad + completion, "logprobs": [0.0] * pad + [-5.0] * n,
                  "advantages": [0.0] * pad + [1.0 - i] * n}
        if kl_weights:
            inputs["weights"] = [0.0] * pad + [1.0] * n
        out.append(module.Datum(model_input=module.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return out


def to_list(value) -> list[float]:
    return list(value.to_numpy()) if hasattr(value, "to_numpy") else list(value.data)


def check(outputs, metrics, base_logprobs, sum_key, mean_key, entropy_key):
    pad = len(PROMPT) - 1
    assert len(outputs) == len(COMPLETIONS)
    kl_total, count = 0.0, 0
    for out, base in zip(outputs, base_logprobs):
        ref, lp, ent = (np.asarray(to_list(out[k]), dtype=np.float64) for k in ("ref_logprobs", "logprobs", "entropy"))
        np.testing.assert_allclose(ref[pad:], base[pad:], atol=1e-5)  # the reference is the base model
        assert np.all(ent[pad:] > 0) and np.all(np.isfinite(ent))
        d = ref[pad:] - lp[pad:]
        kl_total += float(np.sum(np.exp(d) - d - 1))  # k3
        count += len(d)
    assert metrics[sum_key] == pytest.approx(kl_total, rel=1e-4, abs=1e-6)
    assert metrics[mean_key] == pytest.approx(kl_total / count, rel=1e-4, abs=1e-6)
    assert metrics[entropy_key] > 0




def test_native_sdk_gets_reference_logprobs_entropy_and_kl(service):
    datums = policy_datums(trio)
    fresh = service.create_lora_training_client("tiny", rank=4, seed=1)
    base = [np.asarray(to_list(o["logprobs"])) for o in fresh.forward(datums, "importance_sampling")
            .result().loss_fn_outputs]
    tc = service.create_lora_training_client("tiny", rank=4, seed=2)
    for _ in range(2):
        tc.forward_backward(datums, "importance_sampling").result()
        tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
    config = {"kl_coef": 0.1, "kl_estimator": "k3", "return_entropy": True}
    out = tc.forward_backward(datums, "ppo", loss_fn_config=config).result()
    check(out.loss_fn_outputs, out.metrics, base, "kl_sum", "kl_mean", "entropy_mean")
    assert out.metrics["kl_sum"] > 1e-6  # trained: off the reference
    plain = tc.forward(policy_datums(trio, kl_weights=False), "ppo").result()
    assert set(plain.loss_fn_outputs[0]) == {"logprobs", "elementwise_loss"} and "kl_sum" not in plain.metrics


def test_tinker_sdk_gets_reference_logprobs_entropy_and_kl(worker, tiny_model_dir):
    tinker = pytest.importorskip("tinker")
    from tinker import types

    warnings.simplefilter("ignore", FutureWarning)
    sc = tinker.ServiceClient(base_url=worker.base_url, api_key="tml-anything")
    try:
        datums = policy_datums(types)
        fresh = sc.create_lora_training_client("tiny", rank=4)
        base = [np.asarray(o["logprobs"].to_numpy()) for o in
                fresh.forward(datums, "importance_sampling").result(timeout=60).loss_fn_outputs]
        tc = sc.create_lora_training_client("tiny", rank=4)
        for _ in range(2):
            tc.forward_backward(datums, "importance_sampling").result(timeout=60)
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60)
        config = {"kl_coef": 0.1, "kl_estimator": "k3", "return_entropy": 1.0}
        out = tc.forward_backward(datums, "ppo", loss_fn_config=config).result(timeout=60)
        check(out.loss_fn_outputs, out.metrics, base, "kl:sum", "kl:mean", "entropy:mean")
        assert math.isfinite(out.metrics["entropy:sum"]) and "kl_sum" not in out.metrics
    finally:
        sc.close("success").result(timeout=30)
