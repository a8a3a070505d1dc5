"""Vision-language models load as image-text models, behave on text exactly like their language model alone, and
get LoRA on the language model only unless the vision tower is asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from pytrio_compat.wire import LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine.images import DecodedImage
from server_mock.engine.loading import load_model_and_tokenizer
from server_mock.engine.tiny_vlm import TINY_VLM_FAMILIES, build_tiny_vlm, build_tiny_vlm_tokenizer
from server_mock.engine.vision import ImageProcessing, load_image_processing
from server_mock.engine.vision_probe import probe_image
from server_mock.lora import linear_groups, lora_config

pytestmark = pytest.mark.timeout(300)
# the vision tower and projector of each family, by module name (written out here, not derived)
VISION_PREFIXES = {"qwen3_5": ("model.visual.",), "qwen3_vl": ("model.visual.",), "qwen2_5_vl": ("model.visual.",),
                   "gemma3": ("model.vision_tower.", "model.multi_modal_projector."),
                   "llava": ("model.vision_tower.", "model.multi_modal_projector.")}
DECODER = "model.language_model."


def load(tiny_vlm_dir, arch):
    return load_model_and_tokenizer(str(tiny_vlm_dir(arch)), "cpu", torch.float32)


def text_reference(model):
    """The language model alone, built from the text config with the VLM's decoder weights, and the output head."""
    decoder = AutoModel.from_config(model.config.get_text_config()).float().eval()
    weights = {k.removeprefix(DECODER): v for k, v in model.state_dict().items() if k.startswith(DECODER)}
    decoder.load_state_dict(weights, strict=True)
    return decoder, model.lm_head.weight.detach()


def token_batch(vocab: int, avoid: set[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 23), generator=gen)
    ids[torch.isin(ids, torch.tensor(sorted(avoid)))] = 5
    return ids


@pytest.mark.parametrize("arch", TINY_VLM_FAMILIES)
def test_each_family_loads_as_its_image_text_class_with_its_saved_weights(tiny_vlm_dir, arch):
    model, tok, _ = load(tiny_vlm_dir, arch)
    assert type(model).__name__ == MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[arch]
    ref = build_tiny_vlm(build_tiny_vlm_tokenizer(arch), arch, seed=0).state_dict()
    got = model.state_dict()
    assert set(ref) == set(got)
    assert any(k.startswith(VISION_PREFIXES[arch][0]) for k in got)  # the vision tower is there, with its weights
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


@pytest.mark.parametrize("arch", TINY_VLM_FAMILIES)
def test_text_only_logprobs_equal_the_language_model_alone(tiny_vlm_dir, arch):
    model, tok, _ = load(tiny_vlm_dir, arch)
    decoder, head = text_reference(model)
    ids = token_batch(len(tok), set(range(512, len(tok))))
    with torch.no_grad():
        got = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        hidden = decoder(input_ids=ids).last_hidden_state
        want = torch.log_softmax(hidden @ head.T, -1)
    assert float((got - want).abs().max()) <= 1e-6


def test_a_qwen3_5_checkpoint_gives_the_same_text_logprobs_as_its_former_causal_lm_load(tiny_vlm_dir):
    """Before, a Qwen3.5 VLM checkpoint was served through transformers' causal-LM class (its language model
    only); the image-text load must not change a single text logprob."""
    model, tok, source = load(tiny_vlm_dir, "qwen3_5")
    former = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert type(former).__name__ == "Qwen3_5ForCausalLM"
    ids = token_batch(len(tok), set(range(512, len(tok))))
    with torch.no_grad():
        gap = (torch.log_softmax(model(input_ids=ids).logits, -1) - torch.log_softmax(former(input_ids=ids).logits, -1))
    assert float(gap.abs().max()) <= 1e-6


def _vision_linears(model, arch) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(VISION_PREFIXES[arch])}


@pytest.mark.parametrize("arch", TINY_VLM_FAMILIES)
def test_lora_groups_cover_the_language_model_only_unless_the_vision_tower_is_asked_for(tiny_vlm_dir, arch):
    model, _, _ = load(tiny_vlm_dir, arch)
    decoder, _ = text_reference(model)
    groups = linear_groups(model)
    # exactly the groups the language model alone gets, plus the output head
    assert {k.removeprefix(DECODER): v for k, v in groups.items() if k != "lm_head"} == linear_groups(decoder)
    assert groups["lm_head"] == "train_unembed"
    vision = _vision_linears(model, arch)
    assert vision and not vision & set(groups)
    with_tower = linear_groups(model, vision_tower=True)
    assert set(with_tower) - set(groups) == vision
    assert {k: v for k, v in with_tower.items() if k in groups} == groups
    for name in vision:
        assert with_tower[name] == ("train_attn" if "attn" in name or "attention" in name else "train_mlp"), name


