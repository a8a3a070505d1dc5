"""``pytrio-worker`` (or ``python -m server_mock``): serve models, or write a tiny model for smoke tests."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
import warnings
from pathlib import Path

from pytrio_compat.export import cli as export_cli
from server_mock.allocator import describe as describe_allocator
from server_mock.allocator import restart_with_allocator
from server_mock.config import (
    ClusterOptions,
    Connections,
    Limits,
    PytrioOptions,
    ServeOptions,
    StorageOptions,
    TinkerOptions,
    TrainOptions,
    parse_model,
)
from server_mock.errors import WorkerError
from server_mock.flags import add_flags, add_sections, from_args

FILES_RESERVED = 128  # open files the worker keeps for itself (models, checkpoints, pipes) beside connections

# every serve flag, declared in config.py (each class's flags under their groups)
SERVE_OPTIONS = (ServeOptions, Limits, Connections, StorageOptions, TinkerOptions, PytrioOptions, TrainOptions,
                 ClusterOptions)

TEXT_TINY_ARCHS = ("qwen2", "llama")
VISION_TINY_ARCHS = ("qwen3_5", "qwen3_vl", "qwen2_5_vl", "gemma3", "llava")  # engine.tiny_vlm.TINY_VLM_FAMILIES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pytrio-worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP worker",
                           description="Serve models over the native, Tinker, OpenAI and PyTRIO protocols. Every "
                                       "flag is declared in server_mock/config.py; its default ends its help. The "
                                       "process runs on tcmalloc where it is installed "
                                       "(PYTRIO_WORKER_ALLOCATOR=system: glibc's malloc; docs/operations.md).")
    add_sections(serve)
    for options in SERVE_OPTIONS:
        add_flags(serve, options)
    export = sub.add_parser("export", help="merge a saved checkpoint into its base model (a Hugging Face model "
                                           "folder) and optionally write a GGUF",
                            description="Merge a checkpoint's LoRA into its base model: a full Hugging Face model "
                                        "folder that computes what the worker computes with the adapter.")
    export_cli.add_arguments(export, "a trio:// checkpoint path (found in --storage), a checkpoint folder, or a "
                                     "checkpoint archive (.tar)")
    export.add_argument("--storage", default="./storage", help="the worker's checkpoint folder (for trio:// paths)")
    export.add_argument("--model", action="append", type=parse_model, default=[], metavar="NAME=PATH_OR_HF_ID",
                        help="where the base model a checkpoint names is, as for serve (repeatable)")
    tiny = sub.add_parser("make-tiny-model", help="write a random tiny causal LM + tokenizer for smoke tests")
    tiny.add_argument("directory")
    tiny.add_argument("--arch", choices=[*TEXT_TINY_ARCHS, *VISION_TINY_ARCHS],
                      help=f"the family: {', '.join(TEXT_TINY_ARCHS)} (default {TEXT_TINY_ARCHS[0]}), or with --vision "
                           f"{', '.join(VISION_TINY_ARCHS)} (default {VISION_TINY_ARCHS[0]})")
    tiny.add_argument("--vision", action="store_true",
                      help="a vision-language model: its tokenizer has the image tokens, its image processor is saved "
                           "beside it")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_key_file(path: str, flag: str = "--api-key-file",
                  settings_allowed: bool = True) -> list[tuple[str, dict[str, float]]]:
    """The keys in a file with their settings (``api.auth.parse_key_lines``). Exits naming the file if it cannot be
    read; warns if other users may read it."""
    from server_mock.api.auth import parse_key_lines

    try:
        text = Path(path).read_text()
        mode = os.stat(path).st_mode
        keys = parse_key_lines(text, f"{flag} {path}", settings_allowed)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        sys.exit(f"{flag} {path}: {exc}" if not isinstance(exc, ValueError) else str(exc))
    if mode & 0o077:
        logging.getLogger("server_mock").warning("%s %s can be read by other users (mode %o): chmod 600 it", flag,
                                                 path, mode & 0o777)
    if not keys:
        sys.exit(f"{flag} {path}: holds no keys")
    return keys


def check_limits(limits: Limits) -> str | None:
    """Why these limits cannot be served (a limit past the request shapes' structural bounds), or None."""
    from pytrio_compat.wire import MAX_ITEMS, MAX_TOKENS

    for name, bound in (("max_seq_len", MAX_TOKENS), ("max_stop_strings", MAX_ITEMS),
                        ("max_stop_token_ids", MAX_ITEMS)):
        if getattr(limits, name) > bound:
            return (f"--{name.replace('_', '-')} must be <= {bound}: request bodies hold at most {bound} items in "
                    "one list (pytrio_compat/types/bounds.py)")
    if min(limits.max_body_bytes_in_flight, limits.max_body_bytes_in_flight_per_tenant) < limits.max_body_bytes:
        return ("--max-body-bytes-in-flight and --max-body-bytes-in-flight-per-tenant must be >= --max-body-bytes: "
                "a body of the largest size allowed must fit in the budget of bodies being received")
    if limits.download_url_seconds > 7 * 24 * 3600:
        return "--download-url-seconds must be at most 604800 (7 days): a signed URL is a bearer capability"
    return None


def serve(args: argparse.Namespace) -> None:
    server, sock = build_server(args)
    logging.getLogger("server_mock").info(describe_allocator())
    server.run(sockets=[sock])


def build_server(args: argparse.Namespace):
    """Everything ``serve`` does before it answers: keys, limits, the service and its app, bound to its socket
    (written to --port-file). The uvicorn server and the socket, for ``server.run(sockets=[sock])``; exits naming
    the problem on a bad flag."""
    keys = list(args.api_key) + [k for k in os.environ.get("PYTRIO_WORKER_API_KEYS", "").split(",") if k]
    key_budgets, key_weights = {}, {}  # key -> its own tokens_per_minute, its weight in the fair share
    for path in args.api_key_file:
        for key, settings in read_key_file(path):
            keys.append(key)
            if "tokens_per_minute" in settings:
                key_budgets[key] = settings["tokens_per_minute"]
            if "weight" in settings:
                key_weights[key] = settings["weight"]
    admin_keys = [k for k in os.environ.get("PYTRIO_WORKER_ADMIN_KEYS", "").split(",") if k]
    for path in args.admin_key_file:
        admin_keys += [key for key, _ in read_key_file(path, "--admin-key-file", settings_allowed=False)]
    if set(keys) & set(admin_keys):
        sys.exit("a key is both an API key and an admin key: an operator key must not be a tenant's key")
    if not _is_loopback(args.host) and not keys and not args.insecure:
        sys.exit(f"refusing to listen on {args.host} without --api-key: anyone on the network could train and read "
                 "your adapters. Pass keys with --api-key-file PATH (or PYTRIO_WORKER_API_KEYS; --api-key KEY shows "
                 "them in the process list), or --insecure if you really mean it.")
    if not args.model and not args.lazy_models:
        sys.exit("nothing to serve: pass --model NAME=PATH_OR_HF_ID (or make one with `pytrio-worker make-tiny-model`)")
    if args.lazy_models and keys and not args.lazy_model_allow:
        sys.exit("--lazy-models with API keys needs --lazy-model-allow PATTERN: otherwise every key could load any "
                 "folder or hub model on this machine (and learn which folders exist); pass the hub ids or folders "
                 "clients may load, or '*' if every key may load anything")
    if args.lazy_model_allow and not args.lazy_models:
        sys.exit("--lazy-model-allow needs --lazy-models")

    import torch
    import uvicorn

    from server_mock.app import create_app
    from server_mock.engine.loading import resolve_device, resolve_dtype
    from server_mock.service.worker import WorkerService

    # Known, harmless library notices that would otherwise repeat on every adapter
    warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from_args(ServeOptions, args)  # its bounds (--port, --threads)
        cluster_options = from_args(ClusterOptions, args)
    except ValueError as exc:
        sys.exit(str(exc))
    if not args.ray and not cluster_options.without_ray():
        sys.exit("--sampler-replicas, --train-replicas, --trainer-groups, --gpus-per-replica and --cpus-per-replica "
                 "need --ray auto|ADDRESS")
    cluster = _join_cluster(args) if args.ray else None
    device = cluster.config.device if cluster is not None else resolve_device(args.device)
    try:
        limits, train_options = from_args(Limits, args), from_args(TrainOptions, args)
        connections = from_args(Connections, args)
        pytrio_options, tinker_options = from_args(PytrioOptions, args), from_args(TinkerOptions, args)
        storage_options = from_args(StorageOptions, args)
    except ValueError as exc:
        sys.exit(str(exc))
    problem = check_limits(limits)
    if problem:
        sys.exit(problem)
    unknown = sorted({name for name, _ in args.tokenizer_id} - {name for name, _ in args.model})
    if unknown:
        sys.exit(f"--tokenizer-id {unknown[0]}=...: no --model is served under that name")
    for folder in args.allow_adapter_dir:
        if not Path(folder).is_dir():
            sys.exit(f"--allow-adapter-dir {folder}: not a folder")
    service = WorkerService(dict(args.model), args.storage, device, resolve_dtype(args.dtype, device),
                            lazy_models=args.lazy_models, limits=limits, result_ttl=args.result_ttl,
                            allow_adapter_dirs=args.allow_adapter_dir,
                            train_options=train_options, cluster=cluster, tokenizer_ids=dict(args.tokenizer_id),
                            lazy_allow=args.lazy_model_allow, storage_options=storage_options)
    if service.fault_injection:
        logging.getLogger("server_mock").warning("fault injection is ON (PYTRIO_WORKER_FAULT_INJECTION): requests "
                                                 "may ask to fail on purpose; never use this in production")
    from server_mock.api.auth import tenant_id

    for key, budget in key_budgets.items():
        service.budgets.set(tenant_id(key), budget)
    for key, weight in key_weights.items():
        service.models.weights[tenant_id(key)] = weight
    app = create_app(service, keys, bind_host=args.host, allowed_hosts=args.allowed_host,
                     pytrio_options=pytrio_options, tinker_options=tinker_options, admin_keys=admin_keys)
    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]
    from server_mock.connections import ConnectionGuard, guarded_protocol

    guard = ConnectionGuard(connections, _room_for_connections(connections.max_connections))
    guard.relieve = app.state.long_polls.relieve  # held long polls end early rather than keep new clients out
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, http=guarded_protocol(guard))
    server = uvicorn.Server(config)
    if args.port_file:
        Path(args.port_file).write_text(str(port))
    logging.getLogger("server_mock").info("serving %s on http://%s:%d (storage %s, device %s)",
                                          ", ".join(n for n, _ in args.model) or "models on demand", args.host, port,
                                          args.storage, device)
    return server, sock


