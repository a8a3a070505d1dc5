"""Taking a trained adapter home: a downloaded checkpoint merged into a full Hugging Face model folder, and a
GGUF of it for llama.cpp / Ollama.

This package stands alone: it imports nothing else of ``pytrio_compat`` and loads torch, safetensors,
transformers and gguf only when a function runs, so both command lines can use it, ``pytrio-compat export``
on the client's machine and ``pytrio-worker export`` next to the worker's storage (the worker imports only
this package and ``pytrio_compat.wire`` from the client).

    from pytrio_compat.export import extract_archive, merge, write_gguf
    folder = extract_archive(Path("ckpt.tar"), Path("adapter"))     # from RestClient.download_checkpoint
    merge(Path("base-model"), folder, Path("merged"))               # safetensors shards, config, tokenizer
    write_gguf(Path("merged"), Path("model.gguf"))                  # Llama, Mistral, Qwen2, Qwen3

Numbers: the merged folder computes what the worker's sampler computes with the adapter (each family of the
test matrix is checked to 1e-5 in logprob); tied embeddings are untied when the adapter trains the head
(merge.py says why).
"""

from __future__ import annotations

from .adapter import Adapter, ExportError, extract_archive, read_adapter
from .gguf_file import write_gguf
from .merge import merge

__all__ = ["Adapter", "ExportError", "extract_archive", "merge", "read_adapter", "write_gguf"]
