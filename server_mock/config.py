"""The worker's settings: its limits (each one a command-line flag, each exceeded one answered with 4xx naming it)
and how forward/backward runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Limits:
    """Every limit is explicit; exceeding one is answered with 413/429 naming it."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_seq_len: int = 8192
    max_tokens_per_request: int = 262_144
    max_sample_tokens: int = 8192
    max_num_samples: int = 256
    max_training_runs: int = 64  # per tenant
    max_adapters: int = 256  # training runs on the whole worker, all tenants together
    max_queued_requests: int = 1024  # per tenant: training ops and samples queued or running
    max_samplers: int = 1024  # per tenant: sampling clients kept, least recently used dropped first
    max_snapshots: int = 16  # per tenant: in-memory sampler weights kept, least recently used dropped first
    max_lora_rank: int = 128
    # Checked against every generated token, so bounded: OpenAI takes 4 stop strings, vLLM and SGLang
    # take any number but real requests carry a handful of short ones.
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256  # UTF-8 bytes of one stop string
    max_stop_token_ids: int = 1024  # checked per token; clients send a few, or a few hundred (a class of ids)


MICRO_BATCH_TOKENS = 2048  # padded tokens per forward pass; bounds the (B, T, V) logits in memory
PREFIX_SHARE_MIN_TOKENS = 32


@dataclass(frozen=True)
class TrainOptions:
    """How forward/backward runs. bf16 autocast is 2-3x faster on CPUs with AVX-512 BF16 and on GPUs, but
    the trainer's logprobs then differ from the float32 sampler's by ~1e-2, so it is off unless asked for."""

    micro_batch_tokens: int = MICRO_BATCH_TOKENS
    autocast_bf16: bool = False
    activation_checkpointing: bool = False
    float32_head: bool = True  # the output head in float32 in the sampler and the trainer (see model_support)
    # datums of one call sharing at least this many leading tokens run them once (prefix_sharing.py); 0 = never
    prefix_share_min_tokens: int = PREFIX_SHARE_MIN_TOKENS
