"""Tiny, randomly initialised vision-language models with their tokenizer and image processor, built offline.

The VLM counterpart of ``tiny_model``: each family keeps its real architecture (Qwen3.5's hybrid linear attention
and vision tower with 2x2 patch merging and M-RoPE, Qwen3-VL's deepstack features fed to a text layer, Qwen2.5-VL's
windowed vision attention, Gemma 3's SigLIP tower with pooled soft tokens and bidirectional attention inside an
image, LLaVA's CLIP tower and projector in front of a Llama) at hidden size 64 (text) / 32 (vision), so a forward
pass with an image takes milliseconds on a CPU.

The tokenizer is ``tiny_model.build_tiny_tokenizer`` plus the family's image tokens, added after the 512 BPE ids,
and ``chat_template`` renders ``{"type": "image"}`` content parts the way the family's own template does. The image
processor is the family's PIL one with sizes scaled down (``preprocessor_config.json`` beside the weights), and
where the family's multimodal processor can be built without torchvision its ``processor_config.json`` is written
too (Gemma 3, LLaVA; the Qwen processors also need a video processor, which needs torchvision).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, PreTrainedModel, PreTrainedTokenizerFast

from server_mock.engine.tiny_model import (
    ENDOFTEXT,
    EOS_TOKEN_ID,
    IM_END,
    IM_START,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    build_tiny_tokenizer,
)

__all__ = ["TINY_VLM_FAMILIES", "build_tiny_vlm", "build_tiny_vlm_tokenizer", "make_tiny_vlm",
           "tiny_image_processor", "tiny_processor"]

TINY_VLM_FAMILIES = ("qwen3_5", "qwen3_vl", "qwen2_5_vl", "gemma3", "llava")

# the tokens each family's processor and chat template use around an image, in the order they are added
_IMAGE_TOKENS = {
    "qwen3_5": {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
                "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "llava": {"image_token": "<image>"},
}
_IMAGE_TOKENS["qwen3_vl"] = _IMAGE_TOKENS["qwen2_5_vl"] = _IMAGE_TOKENS["qwen3_5"]

# ChatML whose content may be a list of {"type": "text"|"image"} parts; an image part becomes the family's marker
_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ IMAGE }}{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
_IMAGE_MARKER = {"qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>", "gemma3": "<start_of_image>",
                 "llava": "<image>"}
_IMAGE_MARKER["qwen3_vl"] = _IMAGE_MARKER["qwen2_5_vl"] = _IMAGE_MARKER["qwen3_5"]

_QWEN_FAMILIES = ("qwen3_5", "qwen3_vl", "qwen2_5_vl")
# Qwen: 8-pixel patches merged 2x2, so an image costs (h/16)*(w/16) tokens, 2 to 64 of them
_QWEN_IMAGES = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 2 * 16 * 16,
                "max_pixels": 64 * 16 * 16}
_SQUARE = 32  # Gemma 3 and LLaVA resize every image to 32x32: 16 patches of 8 pixels
_GEMMA_IMAGE_TOKENS = 4  # 16 patches average-pooled to 2x2 soft tokens


def _family(arch: str) -> str:
    arch = arch.lower()
    if arch not in TINY_VLM_FAMILIES:
        raise ValueError(f"unknown tiny VLM family {arch!r}; expected one of {', '.join(TINY_VLM_FAMILIES)}")
    return arch


def build_tiny_vlm_tokenizer(arch: str = "qwen3_5") -> PreTrainedTokenizerFast:
    """The tiny BPE tokenizer plus ``arch``'s image tokens (ids 512 and up), named as its processor expects
    (``tokenizer.image_token`` etc.), with a chat template that renders image parts."""
    arch = _family(arch)
    names = _IMAGE_TOKENS[arch]
    base = build_tiny_tokenizer()
    base.add_special_tokens({"additional_special_tokens": [IM_START, *names.values()]})
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  extra_special_tokens=[IM_START, *names.values()],
                                  model_specific_special_tokens=dict(names), clean_up_tokenization_spaces=False)
    tok.chat_template = _CHAT_TEMPLATE.replace("IMAGE", repr(_IMAGE_MARKER[arch]))
    return tok


def _ids(tok, arch: str) -> dict[str, int]:
    return {name: tok.convert_tokens_to_ids(token) for name, token in _IMAGE_TOKENS[arch].items()}


def _text_common(vocab_size: int) -> dict:
    return {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "bos_token_id": IM_START_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID,
            "tie_word_embeddings": True}


def _config(arch: str, tok):
    import transformers

    ids = _ids(tok, arch)
    text = _text_common(len(tok))
    if arch in _QWEN_FAMILIES:
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                  "num_position_embeddings": 64, **{k: _QWEN_IMAGES[k] for k in ("patch_size", "temporal_patch_size")},
                  "spatial_merge_size": _QWEN_IMAGES["merge_size"]}
        if arch == "qwen3_5":
            text |= {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                     "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                     "layer_types": ["linear_attention", "full_attention"]}
            config_class = transformers.Qwen3_5Config
        elif arch == "qwen3_vl":
            text |= {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
            vision |= {"deepstack_visual_indexes": [0]}  # vision layer 0 also feeds text layer 0
            config_class = transformers.Qwen3VLConfig
        else:  # Qwen2.5-VL: windowed attention in the vision tower but for its last block
            text |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
            vision |= {"window_size": 32, "fullatt_block_indexes": [1]}
            vision.pop("num_position_embeddings")
            config_class = transformers.Qwen2_5_VLConfig
        return config_class(text_config=text, vision_config=vision, image_token_id=ids["image_token"],
                            video_token_id=ids["video_token"], vision_start_token_id=ids["vision_start_token"],
                            vision_end_token_id=ids["vision_end_token"], tie_word_embeddings=True)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": _SQUARE, "patch_size": 8}
    if arch == "gemma3":
        vision["vision_use_head"] = False  # as in Gemma 3's checkpoints: the soft tokens pool the patch states
        text |= {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                 "query_pre_attn_scalar": 16}
        return transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text),
                                          vision_config=transformers.SiglipVisionConfig(**vision),
                                          mm_tokens_per_image=_GEMMA_IMAGE_TOKENS, boi_token_index=ids["boi_token"],
                                          eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
                                          tie_word_embeddings=True)
    return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**vision),
                                    text_config=transformers.LlamaConfig(**text), image_token_index=ids["image_token"],
                                    vision_feature_layer=-1, vision_feature_select_strategy="default",
                                    projector_hidden_act="gelu", tie_word_embeddings=True)


def tiny_image_processor(arch: str = "qwen3_5"):
    """The family's PIL image processor, sized for the tiny vision tower."""
    arch = _family(arch)
    if arch in _QWEN_FAMILIES:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(**_QWEN_IMAGES)
    if arch == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": _SQUARE, "width": _SQUARE})
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": _SQUARE}, crop_size={"height": _SQUARE, "width": _SQUARE})


