"""The worker's settings, each declared once: its limits (each exceeded one answered with 4xx naming it) and how
forward/backward runs. Every field is a ``pytrio-worker serve`` flag, generated from its declaration
(``add_flags``, ``from_args``): the flag is the field's name in dashes unless it says otherwise, its help ends with
its default, and it is listed under its group (``GROUPS``; a field names its own, or takes its class's ``GROUP``).
How a declaration becomes a flag is server_mock/flags.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from server_mock.flags import setting


def parse_model(value: str) -> tuple[str, str]:
    """``--model NAME=PATH_OR_HF_ID`` (or a hub id or path that is its own name)."""
    name, sep, source = value.partition("=")
    if not sep:
        return value, value
    if not name or not source:
        raise argparse.ArgumentTypeError(f"--model expects NAME=PATH_OR_HF_ID, got {value!r}")
    return name, source


def parse_tokenizer_id(value: str) -> tuple[str, str]:
    name, sep, tokenizer = value.partition("=")
    if not sep or not name or not tokenizer:
        raise argparse.ArgumentTypeError(f"--tokenizer-id expects NAME=HUB_ID_OR_PATH, got {value!r}")
    return name, tokenizer


@dataclass
class ServeOptions:
    """What the worker serves, to whom, and where it listens and keeps its files."""

    GROUP = "serve"

    model: list = setting([], "a base model to serve (repeatable)", parse=parse_model, metavar="NAME=PATH_OR_HF_ID")
    tokenizer_id: list = setting([], "what clients load the served model NAME's tokenizer from (a hub id or a folder "
                                     "on the client's machine); repeatable", parse=parse_tokenizer_id,
                                 metavar="NAME=ID", shown="the hub id or the folder NAME was served from")
    lazy_models: bool = setting(False, "also load a model a client names, on first use (used by the embedded "
                                       "worker); with API keys, only the names --lazy-model-allow allows")
    lazy_model_allow: list = setting([], "a hub id or folder --lazy-models may load, as a shell pattern "
                                         "('HuggingFaceTB/*', '/models/*'; a folder is matched by its real path "
                                         "too); repeatable; '*' allows any", metavar="PATTERN")
    host: str = setting("127.0.0.1", "address to listen on (a non-loopback one needs API keys, or --insecure)",
                        metavar="ADDRESS")
    port: int = setting(8000, "port to listen on; 0 picks a free port", minimum=0, maximum=65535, why="a TCP port",
                        metavar="PORT")
    port_file: str | None = setting(None, "write the bound port here once listening", metavar="PATH")
    api_key: list = setting([], "accepted API key (repeatable; each key is its own tenant). Visible to every local "
                                "user in the process list: prefer --api-key-file or PYTRIO_WORKER_API_KEYS "
                                "(comma-separated)", metavar="KEY")
    api_key_file: list = setting([], "a file of accepted API keys, one per line ('#' starts a comment; after a key, "
                                     "tokens_per_minute=N sets its own token budget, weight=W its share of the "
                                     "model while several keys wait, default 1); repeatable", metavar="PATH")
    admin_key_file: list = setting([], "a file of operator keys, one per line: they read /metrics, the /console and "
                                       "traces, and are refused on tenant routes (also PYTRIO_WORKER_ADMIN_KEYS, "
                                       "comma-separated); without one, those routes answer 404 (docs/operations.md)",
                                   metavar="PATH")
    insecure: bool = setting(False, "allow a non-loopback bind without an API key")
    allowed_host: list = setting([], "also answer requests whose Host (or a browser's Origin) is NAME, e.g. the name "
                                     "a reverse proxy forwards; repeatable; '*' accepts any (the worker answers only "
                                     "localhost, loopback addresses and its bind address otherwise, against DNS "
                                     "rebinding)", metavar="NAME")
    device: str = setting("auto", "where the models run: auto picks cuda when a GPU is visible",
                          choices={"auto": "auto", "cpu": "cpu", "cuda": "cuda"})
    dtype: str = setting("auto", "the models' weights dtype: auto is bfloat16 on a GPU, float32 on the CPU",
                         choices={"auto": "auto", "float32": "float32", "bfloat16": "bfloat16"})
    storage: str = setting("./storage", "folder of checkpoints and (--durability full) the journal", metavar="PATH")
    threads: int = setting(0, "torch CPU threads (0: torch's default)", minimum=0, why="0: torch's default")
    allow_adapter_dir: list = setting([], "let clients sample from PEFT adapter folders under DIR "
                                          "(create_sampling_client(model_path=...)); repeatable", metavar="DIR")
    log_level: str = setting("INFO", "logging level of the worker's own messages (DEBUG, INFO, WARNING, ERROR)",
                             metavar="LEVEL")


@dataclass
class ClusterOptions:
    """Where the models run when not in this process: a Ray cluster (server_mock/cluster/)."""

    GROUP = "ray"

    ray: str | None = setting(None, "run the models on a Ray cluster: auto joins a running one or starts a local "
                                    "one, HOST:PORT joins that head node. Without it everything runs in this process",
                              metavar="auto|ADDRESS")
    sampler_replicas: int = setting(1, "actors that each hold the base model and sample", metavar="N")
    train_replicas: int = setting(1, "data-parallel ranks that train each run together, its batch split by tokens",
                                  metavar="N")
    trainer_groups: int = setting(1, "trainer groups of --train-replicas ranks; each run lives on the least loaded "
                                     "one", metavar="N")
    gpus_per_replica: float = setting(0.0, "GPUs for each sampler replica and train rank (0: they run on CPU)",
                                      metavar="N")
    cpus_per_replica: float = setting(1.0, "CPUs for each sampler replica and train rank (also its torch threads)",
                                      metavar="N")

    def without_ray(self) -> bool:
        """Whether every replica flag is at its default (as it must be without --ray)."""
        return all(getattr(self, f.name) == f.default for f in fields(self) if f.name != "ray")


@dataclass
class Limits:
    """Every limit is explicit; exceeding one is answered with 413/429 naming it."""

    GROUP = "limits"

    max_body_bytes: int = setting(64 * 1024 * 1024, "largest request body that carries tensors (native training "
                                                    "ops, Tinker forward_backward), in bytes", group="bodies")
    max_json_body_bytes: int = setting(4 * 1024 * 1024, "largest request body of every other route (JSON), in bytes",
                                       group="bodies")
    max_json_values: int = setting(1 << 16, "JSON values (numbers, strings, list items, object members) in one "
                                            "JSON request body (4x that in a body that carries tensors): parsing "
                                            "holds ~60 bytes and some microseconds for each, whatever its size, "
                                            "without letting go of the interpreter", group="bodies")
    max_zstd_ratio: int = setting(100, "how many times its compressed size a zstd body (Tinker routes) may expand "
                                       "to, beyond 1 MiB", minimum=1, why="a ratio", group="bodies")
    max_parsing_bytes: int = setting(256 * 1024 * 1024, "request bodies over 1 MiB parsed at once, all requests "
                                                        "together: their bytes plus 64 per JSON value (others wait)",
                                     minimum=1, why="a budget of bytes", group="bodies")
    # bodies being received (api/body_budget.py): a Content-Length is counted when the headers arrive, before a byte
    # of the body; nothing is allocated for it until its bytes come
    max_body_bytes_in_flight: int = setting(1 << 30, "bytes of request bodies being received at once, all keys "
                                                     "together (a body's Content-Length is counted from its headers "
                                                     "on); past it, 429 + Retry-After", minimum=1,
                                            why="a budget of bytes", group="bodies")
    max_body_bytes_in_flight_per_tenant: int = setting(256 * 1024 * 1024, "bytes of request bodies one API key may "
                                                                          "have being received at once; past it, "
                                                                          "429 + Retry-After",
                                                       minimum=1, why="a budget of bytes", group="bodies")
    max_seq_len: int = setting(8192, "longest sequence (prompt + completion, or a datum), in tokens; the model's own "
                                     "context caps it", group="training")
    max_tokens_per_request: int = setting(262_144, "tokens in one forward/backward request, all datums together",
                                          group="training")
    max_datums_per_request: int = setting(4096, "datums in one forward/backward request or PyTRIO training event, "
                                                "every protocol (the PyTRIO SDK is told to split its calls into "
                                                "events of at most this many)", minimum=1,
                                          why="a count of datums", group="training")
    max_sample_tokens: int = setting(8192, "max_tokens of one sample request", group="sampling")
    max_sample_request_tokens: int = setting(262_144, "num_samples x (prompt + max_tokens) of one sample request: "
                                                      "how long it may hold the model", group="sampling")
    max_num_samples: int = setting(256, "num_samples of one sample request", group="sampling")
    max_training_runs: int = setting(64, "training runs per API key", group="tenants")
    max_adapters: int = setting(256, "training runs on this worker, all keys together", group="tenants")
    max_queued_requests: int = setting(1024, "training ops and samples queued or running, per API key (more get 429 "
                                             "+ Retry-After)", group="tenants")
    max_pending_forward_ops: int = setting(128, "forward and forward_backward ops one training run may take after "
                                                "its last optim_step or load_state (their payloads are journaled "
                                                "and run again after a restart); more get 409 until it steps",
                                           minimum=1, group="training")
    max_samplers: int = setting(1024, "sampling clients kept per API key (its least recently used dropped first)",
                                group="sampling")
    max_snapshots: int = setting(16, "in-memory sampler snapshots kept per API key "
                                     "(save_weights_and_get_sampling_client); its least recently used dropped first",
                                 group="sampling")
    max_lora_rank: int = setting(128, "largest LoRA rank a run may ask for", group="training")
    # a run's adapter memory: LoRA weights, their gradients and AdamW's two moments, all float32 (16 bytes a parameter)
    max_adapter_bytes: int = setting(0, "memory the training runs of one API key may hold (LoRA weights, gradients, "
                                        "AdamW moments: 16 bytes a parameter, from the model's layout); 0: a quarter "
                                        "of --max-adapter-bytes-total", minimum=0, why="0 is the default",
                                     group="tenants")
    max_adapter_bytes_total: int = setting(0, "memory the training runs of all keys and the sampler adapters "
                                              "resident in the adapter pools (the sampler replicas' too, with "
                                              "--ray) may hold together (pool entries are "
                                              "evicted first); 0: half of the device's memory (the GPU's, or RAM "
                                              "on the CPU)", minimum=0,
                                           why="0 is the default", group="tenants")
    # requests of different tenants decoded as one batch would let each see the other's traffic (batch_requests,
    # timings, the last bits of seeded logprobs); batching them is faster when many tenants sample one base model
    batch_across_tenants: bool = setting(False, "decode sample requests of different API keys for the same weights "
                                                "as one batch: more throughput when many keys sample a base model, "
                                                "but each then sees the others' traffic in its answers",
                                         group="sampling")
    max_long_polls_per_tenant: int = setting(256, "long polls one API key may hold open at once (Tinker "
                                                  "retrieve_future, native wait=, PyTRIO Prefer: wait=); its next "
                                                  "one ends its oldest at once with the protocol's 'not ready, poll "
                                                  "again' answer", minimum=1, why="a count of polls", group="tenants")
    max_result_bytes: int = setting(1 << 30, "bytes of finished results (native requests, Tinker futures; PyTRIO "
                                             "event and sample answers counted apart) kept for polling per API key; "
                                             "past it its oldest are dropped", minimum=1,
                                    why="a budget of bytes", group="storage")
    # Checked against every generated token, so bounded: OpenAI takes 4 stop strings, vLLM and SGLang
    # take any number but real requests carry a handful of short ones.
    max_stop_strings: int = setting(16, "stop strings per sample request", group="sampling")
    max_stop_string_bytes: int = setting(256, "UTF-8 bytes of one stop string", group="sampling")
    # checked per token; clients send a few, or a few hundred (a class of ids)
    max_stop_token_ids: int = setting(1024, "stop token ids per sample request", group="sampling")
    # a long decode yields the model to the next waiting tenant after this long (engine/queue.py)
    decode_slice_seconds: float = setting(0.5, "seconds a decode batch runs before the next tenant waiting for the "
                                               "model takes its turn (the batch resumes after it); requests for the "
                                               "same weights join the batch between steps", minimum=0.001,
                                          metavar="S", group="sampling")
    # images (engine/images.py): the bytes bound what a client may send, the pixels what decoding may allocate
    # (checked from the file's header before any pixel is decoded), the count how many decodes one request buys
    max_image_bytes: int = setting(10 * 1024 * 1024, "bytes of one image (PNG or JPEG file)", group="bodies")
    max_image_pixels: int = setting(4096 * 4096, "width x height of one image, read from its header before decoding "
                                                 "(a decompression bomb is refused unread)", group="bodies")
    max_images_per_request: int = setting(256, "image chunks in one sample or forward/backward request, all datums "
                                               "together (identical images are decoded once)", group="training")
    max_decoded_image_bytes: int = setting(256 * 1024 * 1024, "bytes the distinct images of one request decode to "
                                                              "together (width x height x 3 each, read from their "
                                                              "headers before any is decoded)",
                                           minimum=1, why="a budget of bytes", group="training")
    # soft-target cross-entropy: target_tokens / weights of shape [N, K] (top-K distillation sends K ~ 20)
    max_target_k: int = setting(1024, "K, the targets per position of soft-target cross-entropy ([N, K] inputs)",
                                group="training")
    max_target_cells: int = setting(4_194_304, "soft-target cells (N x K, all datums together) in one "
                                               "forward/backward request", group="training")
    # stable_reinforce: what the sampler records per returned sequence when asked (record_stability_info)
    max_recorded_sequences: int = setting(65_536, "sampled sequences whose stability records are kept per API key "
                                                  "(least recently used dropped first)", group="tenants")
    max_recorded_tokens: int = setting(16_777_216, "tokens (prompts once per request, plus sampled tokens) held in "
                                                   "stability records per API key (least recently used dropped "
                                                   "first)", group="tenants")
    checkpoint_sweep_seconds: float = setting(60.0, "how often expired checkpoints (ttl_seconds) are deleted from "
                                                    "disk, in seconds; they answer 404 from their expiry on",
                                              minimum=0.05, why="the sweeper's own tick", group="storage")
    recorded_sequence_ttl: float = setting(86_400.0, "seconds a stability record is kept after its last use "
                                                     "(sampling, or a training request naming it)", group="tenants")

    # a checkpoint archive streams a tar of the adapter files to a temporary file: bounded so that downloads
    # never hold more than this many copies being written at once (more answer 429 + Retry-After)
    max_archive_builds: int = setting(2, "checkpoint archives built at once, all keys together", minimum=1,
                                      why="0 would refuse every download", group="storage")
    download_url_seconds: int = setting(3600, "lifetime of a signed download URL, in seconds",
                                        minimum=60, why="a URL must outlive its own transfer", group="storage")
    # service/rate_limits.py: a bucket per key, refilled continuously; a key's own budget may be set in its keys file
    tokens_per_minute: int = setting(0, "tokens one API key may use a minute (datums trained or run forward, sample "
                                        "prompts plus num_samples x max_tokens, the unused part given back); past "
                                        "it, 429 with Retry-After. 0: no limit", minimum=0, why="0: no limit",
                                     metavar="N", group="tenants")

@dataclass
class TinkerOptions:
    """The Tinker protocol (server_mock/api/tinker/, docs/tinker.md): how many sessions a key keeps open, how long
    one lives without a heartbeat, and what the requests waiting for their turn may hold."""

    GROUP = "tinker"

    tinker_max_sessions: int = setting(256, "open Tinker sessions per API key (more get 429)", minimum=1,
                                       why="a count of sessions", metavar="N")
    tinker_session_ttl: float = setting(1800.0, "seconds a Tinker session without a heartbeat or a request is kept "
                                                "(the SDK beats every 10 s while its client lives); then it is "
                                                "finished and its training models deleted (checkpoints stay)",
                                        minimum=60, why="the SDK beats every 10 s", metavar="S")
    tinker_max_creations: int = setting(1024, "training models and sampling sessions one Tinker session may create, "
                                              "each", minimum=1, why="a count", metavar="N")
    tinker_max_seq_ahead: int = setting(1024, "how far past a training model's next expected seq_id a Tinker request "
                                              "may be (it waits for the ones before it)", minimum=1,
                                        why="the next request must be accepted", metavar="N")
    tinker_waiting_bodies_per_session: int = setting(4, "out-of-order Tinker requests of one session hold at most N x "
                                                        "--max-body-bytes while they wait", minimum=1,
                                                     why="one body must fit", metavar="N")
    tinker_waiting_bodies: int = setting(16, "out-of-order Tinker requests of the whole worker hold at most N x "
                                             "--max-body-bytes while they wait", minimum=1, why="one body must fit",
                                         metavar="N")
    tinker_implicit_samplers: int = setting(16, "samplers kept per API key for Tinker asample calls that name no "
                                                "sampling session (the least recently used dropped first)",
                                            minimum=1, why="a count", metavar="N")
    tinker_sample_ids: int = setting(20_000, "(sampler, seq_id) pairs remembered per API key to answer re-sent "
                                             "Tinker asample requests", minimum=1, why="a count", metavar="N")


@dataclass
class PytrioOptions:
    """The PyTRIO protocol (server_mock/api/pytrio/, docs/pytrio.md): the limits its Control plane hands the
    official ``pytrio`` SDK, and how long its sessions, runs, tokens and event answers live."""

    GROUP = "pytrio"

    # The SDK splits one forward_backward call into Actor events of at most these sizes (0: no limit sent, no split).
    pytrio_max_batch_size: int = setting(0, "datums per PyTRIO training event: the SDK splits a call into events of at "
                                            "most N datums (0: the worker's --max-datums-per-request)", minimum=0,
                                         why="0: --max-datums-per-request", metavar="N")
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

    GROUP = "storage"

    result_ttl: float = setting(3600.0, "seconds a finished request's result is kept for polling", minimum=0.001,
                                why="a result must be kept to be polled")

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

    GROUP = "bodies"

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

    GROUP = "model"

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
    # prompt prefixes' KV caches kept across sample requests (sampling/prefix_store.py); full-attention models only
    prefix_cache_bytes: int = setting(256 * 1024 ** 2, "bytes of prompt-prefix KV caches kept across sample "
                                                       "requests: a prefix many prompts share (a few-shot "
                                                       "conversation) is prefilled once per weights and the rest of "
                                                       "each prompt against a copy of it (least recently used "
                                                       "evicted first; full-attention models only, found at load; "
                                                       "not with --batch-invariant); 0 prefills every prompt whole",
                                      minimum=0, why="0 turns prefix reuse off", metavar="BYTES")
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
                                           "are unchanged. 0 disables", minimum=0,
                                           why="0 disables prefix sharing", metavar="N")
