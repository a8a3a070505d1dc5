"""forward_backward_custom through the SDK against two real workers, one sharing GRPO prompts and one not:
the logprobs the client sees, the metrics, grad_norm and the saved weights after a step all agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import pytrio_compat as trio

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def two_workers(tiny_model_dir, tmp_path_factory):
    from support import WorkerProcess

    procs = []
    for name, share in (("shared", "16"), ("plain", "0")):
        root = tmp_path_factory.mktemp(name)
        procs.append(WorkerProcess(tiny_model_dir, root / "storage", "--prefix-share-min-tokens", share,
                                   "--log-level", "INFO").start())
    yield procs
    for proc in procs:
        proc.stop()


def grpo_data(seed: int = 0) -> list[trio.Datum]:
    """Two prompts x 4 completions; prompt tokens are trained too (weights/advantages non-zero there)."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(2):
        prompt = rng.integers(3, 500, 24).tolist()
        for _ in range(4):
            full = prompt + rng.integers(3, 500, int(rng.integers(2, 10))).tolist()
            data.append(trio.Datum(model_input=trio.ModelInput.from_ints(full[:-1]),
                                   loss_fn_inputs={"target_tokens": full[1:],
                                                   "advantages": rng.normal(0, 1, len(full) - 1).tolist()}))
    return data


def squared_advantage_loss(data, logprobs):
    """A non-linear loss of the logprobs: sum of A * lp + 0.1 * lp^2 (its gradient differs per token)."""
    total = sum((torch.tensor(d.loss_fn_inputs["advantages"].to_numpy()) * lp + 0.1 * lp**2).sum()
                for d, lp in zip(data, logprobs))
    return total, {"custom": float(total.detach())}


def run(worker, data):
    service = trio.ServiceClient(base_url=worker.base_url)
    try:
        tc = service.create_lora_training_client("tiny", rank=4, seed=11, train_unembed=True)
        out = tc.forward_backward_custom(data, squared_advantage_loss).result()
        step = tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("after").result().path
        after = tc.forward(data, "cross_entropy").result()
    finally:
        service.close()
    run_id, kind, name = path[len("trio://"):].split("/")
    folder = worker.storage / "checkpoints" / run_id / kind / name
    return out, step, load_file(str(folder / "adapter_model.safetensors")), after


def test_custom_loss_through_shared_prefixes_matches(two_workers):
    shared_worker, plain_worker = two_workers
    data = grpo_data()
    shared, plain = run(shared_worker, data), run(plain_worker, data)
    log = (shared_worker.storage.parent / "worker.log").read_text()  # the model loads on first use
    assert "runs prefixes shared by >= 16 tokens once" in log
    assert "runs prefixes shared" not in (plain_worker.storage.parent / "worker.log").read_text()
    (out_s, step_s, weights_s, after_s), (out_p, step_p, weights_p, after_p) = shared, plain
    assert out_s.metrics["custom"] == pytest.approx(out_p.metrics["custom"], rel=1e-5)
    assert out_s.metrics["loss:sum"] == pytest.approx(out_p.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert step_s.metrics["grad_norm"] == pytest.approx(step_p.metrics["grad_norm"], rel=1e-5)
    assert set(weights_s) == set(weights_p)
    assert max(float((weights_s[k] - weights_p[k]).abs().max()) for k in weights_p) <= 1e-5
    for a, b in zip(after_s.loss_fn_outputs, after_p.loss_fn_outputs):  # the next forward after the step
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    # the step moved the weights: the comparison above is not of two untouched adapters
    assert step_s.metrics["grad_norm"] > 0
