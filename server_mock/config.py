"""The worker's settings, each declared once: its limits (each exceeded one answered with 4xx naming it) and how
forward/backward runs. Every field is a ``pytrio-worker serve`` flag, generated from its declaration
(``add_flags``, ``from_args``): the flag is the field's name in dashes unless it says otherwise."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def setting(default: Any, help: str, *, flag: str | None = None, choices: dict[str, Any] | None = None,
            minimum: float | None = None, maximum: float | None = None, why: str = "",
            metavar: str | None = None) -> Any:
    """A field with its flag's help text; ``choices`` maps flag values to field values, ``minimum`` and ``maximum``
    are checked by ``from_args`` (``why`` says what the bounds mean)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "minimum": minimum,
                                            "maximum": maximum, "why": why, "metavar": metavar})


@dataclass
class Limits:
    """Every limit is explicit; exceeding one is answered with 413/429 naming it."""

    max_body_bytes: int = setting(64 * 1024 * 1024, "largest request body that carries tensors (native training "
                                                    "ops, Tinker forward_backward), in bytes")
    max_json_body_bytes: int = setting(4 * 1024 * 1024, "largest request body of every other route (JSON), in bytes")
    max_json_values: int = setting(1 << 16, "JSON values (numbers, strings, list items, object members) in one "
                                            "JSON request body (4x that in a body that carries tensors): parsing "
                                            "holds ~60 bytes and some microseconds for each, whatever its size, "
                                            "without letting go of the interpreter")
    max_zstd_ratio: int = setting(100, "how many times its compressed size a zstd body (Tinker routes) may expand "
                                       "to, beyond 1 MiB", minimum=1, why="a ratio")
    max_parsing_bytes: int = setting(256 * 1024 * 1024, "request bodies over 1 MiB parsed at once, all requests "
                                                        "together: their bytes plus 64 per JSON value (others wait)",
                                     minimum=1, why="a budget of bytes")
    max_seq_len: int = setting(8192, "longest sequence (prompt + completion, or a datum), in tokens; the model's own "
                                     "context caps it")
    max_tokens_per_request: int = setting(262_144, "tokens in one forward/backward request, all datums together")
    max_sample_tokens: int = setting(8192, "max_tokens of one sample request")
    max_sample_request_tokens: int = setting(262_144, "num_samples x (prompt + max_tokens) of one sample request: "
                                                      "how long it may hold the model")
    max_num_samples: int = setting(256, "num_samples of one sample request")
    max_training_runs: int = setting(64, "training runs per API key")
    max_adapters: int = setting(256, "training runs on this worker, all keys together")
    max_queued_requests: int = setting(1024, "training ops and samples queued or running, per API key (more get 429 "
                                             "+ Retry-After)")
    max_samplers: int = setting(1024, "sampling clients kept per API key (its least recently used dropped first)")
    max_snapshots: int = setting(16, "in-memory sampler snapshots kept per API key "
                                     "(save_weights_and_get_sampling_client); its least recently used dropped first")
    max_lora_rank: int = setting(128, "largest LoRA rank a run may ask for")
    # a run's adapter memory: LoRA weights, their gradients and AdamW's two moments, all float32 (16 bytes a parameter)
    max_adapter_bytes: int = setting(0, "memory the training runs of one API key may hold (LoRA weights, gradients, "
                                        "AdamW moments: 16 bytes a parameter, from the model's layout); 0: a quarter "
                                        "of --max-adapter-bytes-total", minimum=0, why="0 is the default")
    max_adapter_bytes_total: int = setting(0, "memory the training runs of all keys may hold together; 0: half of "
                                              "the device's memory (the GPU's, or RAM on the CPU)", minimum=0,
                                           why="0 is the default")
    # requests of different tenants decoded as one batch would let each see the other's traffic (batch_requests,
    # timings, the last bits of seeded logprobs); batching them is faster when many tenants sample one base model
    batch_across_tenants: bool = setting(False, "decode sample requests of different API keys for the same weights "
                                                "as one batch: more throughput when many keys sample a base model, "
                                                "but each then sees the others' traffic in its answers")
    max_result_bytes: int = setting(1 << 30, "bytes of finished results (native requests, Tinker futures) kept for "
                                             "polling per API key; past it its oldest are dropped", minimum=1,
                                    why="a budget of bytes")
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
    # images (engine/images.py): the bytes bound what a client may send, the pixels what decoding may allocate
    # (checked from the file's header before any pixel is decoded), the count how many decodes one request buys
    max_image_bytes: int = setting(10 * 1024 * 1024, "bytes of one image (PNG or JPEG file)")
    max_image_pixels: int = setting(4096 * 4096, "width x height of one image, read from its header before decoding "
                                                 "(a decompression bomb is refused unread)")
    max_images_per_request: int = setting(256, "image chunks in one sample or forward/backward request, all datums "
                                               "together (identical images are decoded once)")
    # soft-target cross-entropy: target_tokens / weights of shape [N, K] (top-K distillation sends K ~ 20)
    max_target_k: int = setting(1024, "K, the targets per position of soft-target cross-entropy ([N, K] inputs)")
    max_target_cells: int = setting(4_194_304, "soft-target cells (N x K, all datums together) in one "
                                               "forward/backward request")
    # stable_reinforce: what the sampler records per returned sequence when asked (record_stability_info)
    max_recorded_sequences: int = setting(65_536, "sampled sequences whose stability records are kept per API key "
                                                  "(least recently used dropped first)")
    max_recorded_tokens: int = setting(16_777_216, "tokens (prompts once per request, plus sampled tokens) held in "
                                                   "stability records per API key (least recently used dropped "
                                                   "first)")
    checkpoint_sweep_seconds: float = setting(60.0, "how often expired checkpoints (ttl_seconds) are deleted from "
                                                    "disk, in seconds; they answer 404 from their expiry on",
                                              minimum=0.05, why="the sweeper's own tick")
    recorded_sequence_ttl: float = setting(86_400.0, "seconds a stability record is kept after its last use "
                                                     "(sampling, or a training request naming it)")

    # a checkpoint archive streams a tar of the adapter files to a temporary file: bounded so that downloads
    # never hold more than this many copies being written at once (more answer 429 + Retry-After)
    max_archive_builds: int = setting(2, "checkpoint archives built at once, all keys together", minimum=1,
                                      why="0 would refuse every download")
    download_url_seconds: int = setting(3600, "lifetime of a signed download URL, in seconds",
                                        minimum=60, why="a URL must outlive its own transfer")
    # service/rate_limits.py: a bucket per key, refilled continuously; a key's own budget may be set in its keys file
    tokens_per_minute: int = setting(0, "tokens one API key may use a minute (datums trained or run forward, sample "
                                        "prompts plus num_samples x max_tokens, the unused part given back); past "
                                        "it, 429 with Retry-After. 0: no limit", minimum=0, why="0: no limit",
                                     metavar="N")

