"""A GGUF file (llama.cpp, Ollama) of a merged model folder, written with the ``gguf`` package.

The ``gguf`` package knows the file format and each architecture's tensor names (``get_tensor_name_map``);
what a converter adds on top is the per-architecture metadata and weight layout, written here for the
families whose conversion is the plain one: Llama and Mistral (llama.cpp's ``llama`` architecture, whose
query/key rows are permuted to its rotary layout), Qwen2 and Qwen3. Other families (Gemma 3 shifts its norm
weights, MoE models stack their experts, Qwen3.5 and LFM2 have recurrent layers) are refused with a pointer
to llama.cpp's own ``convert_hf_to_gguf.py``, which handles them from the same merged folder.

Tensors keep the merged folder's precision by default (float32, float16 or bfloat16; 1-D tensors are always
float32, as llama.cpp's converter writes them); the tokenizer must be a byte-level BPE (``tokenizer.json``),
written as llama.cpp's ``gpt2`` tokenizer model with its merges, special token ids and chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from .adapter import ExportError

ARCHS = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
PRE_TOKENIZER = {"qwen2": "qwen2", "qwen3": "qwen2"}  # tokenizer.ggml.pre; llama.cpp's plain BPE rules otherwise
DTYPES = ("auto", "f32", "f16", "bf16")


def permute_rotary(weight, n_head: int):
    """Hugging Face's query/key row order to llama.cpp's (rotary halves interleaved), for the llama arch."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(model_dir: Path, out: Path, dtype: str = "auto") -> dict:
    """Write ``out`` (a .gguf) from the merged model folder ``model_dir``; a summary of what was written."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type", "")
    if model_type not in ARCHS:
        raise ExportError(f"GGUF for {model_type!r} models is not written by this tool (it writes "
                          f"{', '.join(sorted(ARCHS))}); convert the merged folder with llama.cpp's "
                          "convert_hf_to_gguf.py instead")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ExportError(f"rope scaling {rope.get('rope_type')!r} is not written to GGUF by this tool; use "
                          "llama.cpp's convert_hf_to_gguf.py on the merged folder")
    if dtype not in DTYPES:
        raise ExportError(f"--gguf-dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    arch = getattr(gguf.MODEL_ARCH, ARCHS[model_type])
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // n_head
    names = gguf.get_tensor_name_map(arch, n_layers)

    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    first = next(t for t in tensors.values() if t.ndim == 2)
    if dtype == "auto":
        dtype = {"torch.float16": "f16", "torch.bfloat16": "bf16"}.get(str(first.dtype), "f32")
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16}[dtype]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(config.get("_name_or_path") or model_dir.name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])
    vocab = _add_tokenizer(writer, model_dir, config, model_type, gguf)

    written = {}
    for key, tensor in tensors.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"no GGUF name for tensor {key!r} of this {model_type} model")
        data = tensor.float().numpy()
        if ARCHS[model_type] == "LLAMA" and key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            data = permute_rotary(data, n_head if ".q_proj." in key else n_kv)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
        written[name] = key
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return {"out": str(out), "architecture": gguf.MODEL_ARCH_NAMES[arch], "dtype": dtype, "tensors": written,
            "vocab_size": vocab}


def _add_tokenizer(writer, model_dir: Path, config: dict, model_type: str, gguf) -> int:
    from transformers import AutoTokenizer

    try:
        spec = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        raise ExportError(f"{model_dir} has no readable tokenizer.json: GGUF needs the tokenizer") from None
    if spec.get("model", {}).get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ExportError("the tokenizer is not a byte-level BPE; this tool writes only those to GGUF (use "
                          "llama.cpp's convert_hf_to_gguf.py on the merged folder)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n_vocab = config.get("vocab_size") or len(tokenizer)
    specials = set(tokenizer.all_special_ids)
    added = {token.content: token.special for token in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i >= len(tokenizer):
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = tokenizer.convert_ids_to_tokens(i)
        tokens.append(token)
        if i in specials or added.get(token):
            types.append(gguf.TokenType.CONTROL)
        elif token in added:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER.get(model_type, "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)
    return n_vocab
