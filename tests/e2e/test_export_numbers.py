"""A trained adapter, taken off the worker, computes the worker's numbers elsewhere: for every family of the
tiny model matrix, the downloaded archive loaded in plain PEFT on the base model, and the merged model folder
loaded in plain transformers, give the worker sampler's logprobs on the same tokens to 1e-5 (float32), and
greedy generation from the merged model is the worker's greedy sample token for token.

Every tiny model ties its output head to its input embeddings and every run trains the head, so each family
also checks the untying: the merged model's input embeddings are the base model's, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import pytrio_compat as trio
from pytrio_compat.export import extract_archive, merge
from server_mock.engine.tiny_model import TINY_FAMILIES, make_tiny_model

pytestmark = pytest.mark.timeout(900)
TOL = 1e-5
PROMPT_TEXT = "what is 12 + 30? the answer is"


@pytest.fixture(scope="module")
def family_worker(tmp_path_factory):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("export-families")
    dirs = {f: make_tiny_model(root / f, arch=f, seed=3) for f in TINY_FAMILIES}
    extra = [arg for f in TINY_FAMILIES[1:] for arg in ("--model", f"{f}={dirs[f]}")]
    proc = InProcessWorker(dirs[TINY_FAMILIES[0]], root / "storage", *extra, model_name=TINY_FAMILIES[0]).start()
    client = trio.ServiceClient(base_url=proc.base_url)
    yield client, dirs
    client.close()
    proc.stop()


def trained_sampler_checkpoint(service, family: str) -> tuple[str, list[int], object]:
    """A run of ``family`` moved by two cross-entropy steps (attention, MLP and head LoRAs), saved for sampling;
    its path, a prompt, and the training client."""
    tc = service.create_lora_training_client(family, rank=4, seed=0)
    tok = tc.get_tokenizer()
    ids = tok.encode("7 + 8 = 15. 9 + 9 = 18. the answer is 42.")
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    for _ in range(2):
        tc.forward_backward([datum]).result()
        tc.optim_step(trio.AdamParams(learning_rate=2e-2)).result()
    return tc.save_weights_for_sampler(f"export-{family}").result().path, tok.encode(PROMPT_TEXT), tc


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log p(token_i | prompt, tokens_<i) from one full forward pass, float32."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return np.array([float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)])


def sample(sampler, prompt: list[int], temperature: float, n_tokens: int = 12):
    params = trio.SamplingParams(max_tokens=n_tokens, seed=11, temperature=temperature, stop=[])
    seq = sampler.sample(trio.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
    return seq.sequences[0]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_downloaded_and_merged_models_give_the_workers_numbers(family_worker, family, tmp_path):
    service, dirs = family_worker
    check_numbers(service, family, dirs[family], tmp_path)


@pytest.mark.slow
def test_smollm2_downloaded_and_merged_give_the_workers_numbers(tmp_path):
    from support import WorkerProcess

    from server_mock.engine.loading import SMOLLM2_ID, resolve_source

    source = resolve_source(SMOLLM2_ID)
    proc = WorkerProcess(source, tmp_path / "storage", model_name="smol").start()
    service = trio.ServiceClient(base_url=proc.base_url)
    try:  # 30 float32 layers: the sampler's cached decoding differs from any full forward pass by ~1e-5 already
        check_numbers(service, "smol", Path(source), tmp_path, relative_to_trainer=True)
    finally:
        service.close()
        proc.stop()


def check_numbers(service, family: str, base_dir: Path, tmp_path: Path, relative_to_trainer: bool = False) -> None:
    """The checks of the module docstring. With ``relative_to_trainer`` the bound is 1e-5 or twice the gap
    between the worker's own sampler and trainer on the same tokens, whichever is larger."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dirs = {family: base_dir}
    path, prompt, tc = trained_sampler_checkpoint(service, family)
    sampler = service.create_sampling_client(model_path=path)
    drawn = sample(sampler, prompt, temperature=1.0)
    greedy = sample(sampler, prompt, temperature=0.0)
    assert len(drawn.tokens) == len(greedy.tokens) == 12

    archive = tmp_path / "checkpoint.tar"
    service.create_rest_client().download_checkpoint(path, archive).result()
    folder = extract_archive(archive, tmp_path / "adapter")
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert "lm_head" in adapter_config["target_modules"]  # the head is trained: the untying is exercised

    base = AutoModelForCausalLM.from_pretrained(dirs[family], dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    peft_gap = np.abs(logprobs_of(peft_model, prompt, drawn.tokens) - np.asarray(drawn.logprobs)).max()

    report = merge(dirs[family], folder, tmp_path / "merged")
    assert report["untied_head"] and report["dtypes"] == ["float32"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    merged_gap = np.abs(logprobs_of(merged, prompt, drawn.tokens) - np.asarray(drawn.logprobs)).max()
    full = prompt + drawn.tokens
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})
    trainer = np.asarray(tc.forward([datum]).result().loss_fn_outputs[0]["logprobs"].data)[len(prompt) - 1:]
    trainer_gap = np.abs(trainer - np.asarray(drawn.logprobs)).max()
    tol = max(TOL, 2 * trainer_gap) if relative_to_trainer else TOL
    print(f"{family}: |logprob gap| PEFT {peft_gap:.2e}, merged {merged_gap:.2e} (worker trainer {trainer_gap:.2e})")
    assert peft_gap <= tol, f"{family}: base + adapter in PEFT differs from the worker by {peft_gap:.2e}"
    assert merged_gap <= tol, f"{family}: the merged model differs from the worker by {merged_gap:.2e}"

    merged.generation_config.eos_token_id = None  # the worker's greedy sample ran to max_tokens (stop=[])
    with torch.no_grad():
        generated = merged.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert generated[0, len(prompt):].tolist() == greedy.tokens

    # untied, not folded: the input embeddings are the base model's, and the head moved
    assert merged.config.tie_word_embeddings is False
    base_weights = load_file(str(dirs[family] / "model.safetensors"))
    merged_weights = load_file(str(tmp_path / "merged" / "model.safetensors"))
    embed = next(k for k in base_weights if k.endswith("embed_tokens.weight"))
    assert torch.equal(merged_weights[embed], base_weights[embed])
    assert "lm_head.weight" not in base_weights and not torch.equal(merged_weights["lm_head.weight"],
                                                                      base_weights[embed])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "merged" / name).is_file(), name