def _room_for_connections(wanted: int) -> int:
    """The connection cap that fits the open-file limit (raised toward what the cap needs, up to the hard limit):
    a worker out of file descriptors can no longer accept anyone, not even its health check."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FILES_RESERVED
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft - FILES_RESERVED >= wanted:
        return wanted
    fit = max(16, soft - FILES_RESERVED)
    logging.getLogger("server_mock").warning("--max-connections %d lowered to %d: the open-file limit is %d "
                                             "(raise it with ulimit -n)", wanted, fit, soft)
    return fit


def listening_socket(host: str, port: int) -> socket.socket:
    """The worker's listening socket. proto=IPPROTO_TCP (not 0) so that asyncio sets TCP_NODELAY on every accepted
    connection, and the listener has it too: otherwise Nagle holds each response body until the client's delayed
    ACK (~40 ms)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _join_cluster(args: argparse.Namespace):
    """The Ray cluster the models run on; exits naming the problem when it is unreachable or too small."""
    try:
        from server_mock.cluster import ClusterConfig, ClusterError, connect
    except ImportError as exc:
        sys.exit(f"--ray needs Ray: pip install -e '.[worker,cluster]' ({exc})")
    config = ClusterConfig(address=args.ray, sampler_replicas=args.sampler_replicas,
                           train_replicas=args.train_replicas, trainer_groups=args.trainer_groups,
                           gpus_per_replica=args.gpus_per_replica, cpus_per_replica=args.cpus_per_replica,
                           snapshots_per_replica=args.max_snapshots)
    try:
        return connect(config, args.storage, models=max(1, len(args.model)))
    except ClusterError as exc:
        sys.exit(f"--ray {args.ray}: {exc}")


