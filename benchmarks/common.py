"""Shared benchmark plumbing: the model, a few-shot prompt like the demo's, timing and reporting."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
RESULTS = Path(__file__).resolve().parent / "results"

FEW_SHOT = [
    ("What is 23 + 45?", "23 + 45 = 68. The final answer is \\boxed{68}."),
    ("What is 17 + 38?", "17 + 38 = 55. The final answer is \\boxed{55}."),
]


@contextmanager
def serve_app(app):
    """``app`` behind a real uvicorn on a free loopback port of this process; yields its base URL, the server
    stopped after the block."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    if not server.started:
        raise RuntimeError("the worker did not start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def few_shot_prompt(tokenizer, question: str = "What is 36 + 47?") -> list[int]:
    """A chat prompt of ~175 tokens: the model's default system turn, two worked examples, a question."""
    messages = []
    for q, a in FEW_SHOT:
        messages += [{"role": "user", "content": q + " Put the final answer in \\boxed{}."},
                     {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": question + " Put the final answer in \\boxed{}."})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def machine() -> dict:
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


@contextmanager
def timer(store: list[float]):
    start = time.perf_counter()
    yield
    store.append(time.perf_counter() - start)


def median(values: list[float]) -> float:
    return statistics.median(values)


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**payload, "machine": machine()}, indent=1))
    print(json.dumps(payload, indent=1))
    return path


def grpo_datums(T, n: int, length: int = 48) -> list:
    """``n`` importance-sampling datums of ``length`` tokens, built with the SDK types in ``T`` (ours or pytrio's)."""
    out = []
    for i in range(n):
        ids = [(13 * j + i) % 400 + 10 for j in range(length)]
        out.append(T.Datum(model_input=T.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": ids[1:], "logprobs": [-1.0] * (length - 1), "advantages": [0.5] * (length - 1)}))
    return out


def grpo_step(T, tc, datums: list, index: int) -> float:
    """One GRPO-shaped step through a training client: a sampler snapshot, 4 seeded groups of 4 samples,
    forward_backward then optim_step sent together; its seconds. ``T``: the SDK's types (ours or pytrio's)."""
    started = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client()
    futures = [sampler.sample(T.ModelInput.from_ints([5 + g, 6, 7, 8]), num_samples=4,
                              sampling_params=T.SamplingParams(max_tokens=8, seed=index * 10 + g))
               for g in range(4)]
    for future in futures:
        future.result()
    fb = tc.forward_backward(datums, loss_fn="importance_sampling")
    opt = tc.optim_step(T.AdamParams(learning_rate=1e-3))
    fb.result(), opt.result()
    return time.perf_counter() - started


def sampler_minus_trainer(host, adapter, specs, results) -> list:
    """Per sampled sequence, its sampler logprobs minus the trainer's (one forward pass per request's sequences,
    no gradient) on the same tokens: numpy arrays, in order."""
    import numpy as np

    gaps = []
    for spec, result in zip(specs, results):
        data = []
        for seq in result.sequences:
            full = np.asarray(spec.prompt_tokens + seq.tokens, dtype=np.int64)
            data.append({"tokens": full[:-1], "target_tokens": full[1:],
                         "weights": np.ones(len(full) - 1, dtype=np.float32)})
        out = host.forward_backward(adapter, data, "cross_entropy", {}, backward=False)["outputs"]
        for seq, o in zip(result.sequences, out):
            gaps.append(np.asarray(seq.logprobs) - np.asarray(o["logprobs"])[len(spec.prompt_tokens) - 1:])
    return gaps