def _features(model, vision: ImageProcessing, image: DecodedImage) -> torch.Tensor:
    pixels = {k: torch.from_numpy(v) for k, v in vision.prepare(image).pixel_inputs.items()}
    out = model.get_image_features(**pixels, return_dict=True).pooler_output
    return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
@pytest.mark.parametrize("vision_tower", [False, True])
def test_peft_leaves_the_vision_tower_frozen_by_default_and_adapts_it_when_asked(tiny_vlm_dir, arch, vision_tower):
    from peft import get_peft_model

    model, tok, source = load(tiny_vlm_dir, arch)
    vision = load_image_processing(model, source, tok)
    image = probe_image()
    ids = token_batch(len(tok), set(range(512, len(tok))))
    with torch.no_grad():
        base_features, base_logits = _features(model, vision, image), model(input_ids=ids).logits
    config, targets = lora_config(linear_groups(model, vision_tower=vision_tower), LoraSpec(rank=2))
    peft = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(0)
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.5  # a trained-looking adapter
    assert all(p.requires_grad == ("lora_" in n) for n, p in peft.named_parameters())
    with torch.no_grad():
        features, logits = _features(peft.base_model.model, vision, image), peft(input_ids=ids).logits
    assert float((logits - base_logits).abs().max()) > 1e-3  # the language model is adapted
    moved = float((features - base_features).abs().max())
    assert (moved > 1e-3) if vision_tower else (moved == 0.0), moved
    assert any(t.startswith(VISION_PREFIXES[arch]) for t in targets) == vision_tower


def test_the_host_serves_a_vlm_with_its_image_processing_and_text_context(tiny_vlm_dir):
    from server_mock.engine.local_host import LocalModelHost

    host = LocalModelHost("vlm", str(tiny_vlm_dir("qwen3_5")), "cpu", torch.float32)
    assert isinstance(host.vision, ImageProcessing) and host.vision_refusal is None
    assert host.max_seq_len == host.model.config.text_config.max_position_embeddings == 2048
    spec = LoraSpec(rank=4, seed=0)
    assert not any(t.startswith("model.visual.") for t in host.lora_targets(spec))
    assert host.lora_layout().keys() == linear_groups(host.model).keys()
    tower = LocalModelHost("vlm", str(tiny_vlm_dir("qwen3_5")), "cpu", torch.float32,
                           options=TrainOptions(lora_vision_tower=True))
    assert "model.visual.blocks.0.attn.qkv" in tower.lora_targets(spec)
    assert "model.visual.merger.linear_fc1" in tower.lora_targets(spec)
    # a text datum trains as on any causal LM: the trainer's logprobs are the language model's alone (a new
    # adapter's B is zero), and the loss reaches the adapter
    adapter = host.create_adapter("run-1", spec)
    tokens = np.arange(10, 30, dtype=np.int64)
    out = host.forward_backward(adapter, [{"tokens": tokens[:-1], "target_tokens": tokens[1:],
                                           "weights": np.ones(19, np.float32)}], "cross_entropy", {}, backward=True)
    decoder, head = text_reference(load(tiny_vlm_dir, "qwen3_5")[0])
    with torch.no_grad():
        ref = torch.log_softmax(decoder(input_ids=torch.from_numpy(tokens[None, :-1])).last_hidden_state @ head.T, -1)
    want = ref[0].gather(-1, torch.from_numpy(tokens[1:, None]))[:, 0].numpy()
    assert np.abs(out["outputs"][0]["logprobs"] - want).max() <= 1e-5
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in adapter.params.values())


@pytest.mark.parametrize("arch", ["qwen3_5", "llava"])
def test_the_ray_front_ends_meta_model_has_the_actors_module_tree(tiny_vlm_dir, arch):
    """The Ray front end reads the LoRA layout from a weightless copy of the model: it must be the same
    image-text class as the one the actors load, or the two would name different layers."""
    from server_mock.cluster.remote_host import _meta_model

    meta, _, _ = _meta_model(str(tiny_vlm_dir(arch)))
    model, _, _ = load(tiny_vlm_dir, arch)
    assert type(meta) is type(model) and next(meta.parameters()).device.type == "meta"
    assert linear_groups(meta) == linear_groups(model)
    assert linear_groups(meta, vision_tower=True) == linear_groups(model, vision_tower=True)
