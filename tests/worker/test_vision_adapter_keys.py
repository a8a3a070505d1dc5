"""Adapters saved on one layout of an image-text family read on the other: a Qwen3.5 or Gemma 3 checkpoint served
as a causal LM names its decoder ``model.layers``, as an image-text model ``model.language_model.layers``
(``lora.align_adapter_keys``). A checkpoint saved before the image-text class was used loads on the VLM, tensor for
tensor, and one whose names match neither layout is still refused."""

from __future__ import annotations

import pytest
import torch

from pytrio_compat.wire import LoraSpec
from server_mock.engine.local_host import LocalModelHost
from server_mock.engine.tiny_model import make_tiny_model
from server_mock.errors import WorkerError
from server_mock.lora import adapter_keys, align_adapter_keys, aligned_module_name

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
def test_a_causal_lm_checkpoint_loads_on_the_image_text_model(tiny_vlm_dir, tmp_path, arch):
    text = LocalModelHost("t", str(make_tiny_model(tmp_path / arch, arch=arch, seed=0)), "cpu", torch.float32)
    vlm = LocalModelHost("v", str(tiny_vlm_dir(arch)), "cpu", torch.float32)
    spec = LoraSpec(rank=2, seed=0, train_unembed=False)  # the VLM's vocabulary has its image tokens too
    saved = {k: torch.randn_like(v) for k, v in text.adapter_weights(text.create_adapter("run-t", spec)).items()}
    assert any(".model.layers." in k for k in saved)
    adapter = vlm.create_adapter("run-v", spec)
    vlm.load_adapter_weights(adapter, saved)
    loaded = vlm.adapter_weights(adapter)
    assert len(loaded) == len(saved)
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key.replace(".model.layers.", ".model.language_model.layers.")], value,
                                   rtol=0, atol=0)
    back = text.create_adapter("run-t2", spec)  # and the other way round
    text.load_adapter_weights(back, loaded)
    for key, value in saved.items():
        torch.testing.assert_close(text.adapter_weights(back)[key], value, rtol=0, atol=0)
    with_head = text.adapter_weights(text.create_adapter("run-t3", LoraSpec(rank=2, seed=0)))
    headed = vlm.create_adapter("run-v2", LoraSpec(rank=2, seed=0))
    with pytest.raises(WorkerError) as err:  # lm_head's rows differ: refused naming the tensor, not a crash
        vlm.load_adapter_weights(headed, with_head)
    assert err.value.code == "checkpoint_mismatch" and "lm_head" in err.value.message
    stray = {**saved, "base_model.model.model.other.0.q_proj.lora_A.weight": torch.zeros(2, 2)}
    with pytest.raises(WorkerError) as err:
        vlm.load_adapter_weights(adapter, stray)
    assert err.value.code == "checkpoint_mismatch"


def test_renaming_only_ever_swaps_the_decoder_prefix():
    known = {"model.language_model.layers.0.mlp.up_proj", "lm_head"}
    assert aligned_module_name("model.layers.0.mlp.up_proj", known) == "model.language_model.layers.0.mlp.up_proj"
    assert aligned_module_name("lm_head", known) == "lm_head"
    assert aligned_module_name("model.layers.1.mlp.up_proj", known) == "model.layers.1.mlp.up_proj"  # not known
    assert aligned_module_name("x.model.layers.0.mlp.up_proj", known) == "x.model.layers.0.mlp.up_proj"
    keys = adapter_keys(["model.language_model.layers.0.mlp.up_proj"])
    half = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": 1,
            "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": 2}
    assert set(align_adapter_keys(half, keys)) == keys
    partly = {**half, "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": 3}
    assert align_adapter_keys(partly, keys) is partly  # not every key would be known: left as it is
