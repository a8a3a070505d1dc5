"""forward_backward with GRPO prompts run once (prefix sharing) vs every datum in full, vs a hand-written PEFT loop.

One ``LocalModelHost`` (SmolLM2-135M-Instruct, float32, LoRA rank 16 on attention, MLP and lm_head, the worker's
defaults) runs the same batch with prefix sharing on and off; the PEFT loop is ``train_throughput.peft_baseline``
(length-sorted micro-batches, every datum in full) on the same PEFT model. Timings alternate between the three,
medians are reported, in wall-clock seconds and in CPU seconds of the process (the latter is steadier on a
machine shared with other work). Two shapes:

* demo: the demo's few-shot prompt (~175 tokens; the 4 questions share all but the last ~10), completions
  10-30 tokens, 4 groups of 8;
* gsm8k: a distinct ~150-token prompt per group, completions 200-300 tokens, groups of 8.

Also reported: the arithmetic (tokens through the model, padded, and the forward+backward GFLOP they imply),
a torch.profiler breakdown of one call of each path, and the peak memory of one call of the shared and the
unshared path, each in its own process: the rise of its resident set and of the bytes its C allocator has handed
out (glibc ``mallinfo2``) while the call runs.

    python benchmarks/prefix_shared_training.py [--repeats 2] [--gsm8k-groups 2] [--memory-shapes demo,gsm8k]
        [--profile-shapes demo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import SMOLLM2, few_shot_prompt, median, save  # noqa: E402
from benchmarks.peak_memory import PeakHeap, PeakRSS  # noqa: E402
from benchmarks.train_throughput import peft_baseline  # noqa: E402

QUESTIONS = ("What is 36 + 47?", "What is 12 + 85?", "What is 64 + 29?", "What is 53 + 18?")
RANK = 16


def load_host():
    from pytrio_compat.wire import LoraSpec
    from server_mock.config import TrainOptions
    from server_mock.engine.local_host import LocalModelHost

    host = LocalModelHost("smol", SMOLLM2, "cpu", torch.float32, 8192, TrainOptions())
    adapter = host.create_adapter("bench", LoraSpec(rank=RANK, seed=0))
    return host, adapter


def make_batch(shape: str, tokenizer, vocab: int, gsm8k_groups: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """GRPO datums: prompt positions carry no advantage (as in the recipes), completions one advantage each."""
    rng = np.random.default_rng(seed)
    if shape == "demo":
        prompts = [few_shot_prompt(tokenizer, q) for q in QUESTIONS]
        completion = (10, 30)
    else:
        prompts = [rng.integers(3, vocab, 150).tolist() for _ in range(gsm8k_groups)]
        completion = (200, 300)
    data = []
    for prompt in prompts:
        for _ in range(8):
            c = int(rng.integers(completion[0], completion[1] + 1))
            full = prompt + rng.integers(3, vocab, c).tolist()
            n, p = len(full) - 1, len(prompt) - 1
            data.append({
                "tokens": np.array(full[:-1], dtype=np.int64),
                "target_tokens": np.array([0] * p + full[len(prompt):], dtype=np.int64),
                "logprobs": np.concatenate([np.zeros(p), -rng.uniform(0.1, 3.0, n - p)]).astype(np.float32),
                "advantages": np.concatenate([np.zeros(p), np.full(n - p, rng.normal())]).astype(np.float32),
            })
    return data


def as_rows(data):
    """The same datums in ``peft_baseline``'s format."""
    return [{"input": d["tokens"].tolist(), "target": d["target_tokens"].tolist(), "logprobs": d["logprobs"].tolist(),
             "advantages": d["advantages"].tolist()} for d in data]


def call(host, adapter, data, mode: str) -> float:
    """One forward_backward of ``data`` on ``mode``'s path; returns the summed loss. Gradients are dropped after."""
    from server_mock.config import MICRO_BATCH_TOKENS

    if mode == "peft_loop":
        host._activate(adapter)
        loss = peft_baseline(host.peft, as_rows(data), MICRO_BATCH_TOKENS)
    else:
        host.prefix_sharing = mode == "shared"
        loss = host.forward_backward(adapter, data, "importance_sampling", {}, backward=True)["metrics"]["loss:sum"]
    for p in adapter.params.values():
        p.grad = None
    return loss


def arithmetic(host, data) -> dict:
    """Tokens each path runs through the model (real and padded) and the forward+backward GFLOP they imply."""
    from server_mock.config import MICRO_BATCH_TOKENS
    from server_mock.training import prefix_planning
    from server_mock.training.prefix_planning import micro_batches

    config = host.model.config
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_token = 2 * (layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * config.vocab_size)  # forward matmuls
    lengths = [len(d["tokens"]) for d in data]
    padded_full = sum(len(b) * max(lengths[i] for i in b) for b in micro_batches(lengths, MICRO_BATCH_TOKENS))
    passes = prefix_planning.plan([d["tokens"] for d in data], MICRO_BATCH_TOKENS,
                                  host.options.prefix_share_min_tokens)  # what the worker runs
    groups = [g for batch, _ in passes.shared for g in batch.groups]
    shared = padded_shared = 0
    for batch, chunks in passes.shared:
        prompts, n = len(batch.groups), batch.prefix_len
        shared += prompts * n + sum(lengths[i] - n for i, _ in batch.rows())
        padded_shared += prompts * n + sum(len(c) * (max(lengths[i] for i, _ in c) - n) for c in chunks)
    for b in passes.rest:
        shared += sum(lengths[i] for i in b)
        padded_shared += len(b) * max(lengths[i] for i in b)
    # backward through frozen base weights costs about one more forward (input gradients only, LoRA is tiny)
    gflop = lambda tokens: 2 * per_token * tokens / 1e9  # noqa: E731
    return {"datums": len(data), "groups": [(g.prefix_len, len(g.members)) for g in groups],
            "tokens_full": sum(lengths), "tokens_full_padded": padded_full,
            "tokens_shared": shared, "tokens_shared_padded": padded_shared,
            "token_ratio": padded_full / padded_shared,
            "gflop_full": gflop(padded_full), "gflop_shared": gflop(padded_shared),
            "lm_head_share_of_flop": h * config.vocab_size / (per_token / 2)}


