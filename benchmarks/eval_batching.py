"""One greedy held-out evaluation of the CPU demo, with and without reusing the prompts' shared prefix (the worker's
prefix store, sampling/prefix_store.py), at the SDK's default in-flight limit (16 sample calls per sampler) and at
higher ones (256: every prompt at once), back to back on one worker in this process.

Reports the seconds of each run, their ratio to the first, whether every problem got the first run's greedy tokens
(so the same accuracy to the last problem), and where the worker's decode time went (prefill of whole prompts, of
shared prefixes, of the rest of each prompt, copies of a stored prefix, stacking a joining request under the running
batch, decode steps), with the prefix store's counters. The sampler is the demo's step-0 snapshot
(SmolLM2-135M-Instruct, LoRA rank 16 on attention, MLP and the output head, seed 0). The worker runs on a thread
of this process (the CLI's own server), so that each run switches its model's prefix store on or off.

    python benchmarks/eval_batching.py [--problems 200] [--runs off:16,on:16,on:64,on:256]
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))
from benchmarks.common import SMOLLM2, save  # noqa: E402


def _start_worker(storage: str):
    """The CLI's server on a thread of this process; (server, base URL, API key)."""
    from server_mock.cli import build_parser, build_server

    key = secrets.token_hex(16)
    os.environ["PYTRIO_WORKER_API_KEYS"] = key
    args = build_parser().parse_args(["serve", "--lazy-models", "--lazy-model-allow", "*", "--host", "127.0.0.1",
                                      "--port", "0", "--storage", storage])
    server, sock = build_server(args)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the worker did not start")
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}", key


def main(argv=None) -> dict:
    import grpo_eval
    from grpo_data import load_rows
    from grpo_prompts import PROMPTS

    import pytrio_compat as trio
    from server_mock.sampling.prefix_store import PrefixStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--runs", default="off:16,on:16",
                        help="comma-separated prefix-reuse:in-flight runs (off or on : sampling_request_max_in_flight);"
                             " the first is the baseline")
    parser.add_argument("--prefix-cache-bytes", type=int, default=256 * 1024 ** 2)
    parser.add_argument("--name", default="eval_batching", help="the results file's name under benchmarks/results")
    args = parser.parse_args(argv)
    plan = [(mode, int(limit)) for mode, limit in (item.split(":") for item in args.runs.split(",") if item)]

    rows = load_rows("arithmetic", "test", n=args.problems)
    fewshot, suffix = PROMPTS["arithmetic"]
    server, base_url, key = _start_worker(tempfile.mkdtemp(prefix="eval-batching-"))
    service = server.config.app.state.service
    runs = []
    try:
        reference = None
        for mode, limit in plan:
            trio.configure(sampling_request_max_in_flight=limit)
            client = trio.ServiceClient(base_url=base_url, api_key=key)
            training = client.create_lora_training_client(base_model=args.model, rank=16, seed=0,
                                                          train_unembed=True)
            tokenizer = training.get_tokenizer()
            sampler = training.save_weights_and_get_sampling_client()
            host = service.models.loaded(args.model)
            if reference is None:  # load the model and warm the decode path before the first timed run
                host.prefix_store = None
                grpo_eval.greedy_results(sampler, tokenizer, rows[:4], args.max_tokens, fewshot, suffix)
            store = PrefixStore(args.prefix_cache_bytes) if mode == "on" else None
            host.prefix_store, host.decode_profile = store, {}
            started = time.perf_counter()
            results = grpo_eval.greedy_results(sampler, tokenizer, rows, args.max_tokens, fewshot, suffix)
            seconds = time.perf_counter() - started
            profile, host.decode_profile = host.decode_profile, None
            tokens = [list(r.sequences[0].tokens) for r in results]
            accuracy = grpo_eval.accuracy(tokenizer, results, rows, grpo_eval.EVAL_GRADERS["arithmetic"])
            if reference is None:
                reference = tokens
            same = sum(a == b for a, b in zip(tokens, reference))
            prefill = sum(r.metrics.get("time/prefill", 0.0) for r in results)  # each request's own prefill
            run = {"prefix_reuse": mode, "in_flight": limit, "seconds": seconds, "accuracy": accuracy,
                   "same_tokens": same, "prefill_seconds_per_request_summed": prefill,
                   "profile": {k: round(v, 3) for k, v in sorted(profile.items())},
                   "prefix_store": store.stats.as_dict() if store else None,
                   "prefix_store_bytes": store.bytes if store else 0}
            runs.append(run)
            print(f"prefix reuse {mode}, in flight {limit}: {seconds:.1f}s, accuracy {accuracy:.3f}, "
                  f"{same}/{len(rows)} problems with the baseline's tokens; worker phases "
                  f"{run['profile']}; store {run['prefix_store']}", flush=True)
            client.close()
    finally:
        server.should_exit = True
    base = runs[0]["seconds"]
    payload = {"problems": args.problems, "max_tokens": args.max_tokens, "runs": runs,
               "ratios": {f"{r['prefix_reuse']}:{r['in_flight']}": r["seconds"] / base for r in runs},
               "load_average": os.getloadavg()}
    save(args.name, payload)
    return payload


if __name__ == "__main__":
    main()
