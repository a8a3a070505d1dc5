"""What the exact KL to the reference costs: forward_backward with and without ``kl_coef`` (and ``return_entropy``).

One in-process host (SmolLM2-135M-Instruct, float32, CPU, the worker's default options: prompt prefixes shared)
runs the same GRPO-shaped batch (the CPU demo's shape: 4 prompts x 8 completions, a few-shot prompt of ~175
tokens, completions of 10-40 tokens, ppo) in three modes, interleaved so that load on the machine hits each alike:

    plain      loss_fn_config {}                          (no reference pass)
    kl         {"kl_coef": 0.05}                          (+ the reference pass, no gradient, prompts shared)
    kl+ent     {"kl_coef": 0.05, "return_entropy": true}  (+ each position's entropy)

The figure is the ratio of medians to plain in this process; the profile splits a call into the reference pass
(``_reference_logprobs``), the entropy (``policy_terms.entropy``) and the rest (the training forward + backward).

    python benchmarks/reference_pass_cost.py [--reps 3] [--model HuggingFaceTB/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import SMOLLM2, few_shot_prompt, save  # noqa: E402

MODES = {"plain": {}, "kl": {"kl_coef": 0.05}, "kl+ent": {"kl_coef": 0.05, "return_entropy": True}}


def grpo_batch(tokenizer, vocab: int, prompts: int = 4, group: int = 8, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    data = []
    for p in range(prompts):
        prompt = np.asarray(few_shot_prompt(tokenizer, f"What is {21 + p} + {34 + 2 * p}?"), dtype=np.int64)
        for _ in range(group):
            completion = rng.integers(3, vocab, int(rng.integers(10, 41)))
            pad, n = len(prompt) - 1, len(completion)
            data.append({"tokens": np.concatenate([prompt, completion[:-1]]),
                         "target_tokens": np.concatenate([np.zeros(pad, np.int64), completion]),
                         "logprobs": np.concatenate([np.zeros(pad), -rng.uniform(0.1, 3, n)]).astype(np.float32),
                         "advantages": np.concatenate([np.zeros(pad), np.full(n, rng.normal())]).astype(np.float32),
                         "weights": np.concatenate([np.zeros(pad), np.ones(n)]).astype(np.float32)})
    return data


class PhaseTimer:
    """Wraps the functions of one phase and adds up their wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    from pytrio_compat.wire import LoraSpec
    from server_mock.config import TrainOptions
    from server_mock.engine.local_host import LocalModelHost
    from server_mock.training import forward_backward as fb
    from server_mock.training import policy_terms
    from server_mock.training.losses import resolve_loss_config

    host = LocalModelHost("bench", args.model, "cpu", torch.float32, None, TrainOptions())
    adapter = host.create_adapter("run-bench", LoraSpec(rank=16, seed=0, train_unembed=True))
    data = grpo_batch(host.tokenizer, host.vocab_size)
    phases = PhaseTimer()
    phases.wrap(fb, "_reference_logprobs", "reference pass")
    phases.wrap(policy_terms, "entropy", "entropy")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    profile: dict[str, dict[str, float]] = {m: {} for m in MODES}
    host.forward_backward(adapter, data, "ppo", resolve_loss_config("ppo", {}), True)  # warm-up
    for _ in range(args.reps):
        for mode, extra in MODES.items():
            for param in adapter.params.values():
                param.grad = None
            phases.seconds = {}
            start = time.perf_counter()
            host.forward_backward(adapter, data, "ppo", resolve_loss_config("ppo", extra), True)
            elapsed = time.perf_counter() - start
            times[mode].append(elapsed)
            for label, seconds in {**phases.seconds, "total": elapsed}.items():
                profile[mode].setdefault(label, []).append(seconds)
    medians = {m: statistics.median(v) for m, v in times.items()}
    result = {
        "model": args.model, "datums": len(data), "tokens": int(sum(len(d["tokens"]) for d in data)),
        "prefix_sharing": host.prefix_sharing, "reps": args.reps,
        "median_s": medians,
        "ratio_to_plain": {m: medians[m] / medians["plain"] for m in MODES},
        "profile_median_s": {m: {k: statistics.median(v) for k, v in prof.items()} for m, prof in profile.items()},
        "all_s": times,
    }
    save("reference_pass_cost", result)


if __name__ == "__main__":
    main()
