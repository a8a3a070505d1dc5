"""Many LoRA runs sampling one base model, end to end: through the ``pytrio_compat`` SDK over HTTP to a worker in
its own process, started with default flags (the acceptance check of mixed-adapter decode batches).

A worker serves SmolLM2-135M (float32 on the CPU, its default). One API key makes 8 LoRA runs; each takes one
AdamW step on its own random datums and opens a sampler on its weights (``save_weights_and_get_sampling_client``).
Each run asks for 8 rows x 32 tokens at temperature 0 from the same 48-token prompt. "Solo": the 8 requests sent
one after another, each waiting for the one before (the sum of their times); "together": all 8 sent at once (the
time until the last answer). Every run's tokens together must equal its solo tokens and its logprobs agree within
``--tolerance``. A warm-up sends all 8 at once first (each adapter's first load into the worker's adapter pool,
timed apart); then rounds alternate solo and together, so the machine's load hits both alike.

Also reported per round: the worker's own timings of each answer (``time/load_weights``, ``time/prefill``,
``time/decode``, ``batch_requests``), so the client-side time splits into what the worker spent where and the rest
(HTTP, encoding, queueing).

    python benchmarks/multi_lora_sdk.py [--runs 8] [--rows 8] [--tokens 32] [--prompt-tokens 48] [--rounds 2]
                                        [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--worker-flag=--threads=1 ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import SMOLLM2, save  # noqa: E402

KEY = "multi-lora-sdk-key"
MODEL = "smol"


def start_worker(model: str, storage: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``python -m server_mock serve`` with the default flags (only the model, port, storage and key given)."""
    import httpx

    port_file = storage.parent / "port"
    log = open(storage.parent / "worker.log", "ab")
    cmd = [sys.executable, "-m", "server_mock", "serve", "--model", f"{MODEL}={model}", "--port", "0",
           "--port-file", str(port_file), "--storage", str(storage), "--api-key", KEY, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600  # the first start converts SmolLM2's GGUF once
    while not (port_file.exists() and port_file.read_text().strip()):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("worker did not start: " + (storage.parent / "worker.log").read_text()[-3000:])
        time.sleep(0.1)
    base_url = f"http://127.0.0.1:{int(port_file.read_text())}"
    while True:
        try:
            httpx.get(base_url + "/v1/health", timeout=1)
            return process, base_url
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def trained_samplers(trio, service, runs: int, rank: int, vocab: int) -> list:
    """``runs`` LoRA runs, each after one AdamW step on its own random datums; a sampler of each."""
    import numpy as np

    samplers = []
    for i in range(runs):
        rng = np.random.default_rng(100 + i)
        tc = service.create_lora_training_client(MODEL, rank=rank, seed=i)
        datums = []
        for _ in range(4):
            ids = rng.integers(3, vocab, size=33).tolist()
            datums.append(trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                                     loss_fn_inputs={"target_tokens": ids[1:]}))
        fb = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(trio.AdamParams(learning_rate=1e-3))
        fb.result(), opt.result()
        samplers.append(tc.save_weights_and_get_sampling_client())
    return samplers


def _answer(response, seconds: float) -> dict:
    return {"seconds": seconds, "tokens": [list(s.tokens) for s in response.sequences],
            "logprobs": [list(s.logprobs) for s in response.sequences],
            "metrics": dict(getattr(response, "metrics", None) or {})}


def solo(trio, samplers, prompt, params, rows) -> list[dict]:
    out = []
    for sampler in samplers:
        started = time.perf_counter()
        response = sampler.sample(trio.ModelInput.from_ints(prompt), rows, params).result()
        out.append(_answer(response, time.perf_counter() - started))
    return out


def together(trio, samplers, prompt, params, rows) -> tuple[float, list[dict]]:
    started = time.perf_counter()
    futures = [sampler.sample(trio.ModelInput.from_ints(prompt), rows, params) for sampler in samplers]
    with ThreadPoolExecutor(len(futures)) as pool:  # each answer's own arrival time
        def wait(future):
            response = future.result()
            return response, time.perf_counter() - started
        answers = [_answer(*done) for done in pool.map(wait, futures)]
    return time.perf_counter() - started, answers