@dataclass
class PytrioOptions:
    """The PyTRIO protocol (server_mock/api/pytrio/, docs/pytrio.md): the limits its Control plane hands the
    official ``pytrio`` SDK, and how long its sessions, runs, tokens and event answers live."""

    # The SDK splits one forward_backward call into Actor events of at most these sizes (0: no limit sent, no split).
    pytrio_max_batch_size: int = setting(0, "datums per PyTRIO training event: the SDK splits a call into events of at "
                                            "most N datums (0: no limit; the call is one event)", minimum=0,
                                         why="0: no limit", metavar="N")
    pytrio_max_tokens_per_request: int = setting(0, "summed tokens per PyTRIO training event (the SDK splits a call "
                                                    "past it); 0: the worker's --max-tokens-per-request", minimum=0,
                                                 why="0: --max-tokens-per-request", metavar="N")
    pytrio_token_ttl: float = setting(43200.0, "seconds an Actor token lives; the SDK renews it through the Control "
                                               "plane", minimum=301,
                                      why="the SDK renews a token with 300 s or less left before every request")
    pytrio_event_ttl: float = setting(1800.0, "seconds the answer of a finished training event is kept for polls and "
                                              "re-sent submits (the SDK retries for up to 900 s)", minimum=1)
    pytrio_events_per_run: int = setting(256, "finished training events kept per run for polls (older ones are "
                                              "forgotten first)", minimum=16, why="the SDK keeps 16 in flight")
    pytrio_event_answer_bytes: int = setting(128 * 1024 * 1024, "bytes of finished training events' answers kept per "
                                                                "run (forward results carry per-token tensors; older "
                                                                "ones are forgotten first)", minimum=1 << 20)
    pytrio_max_sessions: int = setting(256, "open PyTRIO service sessions per API key", minimum=1)
    pytrio_session_ttl: float = setting(21600.0, "seconds a PyTRIO service session without any request is kept; "
                                                 "then it is closed and its runs released", minimum=60)
    pytrio_run_idle_ttl: float = setting(1800.0, "seconds a PyTRIO training run keeps its adapter without a heartbeat "
                                                 "or an event (the SDK beats every 60 s while the client lives)",
                                         minimum=60)
    pytrio_max_sampling_runs: int = setting(64, "PyTRIO sampling runs kept per API key (the SDK never closes them; "
                                                "the least recently used is released first)", minimum=1)
    pytrio_sampling_run_ttl: float = setting(21600.0, "seconds a PyTRIO sampling run without a sample request is kept",
                                             minimum=60)
    pytrio_ack_wait: float = setting(10.0, "seconds a PyTRIO event submit waits, under --durability full, for its "
                                           "event to be journaled by the service before it is acknowledged; past it, "
                                           "the event's body is recorded to run after a restart, and acknowledged",
                                     minimum=0, maximum=25, why="the SDK re-sends a submit after 30 s")
    pytrio_sample_keepalive: float = setting(30.0, "seconds a PyTRIO sample answer may take before the worker starts "
                                                   "it with whitespace keep-alives (one every such interval)",
                                             minimum=0.05)


