"""Faults on the Ray backend (slow: a second cluster, actors killed and started again): a killed sampler
replica costs no request, a dead trainer group fails only its own runs, naming the state to resume from."""

from __future__ import annotations

import time

import numpy as np
import pytest

import pytrio_compat as trio
from pytrio_compat.errors import EventFailedError

from .ray_helpers import named_actors, running_ray_worker, trainer_runs

ray = pytest.importorskip("ray", reason="the cluster extra (pip install -e .[cluster]) is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ray_worker(ray_address, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-faults")
    with running_ray_worker(ray_address, tiny_model_dir, root, trainer_groups=2) as proc:
        yield proc


def _sample_all(clients, prompt) -> list:
    return [client.sample(prompt, num_samples=4, sampling_params=trio.SamplingParams(
        max_tokens=320, temperature=1.0, seed=seed, stop=[])) for client in clients for seed in (1, 2, 3)]


def test_killed_sampler_replica_is_restarted_and_its_batch_retried(ray_service, ray_worker):
    tc = ray_service.create_lora_training_client("tiny", rank=4, seed=21)
    clients = [tc.save_weights_and_get_sampling_client(), ray_service.create_sampling_client(base_model="tiny")]
    prompt = trio.ModelInput.from_ints(tc.get_tokenizer().encode("what is 3 + 4?"))
    expected = [f.result() for f in _sample_all(clients, prompt)]
    replicas = named_actors("sampler")
    pids = {name: ray.get(actor.ping.remote(), timeout=60) for name, actor in replicas.items()}
    log = ray_worker.storage.parent / "worker.log"
    retries_before = log.read_text().count("sending its batch to another replica")

    futures = _sample_all(clients, prompt)  # two weights: two batches, one on each replica
    time.sleep(0.3)
    victim = sorted(replicas)[0]
    ray.kill(replicas[victim], no_restart=False)
    got = [f.result() for f in futures]

    for answer, want in zip(got, expected):  # each result whole, once, exactly as without the kill
        assert len(answer.sequences) == 4
        assert [s.tokens for s in answer.sequences] == [s.tokens for s in want.sequences]
        for s, w in zip(answer.sequences, want.sequences):
            assert np.allclose(s.logprobs, w.logprobs, atol=1e-5)
    assert log.read_text().count("sending its batch to another replica") > retries_before
    deadline = time.monotonic() + 180
    while True:  # Ray starts it again, in a new process (calls meanwhile: "the actor is restarting")
        try:
            restarted = ray.get(ray.get_actor(victim, namespace="pytrio_compat").ping.remote(), timeout=60)
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, f"{victim} was not restarted"
            time.sleep(0.5)
    assert restarted != pids[victim]
    again = _sample_all(clients[:1], prompt)[0].result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in expected[0].sequences]


def _datum(tok, text: str) -> trio.Datum:
    ids = tok.encode(text)
    return trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def test_dead_trainer_fails_its_runs_and_others_keep_training(ray_service):
    """Runs last in this module: it kills a trainer group (a new one replaces it for new runs)."""
    clients = {}
    while True:  # one run on each group
        tc = ray_service.create_lora_training_client("tiny", rank=4, seed=len(clients) + 30)
        held = trainer_runs()
        group = next(prefix for prefix, runs in held.items() if tc.training_run_id in runs)
        clients.setdefault(group, tc)
        if len(clients) == 2:
            break
    (lost_group, lost), (kept_group, kept) = sorted(clients.items())
    tok = lost.get_tokenizer()
    datum = _datum(tok, "7 + 8 = 15")
    lost.forward_backward([datum]).result()
    lost.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    saved = lost.save_state("before-crash").result().path

    ray.kill(ray.get_actor(f"{lost_group}-r1", namespace="pytrio_compat"))
    pending = [lost.forward_backward([datum]), lost.optim_step(trio.AdamParams(learning_rate=1e-2)),
               lost.forward_backward([datum])]
    for future in pending:
        with pytest.raises(EventFailedError) as info:
            future.result()
        message = str(info.value)
        assert lost.training_run_id in message and saved in message and "lost" in message

    steps = []
    for _ in range(2):  # the other group's run trains on, each op applied once
        kept.forward_backward([datum]).result()
        steps.append(kept.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"])
    assert steps == [1.0, 2.0]
    sample = kept.save_weights_and_get_sampling_client().sample(
        trio.ModelInput.from_ints(tok.encode("7 +")), num_samples=1,
        sampling_params=trio.SamplingParams(max_tokens=4, seed=1)).result()
    assert len(sample.sequences) == 1

    resumed = ray_service.create_training_client_from_state(saved)  # on a fresh group, from the saved state
    assert resumed.forward_backward([datum]).result().metrics["token_count"] > 0
