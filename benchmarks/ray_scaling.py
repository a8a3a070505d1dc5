"""Scaling on Ray: sampling throughput of 2 sampler replicas x 1 thread against 1 process x 2 threads, and a
GRPO step with the sampler and the trainer on separate actors against both in one process.

Both workers are real HTTP workers driven through the SDK. The Ray one runs on a local cluster started here
(``ray.init``) with ``--sampler-replicas 2 --train-replicas 1 --cpus-per-replica 1``; the in-process one with
``--threads 2``. The sampling batch is the demo's: 4 prompts x 8 samples, sent as 4 concurrent requests.
A GRPO step samples that batch with the current weights, then runs forward_backward (importance sampling)
and optim_step on the 32 completions. "pipelined" overlaps the sampling of step k+1 with the training of
step k (one step off-policy), which only separate sampler and trainer processes can run at the same time.

    python benchmarks/ray_scaling.py [--model tiny|HuggingFaceTB/SmolLM2-135M-Instruct] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import SMOLLM2, few_shot_prompt, median, save  # noqa: E402

QUESTIONS = ["What is 36 + 47?", "What is 12 + 59?", "What is 64 + 18?", "What is 25 + 33?"]


def start_worker(model: str, folder: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port_file = folder / "port"
    log = open(folder / "worker.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "server_mock", "serve", "--model", f"m={model}", "--port", "0",
                             "--port-file", str(port_file), "--storage", str(folder / "storage"),
                             "--log-level", "WARNING", *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("worker did not start: " + (folder / "worker.log").read_text()[-3000:])
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def sample_round(trio, sampler, prompts: list[list[int]], max_tokens: int, seed: int) -> tuple[list, float]:
    started = time.perf_counter()
    futures = [sampler.sample(trio.ModelInput.from_ints(p), num_samples=8, sampling_params=trio.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed + i, stop=[])) for i, p in enumerate(prompts)]
    results = [f.result() for f in futures]
    return results, time.perf_counter() - started


def grpo_datums(trio, prompts, results) -> list:
    data = []
    for prompt, result in zip(prompts, results):
        lengths = np.array([len(s.tokens) for s in result.sequences], dtype=np.float32)
        advantages = (lengths - lengths.mean()) / (lengths.std() + 1e-6)  # any group-relative reward will do
        for seq, adv in zip(result.sequences, advantages):
            full = prompt + seq.tokens
            n = len(full) - 1
            zeros = [0.0] * (len(prompt) - 1)
            data.append(trio.Datum(model_input=trio.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": np.asarray(zeros + list(seq.logprobs), dtype=np.float32)[:n],
                "advantages": np.asarray(zeros + [float(adv)] * len(seq.tokens), dtype=np.float32)[:n]}))
    return data


def measure(url: str, steps: int, max_tokens: int) -> dict:
    import pytrio_compat as trio

    client = trio.ServiceClient(base_url=url)
    tc = client.create_lora_training_client("m", rank=16, seed=0)
    tok = tc.get_tokenizer()
    prompts = [few_shot_prompt(tok, q) for q in QUESTIONS]
    base = client.create_sampling_client(base_model="m")
    sample_round(trio, base, prompts, max_tokens, 0)  # warm-up: loads every replica's model path
    rounds = [sample_round(trio, base, prompts, max_tokens, 100 * r) for r in range(3)]
    tokens = sum(len(s.tokens) for res in rounds[0][0] for s in res.sequences)
    sampling = {"seconds": median([t for _, t in rounds]), "tokens": tokens,
                "tokens_per_s": round(tokens / median([t for _, t in rounds]), 1)}

    adam = trio.AdamParams(learning_rate=1e-5)

    def train(results):
        tc.forward_backward(grpo_datums(trio, prompts, results), "importance_sampling").result()
        tc.optim_step(adam).result()

    sync = []
    for step in range(steps + 1):  # the first step warms up the trainer
        started = time.perf_counter()
        results, _ = sample_round(trio, tc.save_weights_and_get_sampling_client(), prompts, max_tokens, step)
        train(results)
        sync.append(time.perf_counter() - started)
    piped = []
    results, _ = sample_round(trio, tc.save_weights_and_get_sampling_client(), prompts, max_tokens, 50)
    for step in range(steps):
        started = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client()
        futures = [sampler.sample(trio.ModelInput.from_ints(p), num_samples=8, sampling_params=trio.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=step + i, stop=[])) for i, p in enumerate(prompts)]
        train(results)  # step k trains while step k+1 samples (with the weights from before step k)
        results = [f.result() for f in futures]
        piped.append(time.perf_counter() - started)
    client.close()
    return {"sampling": sampling, "grpo_step_s": round(median(sync[1:]), 2),
            "grpo_step_pipelined_s": round(median(piped), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=SMOLLM2, help="a model folder or hub id, or 'tiny'")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model
        if model == "tiny":
            from server_mock.engine.tiny_model import make_tiny_model

            model = str(make_tiny_model(tmp / "tiny"))
        elif not Path(model).is_dir():
            from server_mock.engine.loading import resolve_source

            model = resolve_source(model)
        out = {"model": args.model, "batch": "4 prompts x 8 samples", "max_tokens": args.max_tokens}
        (tmp / "local").mkdir()
        proc, url = start_worker(model, tmp / "local", "--threads", "2")
        try:
            out["one_process_2_threads"] = measure(url, args.steps, args.max_tokens)
            save("ray_scaling", out)  # kept if the second half does not finish
        finally:
            proc.terminate()
            proc.wait()
        ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        (tmp / "ray").mkdir()
        proc, url = start_worker(model, tmp / "ray", "--ray", ray.get_runtime_context().gcs_address,
                                 "--sampler-replicas", "2", "--train-replicas", "1", "--cpus-per-replica", "1")
        try:
            out["ray_2_samplers_x_1_thread_1_trainer"] = measure(url, args.steps, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait()
            ray.shutdown()
    save("ray_scaling", out)


if __name__ == "__main__":
    main()