def profile(host, adapter, data, mode: str, top: int = 8) -> dict:
    """Self CPU time of one call by op category, and the top ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        call(host, adapter, data, mode)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    categories = {"matmul": ("mm", "addmm", "bmm", "matmul", "linear", "_mkl", "mkldnn"),
                  "attention": ("scaled_dot_product", "_flash", "softmax_backward", "_efficient"),
                  "logits_to_logprobs": ("logsumexp", "gather", "log_softmax", "exp"),
                  "copies": ("copy_", "cat", "clone", "contiguous", "index", "fill_", "zero_")}
    split = dict.fromkeys([*categories, "other"], 0.0)
    for e in events:
        name = e.key.lower()
        cat = next((c for c, keys in categories.items() if any(k in name for k in keys)), "other")
        split[cat] += e.self_cpu_time_total
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"total_s": total / 1e6, "share": {k: round(v / total, 3) for k, v in split.items()},
            "top_ops": [(e.key, round(e.self_cpu_time_total / 1e6, 3), e.count) for e in ranked]}


def memory_child(shape: str, mode: str, gsm8k_groups: int) -> None:
    """In its own process: one warm-up call, then the rise of the resident set and of the allocated heap during
    one more call."""
    host, adapter = load_host()
    data = make_batch(shape, host.tokenizer, host.vocab_size, gsm8k_groups)
    call(host, adapter, data, mode)
    with PeakRSS(os.getpid()) as rss, PeakHeap() as heap:
        call(host, adapter, data, mode)
    print(json.dumps({"rss_rise_mb": rss.rise_mb, "heap_rise_mb": heap.rise_mb}))


def measure_memory(shape: str, mode: str, gsm8k_groups: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--memory-child", shape, mode, "--gsm8k-groups",
                          str(gsm8k_groups)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


MODES = ("shared", "unshared", "peft_loop")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gsm8k-groups", type=int, default=2)
    parser.add_argument("--shapes", default="demo,gsm8k")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip the untimed first call of each path on the real shapes")
    parser.add_argument("--memory-shapes", default="demo,gsm8k", help="comma-separated shapes to measure memory of")
    parser.add_argument("--profile-shapes", default="demo", help="comma-separated shapes to profile ('' for none)")
    parser.add_argument("--memory-child", nargs=2, metavar=("SHAPE", "MODE"))
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child, args.gsm8k_groups)
        return {}

    host, adapter = load_host()
    results = {"model": SMOLLM2, "rank": RANK, "min_tokens": host.options.prefix_share_min_tokens,
               "probe_shares": host.prefix_sharing, "load_average_at_start": os.getloadavg(), "shapes": {}}
    for shape in args.shapes.split(","):
        data = make_batch(shape, host.tokenizer, host.vocab_size, args.gsm8k_groups)
        print(json.dumps({shape: arithmetic(host, data)}), flush=True)
        for mode in ("shared", "unshared") if args.warm_up else ():  # the PEFT loop's shapes are the unshared ones
            call(host, adapter, data, mode)
        wall = {m: [] for m in MODES}
        cpu = {m: [] for m in MODES}  # CPU seconds of this process: less sensitive to other processes' load
        losses = {}
        for _ in range(args.repeats):
            for mode in MODES:
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                losses[mode] = call(host, adapter, data, mode)
                wall[mode].append(time.perf_counter() - start_wall)
                cpu[mode].append(time.process_time() - start_cpu)
                print(json.dumps({shape: mode, "wall_s": wall[mode][-1], "cpu_s": cpu[mode][-1]}), flush=True)
        entry = {"arithmetic": arithmetic(host, data),
                 "wall_s": {m: median(t) for m, t in wall.items()}, "cpu_s": {m: median(t) for m, t in cpu.items()},
                 "runs": {"wall": wall, "cpu": cpu},
                 "speedup_vs_unshared": {"wall": median(wall["unshared"]) / median(wall["shared"]),
                                         "cpu": median(cpu["unshared"]) / median(cpu["shared"])},
                 "speedup_vs_peft_loop": {"wall": median(wall["peft_loop"]) / median(wall["shared"]),
                                          "cpu": median(cpu["peft_loop"]) / median(cpu["shared"])},
                 "loss_gap_shared_vs_unshared": abs(losses["shared"] - losses["unshared"]),
                 "load_average": os.getloadavg()}
        if shape in args.profile_shapes.split(","):
            entry["profile"] = {m: profile(host, adapter, data, m) for m in ("shared", "unshared")}
        if shape in args.memory_shapes.split(","):
            entry["peak_memory_rise_mb"] = {m: measure_memory(shape, m, args.gsm8k_groups)
                                            for m in ("shared", "unshared")}
        results["shapes"][shape] = entry
        print(json.dumps({shape: {k: v for k, v in entry.items() if k != "runs"}}, indent=1), flush=True)
    save("prefix_shared_training", results)
    return results


if __name__ == "__main__":
    main()