@dataclass
class StorageOptions:
    """What ``--storage`` keeps beyond checkpoints (docs/reliability.md, "The worker restarts")."""

    durability: str = setting("full", "full: runs, their ops, samplers, snapshots and results are recorded under "
                                      "--storage before they are acknowledged, and a restarted worker carries on "
                                      "from them; checkpoint-only: only saved checkpoints survive a restart",
                              choices={"full": "full", "checkpoint-only": "checkpoint-only"})
    max_storage_bytes_per_tenant: int = setting(0, "bytes one API key's checkpoints may hold under --storage; a "
                                                   "save past it is refused (507) before anything is written; 0: "
                                                   "no limit", minimum=0, why="0: no limit")


@dataclass
class Connections:
    """What the HTTP server grants one connection: time to send a request, and room among the others."""

    request_timeout: float = setting(60.0, "seconds a client has to send a whole request (headers and body), from "
                                           "connecting or its first byte; slower ones get 408 and are closed",
                                     minimum=0.001, why="seconds")
    max_connections: int = setting(1000, "open HTTP connections, all clients together (also kept below the open-file "
                                         "limit); past it, the longest-waiting incomplete request of the busiest "
                                         "peer is closed, or the new connection gets 503", minimum=1,
                                   why="a count of connections")
    max_connections_per_peer: int = setting(512, "open HTTP connections from one IP address; past it, that peer's "
                                                 "longest-waiting incomplete request is closed, or the new connection "
                                                 "gets 503", minimum=1, why="a count of connections")


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
    # sample requests for different adapters of one base model decoded as one batch (engine/mixed_lora.py)
    adapter_pool_bytes: int = setting(2 * 1024 ** 3, "bytes of sampler adapters kept ready for mixed-adapter decode "
                                                     "batches (engine/adapter_pool.py: least recently used evicted "
                                                     "first, loaded again on demand); 0 decodes each adapter's "
                                                     "requests in batches of their own", minimum=0, metavar="BYTES")
    batch_invariant: bool = setting(False, "decode every sample request with per-request matmul shapes, so its "
                                           "tokens and logprobs are bit-identical whichever requests share its "
                                           "batch (slower: see docs/benchmarks.md)")
    # an image-text model's vision tower is frozen by default (lora.linear_groups); PEFT adapts its Linear layers too
    lora_vision_tower: bool = setting(False, "LoRA also covers an image-text model's vision tower and projector (its "
                                             "attention layers with train_attn, the rest with train_mlp); by default "
                                             "only the language model is adapted")
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
        maximum = f.metadata.get("maximum")
        why = f.metadata.get("why")
        if minimum is not None and value < minimum:
            raise ValueError(f"{_flag(f)} must be >= {minimum:g}" + (f" ({why})" if why else ""))
        if maximum is not None and value > maximum:
            raise ValueError(f"{_flag(f)} must be <= {maximum:g}" + (f" ({why})" if why else ""))
        values[f.name] = value
    return cls(**values)