def compare(solo_answers: list[dict], mixed_answers: list[dict]) -> dict:
    tokens_equal, worst = True, 0.0
    for a, b in zip(solo_answers, mixed_answers):
        tokens_equal &= a["tokens"] == b["tokens"]
        for la, lb in zip(a["logprobs"], b["logprobs"]):
            if len(la) == len(lb):
                worst = max([worst, *(abs(x - y) for x, y in zip(la, lb))])
            else:
                worst = float("inf")
    return {"tokens_equal": bool(tokens_equal), "max_logprob_diff": worst}


def _timings(answers: list[dict]) -> dict:
    def total(name):
        return sum(a["metrics"].get(name, 0.0) for a in answers)
    return {"client_s": [round(a["seconds"], 3) for a in answers],
            "batch_requests": [a["metrics"].get("batch_requests") for a in answers],
            "load_weights_s_sum": total("time/load_weights"), "prefill_s_sum": total("time/prefill"),
            "decode_s": [round(a["metrics"].get("time/decode", 0.0), 3) for a in answers],
            "output_tokens": sum(len(t) for a in answers for t in a["tokens"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=32, help="the SDK's default LoRA rank")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--target", type=float, default=2.5)
    parser.add_argument("--worker-flag", action="append", default=[],
                        help="an extra serve flag (repeatable; the acceptance run uses none)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np

    import pytrio_compat as trio

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="multi-lora-sdk-") as tmp:
        process, base_url = start_worker(args.model, Path(tmp) / "storage", args.worker_flag)
        service = trio.ServiceClient(api_key=KEY, base_url=base_url)
        try:
            vocab = len(service.create_sampling_client(base_model=MODEL).get_tokenizer())
            samplers = trained_samplers(trio, service, args.runs, args.rank, vocab)
            prompt = np.random.default_rng(7).integers(3, vocab, size=args.prompt_tokens).tolist()
            params = trio.SamplingParams(max_tokens=args.tokens, temperature=0.0, stop=[])
            print(f"{time.perf_counter() - began:.0f}s set up: {args.runs} runs trained", flush=True)
            warm_s, warm = together(trio, samplers, prompt, params, args.rows)  # every run's adapter into the pool
            warm_up = {"together_s": warm_s, **_timings(warm)}
            print(f"warm-up (the adapters' first load into the pool): together {warm_s:.2f} s", warm_up, flush=True)
            rounds = []
            for r in range(args.rounds):
                solo_answers = solo(trio, samplers, prompt, params, args.rows)
                wall, mixed_answers = together(trio, samplers, prompt, params, args.rows)
                solo_sum = sum(a["seconds"] for a in solo_answers)
                row = {"round": r, "solo_sum_s": solo_sum, "together_s": wall, "speedup": solo_sum / wall,
                       **compare(solo_answers, mixed_answers), "load_average": os.getloadavg(),
                       "solo": _timings(solo_answers), "together": _timings(mixed_answers)}
                rounds.append(row)
                print(f"round {r}: solo sum {solo_sum:.2f} s, together {wall:.2f} s, {row['speedup']:.2f}x, tokens "
                      f"equal {row['tokens_equal']}, max |dlogprob| {row['max_logprob_diff']:.2e}, load "
                      f"{row['load_average'][0]:.2f}", flush=True)
                print("  solo", row["solo"], "\n  together", row["together"], flush=True)
        finally:
            service.close()
            process.terminate()
            process.wait(30)
    best = max(rounds, key=lambda row: row["speedup"])
    payload = {"model": args.model, "runs": args.runs, "rows": args.rows, "tokens": args.tokens,
               "prompt_tokens": args.prompt_tokens, "rank": args.rank, "worker_flags": args.worker_flag,
               "warm_up": warm_up, "rounds": rounds, "best_speedup": best["speedup"], "target": args.target,
               "all_exact": all(r["tokens_equal"] and r["max_logprob_diff"] <= args.tolerance for r in rounds)}
    save("multi_lora_sdk", payload)
    print(f"best {best['speedup']:.2f}x (target {args.target}x); every round exact: {payload['all_exact']}")


if __name__ == "__main__":
    main()
