"""What the worker reads from disk: checkpoints only as safetensors + JSON (a planted pickle is never
opened), and local PEFT adapter folders only inside --allow-adapter-dir, checked against the base model."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import pytrio_compat as trio

from .reliability_helpers import KEY_A, datum

REPO = Path(__file__).resolve().parents[2]


class Tripwire:
    """Unpickling this creates the marker file: proof that someone loaded a pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant_pickles(folder: Path, marker: Path, names=("adapter_model.bin", "optimizer.pt", "pytorch_model.bin",
                                                     "training_args.bin", "rng_state.pth")) -> None:
    for name in names:
        (folder / name).write_bytes(pickle.dumps(Tripwire(marker)))


@pytest.fixture()
def client(special_worker, client_cache):
    c = trio.ServiceClient(base_url=special_worker.base_url, api_key=KEY_A)
    yield c
    c.close()


def test_no_code_path_can_unpickle():
    pattern = re.compile(r"\btorch\.load\(|\bpickle\.|\bimport pickle\b|allow_pickle\s*=\s*True|\bjoblib\b|\bdill\b"
                         r"|weights_only\s*=\s*False|\bnp\.load\(|\bnumpy\.load\(")
    offenders = []
    for package in ("server_mock", "pytrio_compat"):
        for path in sorted((REPO / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_planted_pickles_in_a_checkpoint_are_never_read(special_worker, client, tmp_path):
    marker = tmp_path / "unpickled"
    tc = client.create_lora_training_client("tiny", rank=4, seed=4)
    tc.forward_backward([datum()]).result()
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("with-pickles").result().path
    weights = tc.save_weights_for_sampler("with-pickles").result().path
    folders = {p: special_worker.storage / "checkpoints" / p[len("trio://"):] for p in (state, weights)}
    for folder in folders.values():
        plant_pickles(folder, marker)
    # the same checkpoint, but with only pickles where the safetensors were
    stripped = folders[state].with_name("pickles-only")
    shutil.copytree(folders[state], stripped)
    for file in stripped.glob("*.safetensors"):
        file.unlink()

    resumed = client.create_training_client_from_state_with_optimizer(state)
    resumed.load_state(state).result()
    sampled = client.create_sampling_client(model_path=weights).sample(
        trio.ModelInput.from_ints([3, 4]), sampling_params=trio.SamplingParams(max_tokens=2)).result()
    assert sampled.sequences
    stripped_path = state.rsplit("/", 1)[0] + "/pickles-only"
    with pytest.raises(trio.PyTrioError, match="adapter_model.safetensors"):
        resumed.load_state(stripped_path).result()
    with pytest.raises(trio.PyTrioError, match="adapter_model.safetensors"):
        client.create_training_client_from_state(stripped_path)
    assert not marker.exists()


def make_peft_adapter(model_dir: Path, folder: Path, **config) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                         "init_lora_weights": False, **config})
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(str(folder))
    return folder


def local_logprobs(model_dir: Path, adapter: Path, ids: list[int]) -> np.ndarray:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_local_peft_adapters_inside_allowed_folders_serve_exactly(special_worker, client, tiny_model_dir,
                                                                   adapter_root, tmp_path):
    ids = [5, 17, 42, 99, 123, 7, 64, 300]
    for name, config in (("qv", {}), ("rslora-mlp", {"target_modules": ["gate_proj", "down_proj"], "r": 8,
                                                     "lora_alpha": 16, "use_rslora": True})):
        adapter = make_peft_adapter(tiny_model_dir, adapter_root / name, **config)
        sampler = client.create_sampling_client(base_model="tiny", model_path=str(adapter))
        served = np.asarray(sampler.compute_logprobs(trio.ModelInput.from_ints(ids)).result()[1:])
        base = np.asarray(client.create_sampling_client(base_model="tiny").compute_logprobs(
            trio.ModelInput.from_ints(ids)).result()[1:])
        expected = local_logprobs(tiny_model_dir, adapter, ids)
        assert np.abs(served - expected).max() < 1e-5, name
        assert np.abs(base - expected).max() > 1e-3  # the adapter really changes the model
        sample = sampler.sample(trio.ModelInput.from_ints(ids), sampling_params=trio.SamplingParams(max_tokens=3))
        assert len(sample.result().sequences[0].tokens) == 3


def test_adapter_folders_outside_the_allow_list_or_not_matching_the_model_are_refused(
        special_worker, client, tiny_model_dir, adapter_root, tmp_path, service):
    good = make_peft_adapter(tiny_model_dir, adapter_root / "good")
    outside = make_peft_adapter(tiny_model_dir, tmp_path / "outside")
    (adapter_root / "escape-link").symlink_to(outside, target_is_directory=True)
    linked_files = adapter_root / "linked-files"
    linked_files.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (linked_files / name).symlink_to(outside / name)
    marker = tmp_path / "unpickled"
    pickled = adapter_root / "pickled"
    pickled.mkdir()
    shutil.copy(good / "adapter_config.json", pickled)
    plant_pickles(pickled, marker, names=("adapter_model.bin",))

    def copy_with(name: str, **changes) -> Path:
        folder = adapter_root / name
        shutil.copytree(good, folder)
        edit_config(folder, **changes)
        return folder

    cases = [
        (str(outside), 403, "allow-adapter-dir"),
        (str(adapter_root / "escape-link"), 403, "allow-adapter-dir"),
        (str(adapter_root / ".." / outside.parent.name / "outside"), 403, "allow-adapter-dir"),
        (str(linked_files), 403, "outside the allowed"),
        ("relative/adapter", 400, "absolute"),
        (str(adapter_root / "missing"), 404, "no adapter folder"),
        (str(pickled), 400, "adapter_model.safetensors"),
        (str(copy_with("rank-mismatch", r=8)), 400, "shape"),
        (str(copy_with("no-such-layer", target_modules=["attention_foo"])), 400, "target_modules"),
        (str(copy_with("dora", use_dora=True)), 400, "use_dora"),
        (str(copy_with("huge-rank", r=100000)), 400, "r:"),
    ]
    for path, status, message in cases:
        with pytest.raises(trio.PyTrioError) as err:
            client.create_sampling_client(base_model="tiny", model_path=path)
        assert err.value.status_code == status and message in str(err.value), (path, str(err.value))
    with pytest.raises(trio.PyTrioError, match="base_model"):  # its config names a path, not a served model
        client.create_sampling_client(model_path=str(good))
    assert not marker.exists()
    # a worker started without --allow-adapter-dir takes only its own trio:// paths
    with pytest.raises(trio.PyTrioError, match="allow-adapter-dir") as err:
        service.create_sampling_client(base_model="tiny", model_path=str(good))
    assert err.value.status_code == 400
    assert os.path.isdir(good)
