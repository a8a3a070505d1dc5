"""save_state / load_state / resume: real safetensors files, exact resume across a killed worker."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import WorkerProcess

import pytrio_compat as trio
from server_mock.storage.checkpoints import CheckpointStore, parse_path

ADAM = trio.AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0)


def batch(step: int) -> list[trio.Datum]:
    rng = np.random.default_rng(step)
    out = []
    for _ in range(2):
        ids = rng.integers(3, 500, size=16).tolist()
        out.append(trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                              loss_fn_inputs={"target_tokens": ids[1:],
                                              "weights": rng.uniform(0, 1, 15).astype(np.float32)}))
    return out


def train(tc, steps: range) -> None:
    futures = []
    for step in steps:
        futures += [tc.forward_backward(batch(step)), tc.optim_step(ADAM)]
    for future in futures:
        future.result()


def state_tensors(storage, path: str) -> dict[str, bytes]:
    return CheckpointStore(storage).fingerprint(parse_path(path))


def test_resume_after_sigkill_is_bit_identical(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTRIO_COMPAT_CACHE", str(tmp_path / "cache"))
    storage = tmp_path / "storage"
    worker = WorkerProcess(tiny_model_dir, storage).start()
    try:
        client = trio.ServiceClient(base_url=worker.base_url)
        straight = client.create_lora_training_client("tiny", rank=8, seed=13)
        train(straight, range(6))
        reference = state_tensors(storage, straight.save_state("straight").result().path)

        first_half = client.create_lora_training_client("tiny", rank=8, seed=13)
        train(first_half, range(3))
        half_path = first_half.save_state("half").result().path
        client.close()
        worker.kill()  # SIGKILL: no shutdown hooks, nothing flushed on the way out

        worker = WorkerProcess(tiny_model_dir, storage).start()
        client = trio.ServiceClient(base_url=worker.base_url)
        resumed = client.create_training_client_from_state_with_optimizer(half_path)
        train(resumed, range(3, 6))
        result = state_tensors(storage, resumed.save_state("resumed").result().path)
        client.close()
    finally:
        worker.stop()
    assert result.keys() == reference.keys()
    differing = [k for k in reference if reference[k] != result[k]]
    assert not differing, differing[:5]


def test_load_state_resets_optimizer_and_with_optimizer_keeps_it(service, worker):
    source = service.create_lora_training_client("tiny", rank=8, seed=3)
    train(source, range(2))
    path = source.save_state("two-steps").result().path
    meta = json.loads((worker.storage / "checkpoints" / path[7:] / "meta.json").read_text())
    assert meta["optim_steps"] == 2 and meta["base_model"] == "tiny"

    def next_step_number(tc) -> float:
        return tc.optim_step(trio.AdamParams(learning_rate=0.0)).result().metrics["step"]

    weights_only = service.create_lora_training_client("tiny", rank=8, seed=99)
    assert weights_only.load_state(path).result() == {}
    assert next_step_number(weights_only) == 1.0  # fresh Adam: the step count restarts
    with_optimizer = service.create_lora_training_client("tiny", rank=8, seed=99)
    with_optimizer.load_state_with_optimizer(path).result()
    assert next_step_number(with_optimizer) == 3.0
    probe = batch(50)
    outs = [tc.forward(probe).result().loss_fn_outputs[0]["logprobs"].data
            for tc in (source, weights_only, with_optimizer)]
    assert outs[0] == outs[1] == outs[2]  # same weights everywhere (lr 0 steps changed nothing)

    # Same weights, different Adam state: the next real step must differ between the two.
    for tc in (weights_only, with_optimizer):
        tc.forward_backward(probe)
        tc.optim_step(ADAM).result()
    after = [tc.forward(probe).result().loss_fn_outputs[0]["logprobs"].data for tc in (weights_only, with_optimizer)]
    assert after[0] != after[1]


def test_checkpoint_config_mismatch_and_overwrite(service):
    tc = service.create_lora_training_client("tiny", rank=8, seed=3)
    path = tc.save_state("cfg").result().path
    with pytest.raises(trio.PyTrioError, match="already exists"):
        tc.save_state("cfg").result()
    assert tc.save_state("cfg", overwrite=True).result().path == path
    other = service.create_lora_training_client("tiny", rank=16, seed=3)
    with pytest.raises(trio.PyTrioError, match="rank"):
        other.load_state(path).result()
    sampler_path = tc.save_weights_for_sampler("for-sampling").result().path
    with pytest.raises(trio.PyTrioError, match="save_state checkpoint"):
        other.load_state(sampler_path).result()
    assert service.create_sampling_client(model_path=sampler_path).model_id == "tiny"


def test_saved_sampler_weights_are_a_standard_peft_adapter(service, worker, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc = service.create_lora_training_client("tiny", rank=8, seed=5)
    train(tc, range(2))
    path = tc.save_weights_for_sampler("peft-export").result().path
    folder = worker.storage / "checkpoints" / path[7:]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder)).eval()
    ids = list(range(10, 30))
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids[:-1]])).logits[0].float(), -1)
    local = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].detach().numpy()
    served = tc.forward([trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                                    loss_fn_inputs={"target_tokens": ids[1:]})]).result()
    assert np.abs(np.asarray(served.loss_fn_outputs[0]["logprobs"].data) - local).max() < 1e-5


def test_rest_client_lists_and_deletes_checkpoints(service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=1)
    path = tc.save_state("listed").result().path
    rest = service.create_rest_client()
    run = rest.get_training_run(tc.training_run_id).result()
    assert run.training_run_id == tc.training_run_id and run.lora_rank == 4 and run.base_model == "tiny"
    assert rest.get_sampler(tc.save_weights_and_get_sampling_client().sampler_id).result().base_model == "tiny"
    listed = rest.list_checkpoints(tc.training_run_id).result()
    assert [c.path for c in listed.checkpoints] == [path]
    assert listed.checkpoints[0].checkpoint_type == "training" and listed.checkpoints[0].size_bytes > 0
    rest.delete_checkpoint(tc.training_run_id, path).result()
    assert rest.list_checkpoints(tc.training_run_id).result().checkpoints == []
    with pytest.raises(trio.PyTrioError):
        tc.load_state(path).result()
