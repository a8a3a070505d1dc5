"""The worker on a local Ray cluster, through the public SDK: 2 sampler replicas, one trainer group of 2
data-parallel ranks. The numbers must be those of the in-process worker (``worker`` fixture) and of the
independent reference in tests/e2e/test_training_numerics.py. Killed actors: test_ray_faults.py (slow).
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import REPO, moved_state

import pytrio_compat as trio

from .ray_helpers import E2E, named_actors, running_ray_worker, trainer_runs

ray = pytest.importorskip("ray", reason="the cluster extra (pip install -e .[cluster]) is not installed")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ray_worker(ray_address, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-worker")
    with running_ray_worker(ray_address, tiny_model_dir, root, trainer_groups=1) as proc:
        yield proc


@pytest.mark.parametrize("loss_fn,cfg", [("cross_entropy", None), ("ppo", None), ("dro", {"beta": 0.3})])
def test_data_parallel_training_matches_local_reference(ray_service, ray_worker, tiny_model_dir, loss_fn, cfg):
    """The e2e reference check, run against the Ray worker: its 3-datum batch is split over the 2 ranks."""
    E2E.test_loss_gradient_and_adam_step_match_local_reference(ray_service, ray_worker, tiny_model_dir,
                                                               moved_state(ray_service), loss_fn, cfg)


def _varied_batch(tok, rng: np.random.Generator) -> list[trio.Datum]:
    texts = ["12 + 30 = 42. The answer is 42.", "7 + 8 = 15", "what is 3 + 4? it is 7.", "9 - 2 = 7",
             "The answer to 21 + 21 is 42, and 6 x 7 is 42 as well."]
    data = []
    for text in texts:
        ids = tok.encode(text)
        n = len(ids) - 1
        inputs = {"target_tokens": ids[1:], "logprobs": (-rng.uniform(0.5, 4.0, n)).astype(np.float32),
                  "advantages": rng.normal(0, 1, n).astype(np.float32)}
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
    return data


def test_dp2_equals_single_process(ray_service, ray_worker, service, worker):
    """Three steps of the same run on 2 data-parallel ranks and in one process: same numbers within 1e-5."""
    runs = {}
    for label, client in (("dp2", ray_service), ("dp1", service)):
        tc = client.create_lora_training_client("tiny", rank=8, seed=11)
        data = _varied_batch(tc.get_tokenizer(), np.random.default_rng(3))
        steps = []
        for loss_fn in ("cross_entropy", "importance_sampling", "ppo"):
            use = data if loss_fn != "cross_entropy" else [trio.Datum(
                model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
                for d in data]
            fb = tc.forward_backward(use, loss_fn).result()
            step = tc.optim_step(trio.AdamParams(learning_rate=2e-3, weight_decay=0.05)).result()
            steps.append((fb, step))
        path = tc.save_weights_for_sampler("after").result().path
        runs[label] = (tc, steps, E2E.checkpoint_folder(ray_worker if label == "dp2" else worker, path))
    (_, dp2, folder2), (_, dp1, folder1) = runs["dp2"], runs["dp1"]
    for (fb2, st2), (fb1, st1) in zip(dp2, dp1):
        assert fb2.metrics["loss:sum"] == pytest.approx(fb1.metrics["loss:sum"], rel=1e-5, abs=1e-5)
        assert fb2.metrics["token_count"] == fb1.metrics["token_count"]
        for out2, out1 in zip(fb2.loss_fn_outputs, fb1.loss_fn_outputs):
            lp2, lp1 = np.asarray(out2["logprobs"].data), np.asarray(out1["logprobs"].data)
            assert lp2.shape == lp1.shape and np.abs(lp2 - lp1).max() < 1e-5
        assert st2.metrics["grad_norm"] == pytest.approx(st1.metrics["grad_norm"], rel=1e-5)
        assert st2.metrics["step"] == st1.metrics["step"]
    w2 = load_file(folder2 / "adapter_model.safetensors")
    w1 = load_file(folder1 / "adapter_model.safetensors")
    assert w2.keys() == w1.keys()
    worst = max(float((w2[k] - w1[k]).abs().max()) for k in w1)
    assert worst < 1e-5, f"weights after 3 data-parallel steps differ from one process by {worst}"
    assert any(float(w1[k].abs().max()) > 0 for k in w1 if "lora_B" in k)  # the steps moved the weights

    # every rank applied the same AdamW step: both ranks hold the same weights
    run_id = runs["dp2"][0].training_run_id
    group = next(prefix for prefix, held in trainer_runs().items() if run_id in held)
    ranks = [ray.get_actor(f"{group}-r{r}", namespace="pytrio_compat") for r in (0, 1)]
    first, second = ray.get([rank.adapter_weights.remote(run_id) for rank in ranks], timeout=60)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_sampler_replicas_agree_with_trainer_and_fetch_each_snapshot_once(ray_service):
    path, _ = moved_state(ray_service)
    before = {n: ray.get(a.stats.remote(), timeout=60) for n, a in named_actors("sampler").items()}
    E2E.test_sampler_logprobs_agree_with_trainer_forward(ray_service, moved_state(ray_service))
    tc = ray_service.create_training_client_from_state(path)
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = trio.ModelInput.from_ints(tc.get_tokenizer().encode("5 + 9 ="))
    answers = [sampler.sample(prompt, num_samples=2, sampling_params=trio.SamplingParams(max_tokens=6, seed=4)).result()
               for _ in range(4)]
    assert all([s.tokens for s in a.sequences] == [s.tokens for s in answers[0].sequences] for a in answers)
    after = {n: ray.get(a.stats.remote(), timeout=60) for n, a in named_actors("sampler").items()}
    assert len(after) == 2
    for name in after:
        assert after[name]["batches"] >= before[name]["batches"] + 2  # sequential requests take turns
        # two snapshots were published in this test (one per save_weights_and_get_sampling_client): each replica
        # fetched each of them at most once, however many batches it sampled with it
        assert after[name]["fetched"] - before[name]["fetched"] <= 2


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server_mock", "serve", "--port", "0", "--log-level", "ERROR",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_unreachable_cluster_fails_fast_naming_the_address(tiny_model_dir, tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    started = time.monotonic()
    done = _serve("--model", f"tiny={tiny_model_dir}", "--storage", str(tmp_path), "--ray", address)
    assert done.returncode != 0
    assert address in done.stderr and "cannot reach the Ray cluster" in done.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("flags,resource", [(["--sampler-replicas", "40"], "CPU"),
                                            (["--gpus-per-replica", "1"], "GPU")])
def test_asking_more_than_the_cluster_has_fails_naming_the_resource(ray_address, tiny_model_dir, tmp_path, flags,
                                                                    resource):
    done = _serve("--model", f"tiny={tiny_model_dir}", "--storage", str(tmp_path), "--ray", ray_address, *flags)
    assert done.returncode != 0
    assert f"not enough {resource}s" in done.stderr and "available" in done.stderr, done.stderr[-2000:]


def test_replica_flags_need_ray(tiny_model_dir, tmp_path):
    done = _serve("--model", f"tiny={tiny_model_dir}", "--storage", str(tmp_path), "--sampler-replicas", "2")
    assert done.returncode != 0 and "need --ray" in done.stderr


