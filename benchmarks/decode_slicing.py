"""Tenant B's short sample behind tenant A's long one: the latency B sees with decode slicing (the default,
``--decode-slice-seconds 0.5``) and without it (a slice longer than A's request, which is what the worker did
before slicing), on the tiny model, two API keys, one thread.

A's request is the red-team's: 64 samples of 1000 tokens from the base model, never stopping. B samples 4 tokens
(2 rows) from its own trained weights, so it cannot join A's batch and must wait for a turn; and, separately,
from the base model, so it joins A's running batch (when within the token budget: 64 x 1004 tokens is not,
so it too takes a turn). Each B request is sent once A's request is running; B alone is timed first.

    python benchmarks/decode_slicing.py [--rows 64] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import median, save  # noqa: E402
from benchmarks.load_test import LocalWorker  # noqa: E402

KEY_A, KEY_B = "bench-tenant-a", "bench-tenant-b"
SHORT = {"prompt_tokens": [9, 10, 11], "num_samples": 2, "sampling_params": {"max_tokens": 4, "seed": 3}}


def _done(http: httpx.Client, request_id: str) -> dict:
    while True:
        reply = http.get(f"/v1/requests/{request_id}", params={"wait": 60}).json()
        if reply["status"] in ("succeeded", "failed"):
            return reply


def measure(slice_seconds: float, rows: int, tokens: int, repeats: int) -> dict:
    worker = LocalWorker(1, ("--api-key", KEY_A, "--api-key", KEY_B, "--decode-slice-seconds", str(slice_seconds)))
    try:
        a = httpx.Client(base_url=worker.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120)
        b = httpx.Client(base_url=worker.base_url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=120)
        run = b.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).json()["training_run_id"]
        op = {"seq_id": 1, "payload": {"op": "save_weights_for_sampler", "name": "w"}}
        path = _done(b, b.post(f"/v1/training_runs/{run}/ops", json=op).json()["request_id"])["result"]["path"]
        samplers = {"own weights": b.post("/v1/samplers", json={"model_path": path}).json()["sampler_id"],
                    "base model": b.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]}
        a_sampler = a.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
        out: dict = {}
        for name, sampler in samplers.items():
            alone, behind = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                _done(b, b.post(f"/v1/samplers/{sampler}/sample", json=SHORT).json()["request_id"])
                alone.append(time.perf_counter() - start)
            for i in range(repeats):
                body = {"prompt_tokens": [5, 6, 7, 8], "num_samples": rows,
                        "sampling_params": {"max_tokens": tokens, "stop": [], "seed": i}}
                a_id = a.post(f"/v1/samplers/{a_sampler}/sample", json=body).json()["request_id"]
                while a.get(f"/v1/requests/{a_id}").json()["status"] != "running":
                    time.sleep(0.01)
                time.sleep(0.3)  # A is well into its decode
                start = time.perf_counter()
                _done(b, b.post(f"/v1/samplers/{sampler}/sample", json=SHORT).json()["request_id"])
                behind.append(time.perf_counter() - start)
                a_start = time.perf_counter()
                _done(a, a_id)
                behind_a = time.perf_counter() - a_start
            out[name] = {"alone_s": median(alone), "behind_a_s": median(behind), "runs_behind": behind,
                         "a_left_after_b_s": behind_a}
            print({slice_seconds: {name: out[name]}}, flush=True)
        return out
    finally:
        worker.stop()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    sliced = measure(0.5, args.rows, args.tokens, args.repeats)
    unsliced = measure(1e6, args.rows, args.tokens, args.repeats)
    result = {"rows": args.rows, "tokens": args.tokens, "sliced": sliced, "one_slice_per_request": unsliced,
              "wait_ratio": {k: unsliced[k]["behind_a_s"] / sliced[k]["behind_a_s"] for k in sliced}}
    save("decode_slicing", result)
    return result


if __name__ == "__main__":
    main()