def tiny_processor(arch: str, tokenizer, image_processor):
    """The family's multimodal processor, or None where it cannot be built without torchvision (Qwen)."""
    import transformers

    arch = _family(arch)
    if arch == "gemma3":
        return transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                            image_seq_length=_GEMMA_IMAGE_TOKENS)
    if arch == "llava":
        return transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                           vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return None


def build_tiny_vlm(tokenizer, arch: str = "qwen3_5", seed: int = 0) -> PreTrainedModel:
    """A random float32 image-text model of one of ``TINY_VLM_FAMILIES``, deterministic given ``seed``; building
    does not disturb the global torch RNG."""
    arch = _family(arch)
    config = _config(arch, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        if arch == "gemma3":  # transformers starts Gemma 3's projection at zero: images would change nothing
            torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = EOS_TOKEN_ID, PAD_TOKEN_ID, IM_START_TOKEN_ID
    return model


def make_tiny_vlm(directory: str | Path, arch: str = "qwen3_5", seed: int = 0) -> Path:
    """Write a tiny VLM, its tokenizer, its image processor (and its processor where one can be built) to
    ``directory`` for ``from_pretrained``."""
    arch = _family(arch)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_vlm_tokenizer(arch)
    build_tiny_vlm(tokenizer, arch, seed).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    image_processor = tiny_image_processor(arch)
    processor = tiny_processor(arch, tokenizer, image_processor)
    if processor is not None:
        processor.save_pretrained(directory)
    else:
        image_processor.save_pretrained(directory)
    # the chat template travels in tokenizer_config.json (processors may move it to chat_template.jinja)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if "chat_template" not in config and not (directory / "chat_template.jinja").exists():
        config["chat_template"] = tokenizer.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory
