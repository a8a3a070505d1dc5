"""The worker's settings, each declared once: its limits (each exceeded one answered with 4xx naming it) and how
forward/backward runs. Every field is a ``pytrio-worker serve`` flag, generated from its declaration
(``add_flags``, ``from_args``): the flag is the field's name in dashes unless it says otherwise."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def setting(default: Any, help: str, *, flag: str | None = None, choices: dict[str, Any] | None = None,
            minimum: float | None = None, why: str = "", metavar: str | None = None) -> Any:
    """A field with its flag's help text; ``choices`` maps flag values to field values, ``minimum`` is checked by
    ``from_args`` (``why`` says what the bound means)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "minimum": minimum,
                                            "why": why, "metavar": metavar})


@dataclass
class Limits:
    """Every limit is explicit; exceeding one is answered with 413/429 naming it."""

    max_body_bytes: int = setting(64 * 1024 * 1024, "largest request body, in bytes")
    max_seq_len: int = setting(8192, "longest sequence (prompt + completion, or a datum), in tokens; the model's own "
                                     "context caps it")
    max_tokens_per_request: int = setting(262_144, "tokens in one forward/backward request, all datums together")
    max_sample_tokens: int = setting(8192, "max_tokens of one sample request")
    max_num_samples: int = setting(256, "num_samples of one sample request")
    max_training_runs: int = setting(64, "training runs per API key")
    max_adapters: int = setting(256, "training runs on this worker, all keys together")
    max_queued_requests: int = setting(1024, "training ops and samples queued or running, per API key (more get 429 "
                                             "+ Retry-After)")
    max_samplers: int = setting(1024, "sampling clients kept per API key (its least recently used dropped first)")
    max_snapshots: int = setting(16, "in-memory sampler snapshots kept per API key "
                                     "(save_weights_and_get_sampling_client); its least recently used dropped first")
    max_lora_rank: int = setting(128, "largest LoRA rank a run may ask for")
    # Checked against every generated token, so bounded: OpenAI takes 4 stop strings, vLLM and SGLang
    # take any number but real requests carry a handful of short ones.
    max_stop_strings: int = setting(16, "stop strings per sample request")
    max_stop_string_bytes: int = setting(256, "UTF-8 bytes of one stop string")
    # checked per token; clients send a few, or a few hundred (a class of ids)
    max_stop_token_ids: int = setting(1024, "stop token ids per sample request")
    # a long decode yields the model to the next waiting tenant after this long (engine/queue.py)
    decode_slice_seconds: float = setting(0.5, "seconds a decode batch runs before the next tenant waiting for the "
                                               "model takes its turn (the batch resumes after it); requests for the "
                                               "same weights join the batch between steps", minimum=0.001,
                                          metavar="S")


MICRO_BATCH_TOKENS = 2048  # padded tokens per forward pass; bounds the (B, T, V) logits in memory
PREFIX_SHARE_MIN_TOKENS = 32


@dataclass(frozen=True)
class TrainOptions:
    """How the model runs: forward/backward, and the sampler's decode steps. bf16 autocast is 2-3x faster on CPUs
    with AVX-512 BF16 and on GPUs, but the trainer's logprobs then differ from the float32 sampler's by ~1e-2, so
    it is off unless asked for."""

    micro_batch_tokens: int = setting(MICRO_BATCH_TOKENS, "padded tokens per forward/backward pass (bounds "
                                                          "activation and logit memory)")
    autocast_bf16: bool = setting(False, "bf16 autocast in forward/backward (faster; trainer logprobs then differ "
                                         "from the float32 sampler's by ~1e-2)", flag="--autocast",
                                  choices={"off": False, "bf16": True})
    activation_checkpointing: bool = setting(False, "recompute activations in backward: less memory, ~30%% more time")
    # the output head in float32 in the sampler and the trainer (engine/support.py)
    float32_head: bool = setting(True, "compute the output head in the model's dtype (by default it runs in float32 "
                                       "in the sampler and the trainer, which keeps bf16 logprobs of the two sides "
                                       "closer)", flag="--no-float32-head")
    # fixed-shape decode steps (sampling/static_steps.py): on CUDA captured as CUDA graphs per shape bucket
    decode_graphs: bool = setting(False, "run the sampler's decode steps at fixed shapes (rows and cache columns in "
                                         "buckets) through torch.compile: on CUDA, mode=reduce-overhead captures one "
                                         "CUDA graph per bucket; the tokens and logprobs are the eager path's. "
                                         "Compile time is paid once per bucket", flag="--decode-graphs",
                                  choices={"off": False, "on": True})
    # a snapshot's LoRA merged into a weight copy for decoding (engine/merged_lora.py); float32 models only
    merge_lora_bytes: int = setting(2 * 1024 ** 3, "bytes of merged weight copies kept for decoding from snapshots "
                                                   "of a float32 model (each snapshot's LoRA merged into a copy of "
                                                   "the layers it adapts: faster decode steps, logprobs the same to "
                                                   "~1e-7); 0 decodes unmerged", minimum=0, metavar="BYTES")
    # datums of one call sharing at least this many leading tokens run them once (prefix_sharing.py); 0 = never
    prefix_share_min_tokens: int = setting(PREFIX_SHARE_MIN_TOKENS, "in one forward/backward call, datums sharing at "
                                           "least N leading tokens (a GRPO group's prompt) run them once; the results "
                                           "are unchanged. 0 disables (default 32)", minimum=0,
                                           why="0 disables prefix sharing", metavar="N")


def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of the settings dataclass ``cls``."""
    for f in fields(cls):
        meta, default = f.metadata, f.default
        assert default is not MISSING, f"{cls.__name__}.{f.name} needs a default to be a flag"
        if meta.get("choices"):
            names = {value: name for name, value in meta["choices"].items()}
            parser.add_argument(_flag(f), dest=f.name, default=names[default], choices=list(meta["choices"]),
                                help=meta["help"])
        elif isinstance(default, bool):
            parser.add_argument(_flag(f), dest=f.name, action="store_false" if default else "store_true",
                                help=meta["help"])
        else:
            parser.add_argument(_flag(f), dest=f.name, type=type(default), default=default,
                                metavar=meta.get("metavar"), help=meta["help"])


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The settings dataclass ``cls`` from parsed flags; a ``ValueError`` naming the flag for a value out of range."""
    values = {}
    for f in fields(cls):
        value = getattr(args, f.name)
        if f.metadata.get("choices"):
            value = f.metadata["choices"][value]
        minimum = f.metadata.get("minimum")
        if minimum is not None and value < minimum:
            why = f.metadata.get("why")
            raise ValueError(f"{_flag(f)} must be >= {minimum:g}" + (f" ({why})" if why else ""))
        values[f.name] = value
    return cls(**values)
