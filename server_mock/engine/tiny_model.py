"""A tiny, randomly initialised causal LM and byte-level BPE tokenizer, built offline.

Used by tests and smoke runs: everything is built in memory in a few milliseconds, with no network
access.

The tokenizer is trained on a fixed corpus of arithmetic and English strings, so its vocabulary is the same on
every call. Its special tokens always get the first ids: ``<|endoftext|>`` = 0 (pad), ``<|im_start|>`` = 1,
``<|im_end|>`` = 2 (eos).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

__all__ = [
    "CHATML_TEMPLATE",
    "ENDOFTEXT",
    "EOS_TOKEN_ID",
    "IM_END",
    "IM_START",
    "IM_START_TOKEN_ID",
    "PAD_TOKEN_ID",
    "TINY_FAMILIES",
    "TINY_VOCAB_SIZE",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "make_tiny_model",
]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
PAD_TOKEN_ID = 0
IM_START_TOKEN_ID = 1
EOS_TOKEN_ID = 2
TINY_VOCAB_SIZE = 512
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML. `enable_thinking` (and any other extra kwarg) is accepted and ignored.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- endif -%}"
)

_WORDS = [
    "the",
    "answer",
    "is",
    "what",
    "plus",
    "minus",
    "times",
    "divided",
    "by",
    "equals",
    "solve",
    "this",
    "problem",
    "step",
    "first",
    "then",
    "so",
    "we",
    "get",
    "a",
    "number",
    "of",
    "apples",
    "and",
    "oranges",
    "costs",
    "dollars",
    "each",
    "how",
    "many",
    "does",
    "she",
    "have",
    "left",
    "total",
    "sum",
    "result",
    "question",
    "please",
    "think",
    "carefully",
    "final",
    "user",
    "assistant",
    "system",
    "you",
    "are",
    "helpful",
    "model",
    "reply",
    "with",
    "only",
]


def _training_corpus() -> list[str]:
    """A fixed list of a few hundred short arithmetic / English strings (deterministic)."""
    corpus: list[str] = []
    for a in range(0, 100, 7):
        for b in range(3, 60, 11):
            corpus.append(f"{a} + {b} = {a + b}")
            corpus.append(f"What is {a} times {b}? The answer is {a * b}.")
            corpus.append(f"{a} - {b} = {a - b}")
    for i in range(120):
        n = 4 + i % 9
        words = [_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(n)]
        sentence = " ".join(words)
        corpus.append(sentence.capitalize() + ("?" if i % 3 == 0 else "."))
    for i in range(40):
        corpus.append(
            f"Question: Tom has {i} apples and buys {i + 3} more. How many?\nAnswer: #### {2 * i + 3}"
        )
        corpus.append(
            f"<|im_start|>user\nCompute {i} * {i % 10}<|im_end|>\n<|im_start|>assistant\n{i * (i % 10)}"
        )
    return corpus


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocab 512) with a ChatML chat template; the same vocabulary every call."""
    tok = Tokenizer(models.BPE())
    # The same normalizer / pre-tokenizer that transformers' Qwen2Tokenizer hard-codes: AutoTokenizer always
    # loads a saved tokenizer next to a qwen2 config.json as Qwen2Tokenizer, which replaces these, so using
    # them here keeps the in-memory and the reloaded tokenizer identical for both tiny archs.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    ids = [hf_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    if ids != [PAD_TOKEN_ID, IM_START_TOKEN_ID, EOS_TOKEN_ID]:  # pragma: no cover - guards the constants
        raise RuntimeError(f"unexpected special token ids {ids}")
    return hf_tok


# Small, fast configurations of the causal-LM families the worker is tested on. Each keeps the family's
# distinctive layer kinds: Gemma 3's sliding window is shorter than a test prompt + completion, Qwen3.5 and
# LFM2 mix recurrent (linear attention / short conv) layers with full attention, Qwen3-MoE routes to experts.
_FAMILY_EXTRAS: dict[str, dict] = {
    "qwen2": {},
    "llama": {},
    "mistral": {"sliding_window": 4096},
    "qwen3": {"head_dim": 16},
    "gemma3": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
               "query_pre_attn_scalar": 16},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1},
    "qwen3_5": {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "layer_types": ["linear_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "block_ff_dim": 128,
             "block_auto_adjust_ff_dim": False},
}
TINY_FAMILIES = tuple(_FAMILY_EXTRAS)


def _family_config(arch: str, common: dict):
    import transformers

    names = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen3": "Qwen3Config",
             "gemma3": "Gemma3TextConfig", "qwen3_moe": "Qwen3MoeConfig", "qwen3_5": "Qwen3_5TextConfig",
             "lfm2": "Lfm2Config"}
    if arch not in names:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {', '.join(TINY_FAMILIES)}")
    config_class = getattr(transformers, names[arch])
    return config_class(**common, **_FAMILY_EXTRAS[arch])


def build_tiny_model(vocab_size: int, arch: str = "qwen2", seed: int = 0) -> PreTrainedModel:
    """A random 2-layer, hidden-64 causal LM of one of ``TINY_FAMILIES``, float32, deterministic given ``seed``.

    ``vocab_size`` should be ``len(build_tiny_tokenizer())``. Eos/pad ids are the tiny tokenizer's.
    Building does not disturb the global torch RNG.
    """
    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": IM_START_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    config = _family_config(arch.lower(), common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id = EOS_TOKEN_ID
    gc.pad_token_id = PAD_TOKEN_ID
    gc.bos_token_id = IM_START_TOKEN_ID
    return model


def make_tiny_model(directory: str | Path, arch: str = "qwen2", seed: int = 0) -> Path:
    """Write a tiny model and its tokenizer to ``directory`` (safetensors) for ``from_pretrained``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), arch=arch, seed=seed)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
