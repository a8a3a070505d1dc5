"""Tinker's export path with the official, unmodified ``tinker`` SDK and ``tinker_cookbook.weights``:
``save_weights_external`` (age encryption as the cookbook asks for it), per-file signed URLs, the TTL and delete
of exports, and the cookbook's download -> ``build_lora_adapter`` / ``build_hf_model`` chain, checked against
the worker sampler's logprobs. On a model with its own head the chain is exact both ways; on a tied one the
PEFT adapter is exact and ``build_hf_model`` refuses instead of writing another model (api/tinker/export.py)."""

from __future__ import annotations

import json
import time
import urllib.request
import warnings

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

KEY_A, KEY_B = "export-a", "export-b"
TOL = 1e-5
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    """The tiny model with a head of its own (tie_word_embeddings=False)."""
    from server_mock.engine.tiny_model import build_tiny_model, build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("untied")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), arch="qwen3", seed=4)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def worker(tiny_model_dir, untied_model_dir, tmp_path_factory):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("tinker-export")
    proc = InProcessWorker(tiny_model_dir, root / "storage", "--model", f"{untied_model_dir}={untied_model_dir}",
                           api_keys=[KEY_A, KEY_B], model_name=str(tiny_model_dir)).start()
    yield proc
    proc.stop()


@pytest.fixture()
def env(worker, monkeypatch):
    warnings.simplefilter("ignore", FutureWarning)
    for name, value in {"TINKER_BASE_URL": worker.base_url, "TINKER_API_KEY": f"tml-{KEY_A}",
                        "TINKER_TELEMETRY": "0", "NO_PROXY": "127.0.0.1,localhost"}.items():
        monkeypatch.setenv(name, value)
    return worker


def cookbook_weights():
    """tinker_cookbook.weights, installed without its dependencies (its tml-renderers pin has no release):
    ``pip install --no-deps tinker-cookbook==0.6.1`` next to the worker and dev extras (pyrage, tinker)."""
    return pytest.importorskip("tinker_cookbook.weights", reason="tinker-cookbook is not installed")


def trained(model_dir, steps=2):
    """A Tinker training client moved away from its initial weights (attention, MLP and head LoRAs)."""
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(str(model_dir), rank=4, seed=1)
    ids = list(range(3, 40))
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return service, tc


def sampled(tc, prompt):
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    return seq.tokens, np.asarray(seq.logprobs)


def logprobs_of(model, prompt, tokens):
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return np.array([float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)])


def peft_logprobs(base_dir, adapter_dir, prompt, tokens):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir)).eval()
    return logprobs_of(model, prompt, tokens)


