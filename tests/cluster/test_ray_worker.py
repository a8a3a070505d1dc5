"""The worker on a local Ray cluster, through the public SDK: 2 sampler replicas, one trainer group of 2
data-parallel ranks. The numbers must be those of the in-process worker (``worker`` fixture) and of the
independent reference in tests/e2e/test_training_numerics.py. Killed actors: test_ray_faults.py (slow).
"""

from __future__ import annotations

import subprocess
import time

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import moved_state, run_cli

import pytrio_compat as trio

from .ray_helpers import ADMIN_KEY, E2E, named_actors, running_ray_worker, trainer_runs

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


def _trained_sampler(service, rank: int, seed: int, text: str):
    """A sampling client of a run one AdamW step moved (a fresh LoRA's B is zero: it samples as the base model)."""
    tc = service.create_lora_training_client("tiny", rank=rank, seed=seed)
    ids = tc.get_tokenizer().encode(text)
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([datum]).result()
    tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
    return tc.save_weights_and_get_sampling_client()


def _replica_stats() -> dict[str, dict]:
    return {n: ray.get(a.stats.remote(), timeout=60) for n, a in named_actors("sampler").items()}


def _adapters_histogram(worker) -> dict[str, float]:
    """The worker's ``batch_adapters`` histogram: its cumulative bucket counts by upper bound."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = httpx.get(worker.base_url + "/metrics", headers={"x-admin-key": ADMIN_KEY})
    assert answer.status_code == 200
    return {s.labels["le"]: s.value for f in text_string_to_metric_families(answer.text)
            if f.name == "pytrio_worker_batch_adapters" for s in f.samples if s.name.endswith("_bucket")}


def test_requests_of_several_adapters_sent_together_decode_in_one_replica_call(ray_service, ray_worker):
    """Four adapters' requests (ranks 4, 8, 16, 8) queued together go to one sampler replica as one call and decode
    there as one mixed batch (its adapter pool serves every adapter); each request gets the greedy tokens it gets
    alone, logprobs within 1e-4. Two long base-model requests hold both replicas first, so the four wait in the
    queue together and the first replica to free up takes them (one idle replica: the batch is not split)."""
    samplers = [_trained_sampler(ray_service, rank, 40 + i, text) for i, (rank, text) in enumerate(
        [(4, "1 + 1 = 2. 2 + 2 = 4."), (8, "the answer is 42"), (16, "7 x 6 = 42, 6 x 7 = 42"), (8, "9 - 2 = 7")])]
    prompt = trio.ModelInput.from_ints(samplers[0].get_tokenizer().encode("what is 3 + 4?"))
    params = trio.SamplingParams(max_tokens=24, temperature=0.0, stop=[])
    alone = [s.sample(prompt, num_samples=4, sampling_params=params).result() for s in samplers]
    assert len({tuple(a.sequences[0].logprobs) for a in alone}) == len(samplers)  # four different adapters

    base = ray_service.create_sampling_client(base_model="tiny")
    long = trio.SamplingParams(max_tokens=1000, temperature=1.0, seed=1, stop=[])
    before, histogram = _replica_stats(), _adapters_histogram(ray_worker)
    blockers = []
    for _ in range(2):  # one after the other: each is a batch of its own, on its own replica
        blockers.append(base.sample(prompt, num_samples=16, sampling_params=long))
        time.sleep(0.5)
    together = [f.result() for f in [s.sample(prompt, num_samples=4, sampling_params=params) for s in samplers]]
    for blocker in blockers:
        blocker.result()
    after = _replica_stats()
    moved = {le: count - histogram.get(le, 0.0) for le, count in _adapters_histogram(ray_worker).items()}
    # the four adapters' batch (one mix key, so one batch key) counts four sets of weights (the blockers ran alone:
    # a batch of one request is not observed)
    assert moved["3.0"] == 0 and moved["4.0"] == moved["+Inf"] == 1, moved

    wide = sum(after[n]["weights_per_batch"].get(len(samplers), 0) - before[n]["weights_per_batch"].get(
        len(samplers), 0) for n in after)
    calls = sum(after[n]["batches"] - before[n]["batches"] for n in after)
    assert wide == 1 and calls == 3, (before, after)  # served one by one: 4 calls of one adapter each
    used = sum(after[n]["pool"]["loads"] + after[n]["pool"]["hits"] - before[n]["pool"]["loads"]
               - before[n]["pool"]["hits"] for n in after)
    assert used >= len(samplers)  # the mixed decoder took each adapter from the replica's pool
    for got, want in zip(together, alone):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        for x, y in zip(got.sequences, want.sequences):
            assert np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs)).max() <= 1e-4


def test_a_replica_keeps_the_weights_of_at_most_keep_snapshots_beside_its_running_call(ray_address, tiny_model_dir):
    """A sampler replica (in this process, its snapshots put in the object store) with keep=2: a call of three
    adapters keeps all three while it runs, in one mixed batch; the next call drops the least recently used beyond
    two, and with each its adapter pool entry and merged copy."""
    from pytrio_compat.wire import LoraSpec
    from server_mock.cluster.actors import SamplerReplica
    from server_mock.config import TrainOptions
    from server_mock.sampling.generate import SampleSpec

    threads = torch.get_num_threads()
    try:
        replica = SamplerReplica(0, "tiny", str(tiny_model_dir), "cpu", "float32", None, TrainOptions(), 1, keep=2)
    finally:
        torch.set_num_threads(threads)
    host, snaps = replica.host, []
    for i, rank in enumerate((4, 8, 4, 8)):
        adapter = host.create_adapter(f"run-{i}", LoraSpec(rank=rank, seed=i))
        with torch.no_grad():
            for name, p in adapter.params.items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
        snaps.append(host.snapshot(adapter))
    holders = [[ray.put(snap)] for snap in snaps]
    spec = SampleSpec(prompt_tokens=[5, 6, 7, 8], num_samples=2, max_tokens=8, seed=1, temperature=0.0,
                      stop_token_ids=[])
    solo = [host.sample_batch(snap, [spec], {})[0] for snap in snaps]  # merged copies for all four
    host._merged.clear()

    results, _, _, _ = replica.sample_groups([(s.snapshot_id, h, [spec]) for s, h in zip(snaps[:3], holders[:3])])
    assert replica.weights_per_batch == {3: 1} and replica.fetched == 3
    assert list(replica.snapshots) == [s.snapshot_id for s in snaps[:3]]  # more than keep: the call's own
    assert set(host.adapter_pool.keys()) == set(replica.snapshots)
    replica.sample_groups([(snaps[3].snapshot_id, holders[3], [spec])])  # one adapter: its merged copy
    kept = [snaps[2].snapshot_id, snaps[3].snapshot_id]
    assert list(replica.snapshots) == kept and replica.fetched == 4
    assert set(host.adapter_pool.keys()) <= set(kept) and set(host._merged) <= set(kept)
    for got, want in zip([r[0] for r in results], solo):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        for x, y in zip(got.sequences, want.sequences):
            assert np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs)).max() <= 1e-4


def _serve(folder, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``pytrio-worker serve`` with these arguments, forked warm (``support.run_cli``), until it exits."""
    return run_cli(["serve", "--port", "0", "--log-level", "ERROR", *args], folder / "cli", timeout=timeout)


def test_unreachable_cluster_fails_fast_naming_the_address(tiny_model_dir, tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    started = time.monotonic()
    done = _serve(tmp_path, "--model", f"tiny={tiny_model_dir}", "--storage", str(tmp_path), "--ray", address)
    assert done.returncode != 0
    assert address in done.stderr and "cannot reach the Ray cluster" in done.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("flags,resource", [(["--sampler-replicas", "40"], "CPU"),
                                            (["--gpus-per-replica", "1"], "GPU")])
def test_asking_more_than_the_cluster_has_fails_naming_the_resource(ray_address, tiny_model_dir, tmp_path, flags,
                                                                    resource):
    done = _serve(tmp_path, "--model", f"tiny={tiny_model_dir}", "--storage", str(tmp_path), "--ray", ray_address,
                  *flags)
    assert done.returncode != 0
    assert f"not enough {resource}s" in done.stderr and "available" in done.stderr, done.stderr[-2000:]


def test_replica_flags_need_ray(tiny_model_dir, tmp_path):
    done = _serve(tmp_path, "--model", f"tiny={tiny_model_dir}", "--storage", str(tmp_path), "--sampler-replicas", "2")
    assert done.returncode != 0 and "need --ray" in done.stderr