def export(args: argparse.Namespace) -> int:
    """``pytrio-worker export``: the client's exporter, with trio:// paths and served model names resolved here."""
    from server_mock.engine.loading import resolve_source
    from server_mock.storage.checkpoints import CheckpointStore, parse_path

    models = dict(args.model)

    def adapter_folder(name: str) -> Path | None:
        if not name.startswith("trio://"):
            return None
        store = CheckpointStore(args.storage)
        ref = parse_path(name, "checkpoint")
        if not store.exists(ref):
            raise export_cli.ExportError(f"{name}: no such checkpoint in {args.storage} (pass --storage DIR)")
        return store.folder(ref)

    def resolve_base(name: str) -> Path:
        source = resolve_source(models.get(name, name))
        return Path(source) if Path(source).is_dir() else export_cli.hub_or_folder(source)

    try:
        return export_cli.run(args, adapter_folder, resolve_base)
    except WorkerError as exc:
        print(f"export: {exc.message}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "export":
        sys.exit(export(args))
    else:
        from server_mock.engine.tiny_model import make_tiny_model

        allowed = VISION_TINY_ARCHS if args.vision else TEXT_TINY_ARCHS
        if args.arch is not None and args.arch not in allowed:
            sys.exit(f"--arch {args.arch}: " + (f"with --vision, one of {', '.join(allowed)}" if args.vision
                                                else f"a vision-language family: pass --vision (text: "
                                                     f"{', '.join(allowed)})"))
        if args.vision:
            from server_mock.engine.tiny_vlm import make_tiny_vlm

            path = make_tiny_vlm(args.directory, arch=args.arch or VISION_TINY_ARCHS[0], seed=args.seed)
            print(f"wrote a tiny random vision-language model, tokenizer and image processor to {path}")
            return
        path = make_tiny_model(args.directory, arch=args.arch or TEXT_TINY_ARCHS[0], seed=args.seed)
        print(f"wrote a tiny random model and tokenizer to {path}")


def entry() -> None:
    """The ``pytrio-worker`` command and ``python -m server_mock``: the process starts itself again with tcmalloc
    preloaded where it is installed (server_mock/allocator.py), then runs ``main``."""
    restart_with_allocator()
    main()


if __name__ == "__main__":
    entry()