def test_cookbook_chain_on_a_model_with_its_own_head_is_exact(env, untied_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights = cookbook_weights()

    service, tc = trained(untied_model_dir)
    prompt = [1, 20, 21, 22, 23]
    tokens, worker_lp = sampled(tc, prompt)
    state = tc.save_state("cookbook-untied").result().path
    adapter = weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"))  # age-encrypted transfer
    keys = load_file(f"{adapter}/adapter_model.safetensors")
    assert any(".model.unembed_tokens." in k for k in keys) and not any(".lm_head." in k for k in keys)

    weights.build_hf_model(base_model=str(untied_model_dir), adapter_path=adapter, output_path=str(tmp_path / "hf"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    merged_gap = np.abs(logprobs_of(merged, prompt, tokens) - worker_lp).max()
    weights.build_lora_adapter(base_model=str(untied_model_dir), adapter_path=adapter,
                               output_path=str(tmp_path / "peft"))
    peft_gap = np.abs(peft_logprobs(untied_model_dir, tmp_path / "peft", prompt, tokens) - worker_lp).max()
    print(f"untied: cookbook build_hf_model {merged_gap:.2e}, build_lora_adapter {peft_gap:.2e}")
    assert merged_gap <= TOL and peft_gap <= TOL
    service.close("success").result()


def test_cookbook_chain_on_a_tied_model_is_exact_or_refused(env, tiny_model_dir, tmp_path):
    weights = cookbook_weights()
    from tinker_cookbook.exceptions import WeightsMergeError

    service, tc = trained(tiny_model_dir)
    prompt = [1, 20, 21, 22, 23]
    tokens, worker_lp = sampled(tc, prompt)
    state = tc.save_state("cookbook-tied").result().path
    adapter = weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"))
    weights.build_lora_adapter(base_model=str(tiny_model_dir), adapter_path=adapter,
                               output_path=str(tmp_path / "peft"))
    gap = np.abs(peft_logprobs(tiny_model_dir, tmp_path / "peft", prompt, tokens) - worker_lp).max()
    print(f"tied: cookbook build_lora_adapter {gap:.2e}")
    assert gap <= TOL
    with pytest.raises(WeightsMergeError, match="lm_head.weight"):  # never a silently different model
        weights.build_hf_model(base_model=str(tiny_model_dir), adapter_path=adapter,
                               output_path=str(tmp_path / "hf"))
    service.close("success").result()


def test_encrypted_exports_hold_only_ciphertext_and_decrypt_to_the_plain_export(env, tiny_model_dir, tmp_path):
    import pyrage

    service, tc = trained(tiny_model_dir, steps=1)
    identity = pyrage.x25519.Identity.generate()
    recipients = [str(pyrage.x25519.Identity.generate().to_public()) for _ in range(9)] + [str(identity.to_public())]
    sealed = tc.save_weights_external("sealed", age_encryption_recipients=recipients).result().path  # 10: the limit
    plain = tc.save_weights_external("plain").result().path
    rest = tinker.RestClient()
    sealed_urls = rest.get_external_weights_urls(sealed).result()
    plain_urls = rest.get_external_weights_urls(plain).result()
    assert sorted(sealed_urls.urls) == sorted(f"{n}.age" for n in plain_urls.urls)
    assert sorted(plain_urls.urls) == ["adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"]
    run = sealed.split("/")[2]
    on_disk = env.storage / "checkpoints" / run / "external" / "sealed"
    assert sorted(p.name for p in on_disk.iterdir() if p.name != "meta.json") == sorted(sealed_urls.urls)
    for name, url in plain_urls.urls.items():
        with urllib.request.urlopen(sealed_urls.urls[f"{name}.age"]) as response:  # no API key, as the tools do
            ciphertext = response.read()
        with urllib.request.urlopen(url) as response:
            assert pyrage.decrypt(ciphertext, [identity]) == response.read()
    service.close("success").result()


def test_export_requests_are_checked_at_their_bounds(env, tiny_model_dir):
    import pyrage

    service, tc = trained(tiny_model_dir, steps=1)
    key = str(pyrage.x25519.Identity.generate().to_public())
    with pytest.raises(tinker.BadRequestError, match="at most 10 recipients"):
        tc.save_weights_external("too-many", age_encryption_recipients=[key] * 11).result()
    with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[1\]"):
        tc.save_weights_external("bad-key", age_encryption_recipients=[key, "age1notakey"]).result()
    for ttl in (3599, 10 * 365 * 24 * 3600 + 1):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            tc.save_weights_external(f"ttl-{ttl}", ttl_seconds=ttl).result()
    # each refused export used up its seq_id: the model's gate expects the next one, nothing waits for a gap
    from server_mock.api.auth import tenant_id

    gate = env.server.config.app.state.tinker.state.model(tc.model_id, tenant_id(KEY_A)).gate
    assert gate.next == 1 + 2 + 4 and gate.waiting_bytes == 0  # 2 training ops, 4 refused exports
    for ttl in (3600, 10 * 365 * 24 * 3600):
        assert tc.save_weights_external(f"ttl-{ttl}", ttl_seconds=ttl).result().path.endswith(f"ttl-{ttl}")
    with pytest.raises(Exception, match="already exist"):
        tc.save_weights_external("ttl-3600").result()
    service.close("success").result()


def test_ttl_delete_and_tenants_of_exports(env, tiny_model_dir):
    from server_mock.storage.checkpoints import CheckpointRef, CheckpointStore

    service, tc = trained(tiny_model_dir, steps=1)
    path = tc.save_weights_external("lifecycle", ttl_seconds=3600).result().path
    run, name = path.split("/")[2], path.rsplit("/", 1)[1]
    store = CheckpointStore(env.storage)
    ref = CheckpointRef(run, "external", name)
    rest = tinker.RestClient()
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    assert abs(store.read_meta(ref)["expires_at"] - (time.time() + 7200)) < 60
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert store.read_meta(ref)["expires_at"] is None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 3599).result()

    base = f"{env.base_url}/api/v1/training_runs/{run}/checkpoints/external_weights/{name}"
    other = {"X-API-Key": f"tml-{KEY_B}"}
    assert httpx.get(f"{base}/external_weights_urls", headers=other).status_code == 404
    assert httpx.put(f"{base}/ttl", json={"ttl_seconds": 3600}, headers=other).status_code == 404
    assert httpx.delete(base, headers=other).status_code == 404
    urls = rest.get_external_weights_urls(path).result().urls
    assert httpx.get(urls["adapter_config.json"], headers=other).status_code == 404
    assert json.loads(httpx.get(urls["adapter_config.json"]).content)["r"] == 4

    store.set_expiry(ref, time.time() - 1)  # expired: the sweeper removes exports like other checkpoints
    assert store.sweep_expired() == [ref] and not store.exists(ref)
    assert httpx.get(urls["adapter_config.json"]).status_code == 404
    path2 = tc.save_weights_external("deleted").result().path
    rest.delete_checkpoint_from_tinker_path(path2).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(path2).result()
    service.close("success").result()
