"""pytrio_compat.export on its own (no worker): the merge arithmetic against an independent computation, the
base model's dtype and shards kept, the tied-head trap shown and avoided, GGUF files re-read with the gguf
reader, and every refusal with its reason."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch

from pytrio_compat.cli import main as compat_main
from pytrio_compat.export import ExportError, extract_archive, merge, read_adapter, write_gguf
from server_mock.engine.tiny_model import build_tiny_model, build_tiny_tokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def tiny_base(folder, arch="qwen2", dtype=torch.float32, shard=None, tie=True):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), arch=arch, seed=5)
    if not tie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    model.to(dtype).save_pretrained(folder, max_shard_size=shard or "5GB")
    tok.save_pretrained(folder)
    return folder


def random_adapter(base_folder, folder, targets=TARGETS, rank=4, alpha=32, seed=0, **extra):
    """A PEFT adapter saved by PEFT itself, with random (nonzero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, **extra))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(folder, save_embedding_layers=False)  # as the worker saves its adapters
    return folder


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


IDS = [5, 17, 40, 99, 3, 250, 7, 64, 128, 300]


def test_merge_folds_in_float32_and_keeps_the_base_dtype_and_shards(tmp_path):
    from safetensors.torch import load_file

    base = tiny_base(tmp_path / "base", dtype=torch.bfloat16, shard="40KB")
    index = json.loads((base / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # a sharded base
    adapter = random_adapter(base, tmp_path / "adapter")
    report = merge(base, adapter, tmp_path / "merged")
    assert report["dtypes"] == ["bfloat16"] and report["untied_head"]

    lora = load_file(str(adapter / "adapter_model.safetensors"))
    scale = 32 / 4
    base_t = {k: v for s in set(index["weight_map"].values()) for k, v in load_file(str(base / s)).items()}
    out_index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    merged_t = {k: v for s in set(out_index["weight_map"].values())
                for k, v in load_file(str(tmp_path / "merged" / s)).items()}
    assert set(merged_t) == set(base_t) | {"lm_head.weight"} == set(out_index["weight_map"])
    for key, weight in base_t.items():
        module = key.removesuffix(".weight")
        a = lora.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            assert torch.equal(merged_t[key], weight), key  # untouched tensors are copied bit for bit
            continue
        b = lora[f"base_model.model.{module}.lora_B.weight"]
        expected = (weight.double() + scale * (b.double() @ a.double())).to(torch.bfloat16)
        assert merged_t[key].dtype == torch.bfloat16
        assert (merged_t[key].float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()
    a, b = lora["base_model.model.lm_head.lora_A.weight"], lora["base_model.model.lm_head.lora_B.weight"]
    embed = base_t["model.embed_tokens.weight"]
    expected_head = (embed.double() + scale * (b.double() @ a.double())).to(torch.bfloat16)
    assert (merged_t["lm_head.weight"].float() - expected_head.float()).abs().max() <= 2 ** -7
    assert torch.equal(merged_t["model.embed_tokens.weight"], embed)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_model_equals_peft_and_folding_into_the_tied_matrix_does_not(tmp_path, rslora):
    """Our untied merge gives PEFT's numbers; folding the head delta into the shared matrix (what a merge
    that ignores the tie does, e.g. PEFT's merge_and_unload here, or the cookbook's embed_tokens mapping)
    gives another model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tiny_base(tmp_path / "base")
    adapter = random_adapter(base, tmp_path / "adapter", use_rslora=rslora)
    assert read_adapter(adapter).scale == pytest.approx(32 / (2.0 if rslora else 4.0))
    merge(base, adapter, tmp_path / "merged")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter)).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = logprobs(peft, IDS)
    assert (logprobs(ours, IDS) - reference).abs().max() <= 1e-5

    folded = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():  # the shared matrix moved: input embeddings and head together
        head = peft.base_model.model.lm_head
        a, b = head.lora_A["default"].weight, head.lora_B["default"].weight
        folded.model.embed_tokens.weight += read_adapter(adapter).scale * (b @ a)
    assert (logprobs(folded, IDS) - reference).abs().max() > 1e-2


def test_untied_base_merges_into_its_own_head_and_takes_tinker_naming(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    base = tiny_base(tmp_path / "base", tie=False)
    adapter = random_adapter(base, tmp_path / "adapter")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter)).eval()
    # the same adapter in Tinker's naming (what save_weights_external writes for a separate head)
    tinker = tmp_path / "tinker"
    tinker.mkdir()
    tensors = {k.replace(".lm_head.", ".model.unembed_tokens."): v
               for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()}
    save_file(tensors, str(tinker / "adapter_model.safetensors"))
    (tinker / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    for source in (adapter, tinker):
        out = tmp_path / f"merged-{source.name}"
        assert merge(base, source, out)["untied_head"] is False
        merged = AutoModelForCausalLM.from_pretrained(out).eval()
        assert (logprobs(merged, IDS) - logprobs(peft, IDS)).abs().max() <= 1e-5
    # on a tied base, the Tinker name is ambiguous: refused
    with pytest.raises(ExportError, match="does not\\s+say whether"):
        merge(tiny_base(tmp_path / "tied"), tinker, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def _dequantized(tensor):
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])


def _field(reader, key):
    import gguf

    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


@pytest.mark.parametrize("arch,dtype", [("llama", "f32"), ("mistral", "f16"), ("qwen2", "f32"), ("qwen3", "bf16")])
def test_gguf_tensors_are_the_merged_weights(tmp_path, arch, dtype):
    import gguf
    from safetensors.torch import load_file

    base = tiny_base(tmp_path / "base", arch=arch)
    merge(base, random_adapter(base, tmp_path / "adapter"), tmp_path / "merged")
    report = write_gguf(tmp_path / "merged", tmp_path / "model.gguf", dtype)
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    weights = load_file(str(tmp_path / "merged" / "model.safetensors"))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    assert _field(reader, "general.architecture") == ("llama" if arch in ("llama", "mistral") else arch)
    prefix = _field(reader, "general.architecture")
    assert _field(reader, f"{prefix}.block_count") == config["num_hidden_layers"]
    assert _field(reader, f"{prefix}.attention.head_count") == n_head
    assert _field(reader, f"{prefix}.attention.head_count_kv") == n_kv
    assert _field(reader, f"{prefix}.embedding_length") == config["hidden_size"]
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 2
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]

    by_name = {t.name: t for t in reader.tensors}
    assert len(by_name) == len(weights) == len(report["tensors"])
    tol = {"f32": 0.0, "f16": 1e-3, "bf16": 8e-3}[dtype]
    for name, key in report["tensors"].items():
        got = _dequantized(by_name[name])
        want = weights[key].float().numpy()
        if arch in ("llama", "mistral") and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_head if ".q_proj." in key else n_kv  # llama.cpp's rotary layout, undone here
            got = got.reshape(heads, got.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(want.shape)
        assert got.shape == want.shape, key
        bound = 0.0 if want.ndim == 1 else tol * max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() <= bound, key
    assert "output.weight" in by_name  # the untied head, its own tensor
    assert by_name["token_embd.weight"].tensor_type == {"f32": 0, "f16": 1, "bf16": 30}[dtype]


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "qwen3_5", "lfm2"])
def test_gguf_refuses_families_it_does_not_convert(tmp_path, arch):
    base = tiny_base(tmp_path / "base", arch=arch)
    with pytest.raises(ExportError, match="convert_hf_to_gguf.py"):
        write_gguf(base, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_refusals_name_the_reason(tmp_path):
    base = tiny_base(tmp_path / "base")
    adapter = random_adapter(base, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())

    def variant(name, **changes):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return folder

    cases = {
        variant("dora", use_dora=True): "use_dora",
        variant("bias", bias="all"): "bias",
        variant("saved", modules_to_save=["lm_head"]): "modules_to_save",
        variant("rank", r=8): "not \\[r, in\\]",
    }
    encrypted = variant("encrypted")
    (encrypted / "adapter_model.safetensors").rename(encrypted / "adapter_model.safetensors.age")
    cases[encrypted] = "age-encrypted"
    pickled = variant("pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    cases[pickled] = "pickled weights are never read"
    for folder, reason in cases.items():
        with pytest.raises(ExportError, match=reason):
            merge(base, folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ExportError, match="already exists"):
        merge(base, adapter, base)  # never over the base model (or any existing folder) without --overwrite


def test_a_wrong_base_model_is_refused(tmp_path):
    base = tiny_base(tmp_path / "base", arch="qwen2")
    adapter = random_adapter(base, tmp_path / "adapter")
    lfm2 = tiny_base(tmp_path / "lfm2", arch="lfm2")
    with pytest.raises(ExportError, match="not a Linear layer"):
        merge(lfm2, adapter, tmp_path / "out")


def test_archives_with_anything_but_top_level_files_are_refused(tmp_path):
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("../outside.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    with pytest.raises(ExportError, match="unexpected entry"):
        extract_archive(archive, tmp_path / "x")
    assert not (tmp_path / "outside.json").exists()


def test_pytrio_compat_export_command(tmp_path, capsys):
    base = tiny_base(tmp_path / "base", arch="llama")
    adapter = random_adapter(base, tmp_path / "adapter")
    archive = tmp_path / "checkpoint.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(adapter / name, arcname=name)
    assert compat_main(["export", str(archive), "--base", str(base)]) == 2
    assert "nothing to do" in capsys.readouterr().err
    assert compat_main(["export", str(archive), "--base", str(base), "--merged", str(tmp_path / "m"),
                        "--gguf", str(tmp_path / "m.gguf")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["merged"]["untied_head"] and report["gguf"]["architecture"] == "llama"
    assert compat_main(["export", str(archive), "--base", str(base), "--merged", str(tmp_path / "m")]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_vl", "qwen2_5_vl", "gemma3", "llava"])
def test_image_text_models_merge_through_transformers(tmp_path, arch):
    """A tiny VLM's checkpoint names its tensors differently from its modules; the merged model still equals
    base + adapter in PEFT on text, with the vision tower and the input embeddings unchanged."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    from server_mock.engine.tiny_vlm import make_tiny_vlm
    from server_mock.lora import linear_groups

    base = make_tiny_vlm(tmp_path / "base", arch=arch, seed=0)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    targets = list(linear_groups(model))  # the worker's layout: the language model and its head, not the tower
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=32, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    peft.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    assert merge(base, tmp_path / "adapter", tmp_path / "merged")["untied_head"]

    fresh = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    reference = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    # the fold W + 8 * B A of these large random deltas rounds differently from PEFT's side path: measured up to
    # 1.14e-5 over random tiny VLMs (the text families' merges stay within 1e-5)
    assert (logprobs(merged, IDS[:7]) - logprobs(reference, IDS[:7])).abs().max() <= 3e-5
    original = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    assert torch.equal(merged.get_input_embeddings().weight, original.get_input_embeddings().weight)
    tower = {n: p for n, p in original.named_parameters() if n not in {f"{t}.weight" for t in targets}
             and "embed_tokens" not in n and "lm_head" not in n}
    merged_params = dict(merged.named_parameters())
    assert all(torch.equal(merged_params[n], p) for n, p in tower.items())