# --- vLLM's LoRA loader, written down from its sources (vLLM cannot run here) ---------------------------------
# vllm/lora/peft_helper.py: adapter_config.json needs r, lora_alpha and target_modules; modules_to_save must be
#   None, use_dora False, bias "none"; r <= --max-lora-rank (default 16; choices 1, 8, 16, 32, 64, 128, 256, 320,
#   512); use_rslora scales by alpha / sqrt(r).
# vllm/lora/lora_model.py (LoRAModel.from_local_checkpoint) reads adapter_model.safetensors; every tensor name
#   must parse (vllm/lora/utils.py parse_fine_tuned_lora_name) as base_model.model.<module>.lora_A.weight /
#   .lora_B.weight, and the last part of <module> must be an expected module, else "While loading ..., expected
#   target modules in ... but received [...]".
# Expected modules (vllm/lora/worker_manager.py): the names of the model's LinearBase layers, with each packed
#   layer replaced by the Hugging Face layers it packs (packed_modules_mapping: qkv_proj -> q_proj, k_proj,
#   v_proj; gate_up_proj -> gate_proj, up_proj; ...), plus the model's embedding_modules (lm_head only where the
#   vLLM model declares it). Per family, from vllm/model_executor/models/<family>.py:
VLLM_MODULES = {
    "qwen2": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, False),
    "llama": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, True),
    "mistral": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, True),  # llama.py
    "qwen3": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, True),
    "gemma3": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, False),  # no lm_head
    "qwen3_moe": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts"}, True),
    "qwen3_5": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                 "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}, True),
    "lfm2": ({"q_proj", "k_proj", "v_proj", "out_proj", "w1", "w2", "w3", "in_proj"}, True),
}
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_problems(config: dict, tensors: dict, family: str, max_lora_rank: int = 16) -> list[str]:
    """What vLLM's LoRA loader would reject in this adapter, as its sources above say."""
    import re

    problems = [f"missing {key}" for key in ("r", "lora_alpha", "target_modules") if key not in config]
    if config.get("modules_to_save"):
        problems.append("modules_to_save must be None")
    if config.get("use_dora"):
        problems.append("DoRA")
    if config.get("bias", "none") != "none":
        problems.append("bias")
    if config.get("r", 0) > max_lora_rank:
        problems.append(f"r={config.get('r')} > --max-lora-rank {max_lora_rank}")
    modules, head = VLLM_MODULES[family]
    expected = modules | ({"lm_head"} if head else set())
    for key, tensor in tensors.items():
        match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
        if not match:
            problems.append(f"unparsable {key}")
            continue
        if match[1].rsplit(".", 1)[-1] not in expected:
            problems.append(f"unexpected module {match[1]}")
        if (tensor.shape[0] if match[2] == "A" else tensor.shape[1]) != config.get("r"):
            problems.append(f"{key} is not rank {config.get('r')}")
    return problems


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_downloaded_adapters_have_the_layout_vllm_loads(family_worker, family, tmp_path):
    from safetensors.torch import load_file

    service, _ = family_worker
    rest = service.create_rest_client()
    for unembed in (True, False):
        tc = service.create_lora_training_client(family, rank=16, seed=0, train_unembed=unembed)
        path = tc.save_weights_for_sampler(f"vllm-{family}-{unembed}").result().path
        folder = extract_archive(rest.download_checkpoint(path, tmp_path / f"{unembed}.tar").result().path,
                                 tmp_path / f"adapter-{unembed}")
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        assert config["r"] == 16 and config["lora_alpha"] == 32 and config["r"] in VLLM_RANKS
        assert sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors}) == sorted(
            {t.rsplit(".", 1)[-1] for t in config["target_modules"]})
        problems = vllm_problems(config, tensors, family)
        head_supported = VLLM_MODULES[family][1]
        if unembed and not head_supported:  # vLLM takes no head LoRA on this family: serve the merged model
            assert problems and all("lm_head" in p for p in problems), problems
        else:
            assert not problems, problems
