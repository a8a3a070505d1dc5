"""forward_backward throughput and memory: the worker vs a hand-written PEFT loop on the same micro-batches.

Both train the same LoRA (same rank and target layers) on the same GRPO-shaped batch (prompt + completion,
importance-sampling loss summed over tokens), with the same length-sorted micro-batches. The baseline runs in
this process; the worker runs in its own process and is reached over HTTP, so its figure includes encoding,
transport and queueing. Peak memory is the rise of each process's resident set during the timed calls.

    python benchmarks/train_throughput.py [--datums 32] [--prompt-tokens 175] [--completion-tokens 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import SMOLLM2, median, save, timer  # noqa: E402
from benchmarks.peak_memory import PeakRSS  # noqa: E402


def make_batch(n: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        c = int(rng.integers(completion // 2, completion + 1))
        tokens = rng.integers(3, vocab, size=prompt + c).tolist()
        rows.append({
            "input": tokens[:-1],
            "target": [0] * (prompt - 1) + tokens[prompt:],
            "logprobs": [0.0] * (prompt - 1) + (-rng.uniform(0.1, 3.0, c)).tolist(),
            "advantages": [0.0] * (prompt - 1) + [float(rng.normal())] * c,
        })
    return rows


def peft_baseline(model, rows, budget: int) -> float:
    """What a user writes with PEFT: length-sorted micro-batches, float32 logprobs, IS loss, backward."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input"]))
    batches, current = [], []
    for i in order:
        longest = max([len(rows[j]["input"]) for j in current] + [len(rows[i]["input"])])
        if current and longest * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    batches.append(current)
    total = 0.0
    for batch in batches:
        longest = max(len(rows[i]["input"]) for i in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        tgt = torch.zeros_like(ids)
        att = torch.zeros_like(ids)
        q = torch.zeros((len(batch), longest))
        adv = torch.zeros_like(q)
        for b, i in enumerate(batch):
            n = len(rows[i]["input"])
            ids[b, :n] = torch.tensor(rows[i]["input"])
            tgt[b, :n] = torch.tensor(rows[i]["target"])
            att[b, :n] = 1
            q[b, :n] = torch.tensor(rows[i]["logprobs"])
            adv[b, :n] = torch.tensor(rows[i]["advantages"])
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits.float()
        lp = -torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                reduction="none").reshape(tgt.shape)
        loss = -(torch.exp(lp - q) * adv * att).sum()
        loss.backward()
        total += float(loss)
    return total


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--datums", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=175)
    parser.add_argument("--completion-tokens", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import pytrio_compat as trio
    from server_mock.config import MICRO_BATCH_TOKENS
    from server_mock.engine.loading import resolve_source
    from server_mock.lora import LORA_ALPHA, linear_groups

    source = resolve_source(args.model)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    targets = list(linear_groups(base))  # attention, MLP and lm_head: the worker's defaults
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=LORA_ALPHA, target_modules=targets))
    model.eval()
    vocab = base.get_input_embeddings().num_embeddings
    rows = make_batch(args.datums, args.prompt_tokens, args.completion_tokens, vocab)
    tokens = sum(len(r["input"]) for r in rows)
    data = [trio.Datum(model_input=trio.ModelInput.from_ints(r["input"]),
                       loss_fn_inputs={"target_tokens": r["target"], "logprobs": r["logprobs"],
                                       "advantages": r["advantages"]}) for r in rows]

    service = trio.ServiceClient()
    tc = service.create_lora_training_client(args.model, rank=args.rank, seed=0)
    worker_pid = service._embedded.process.pid
    tc.forward_backward(data[:2], "importance_sampling").result()  # warm-up both
    peft_baseline(model, rows[:2], MICRO_BATCH_TOKENS)

    ours, raw = [], []
    with PeakRSS(worker_pid) as worker_mem:
        for _ in range(args.repeats):
            with timer(ours):
                tc.forward_backward(data, "importance_sampling").result()
    import os

    with PeakRSS(os.getpid()) as baseline_mem:
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            with timer(raw):
                peft_baseline(model, rows, MICRO_BATCH_TOKENS)
    service.close()
    result = {
        "model": args.model, "datums": args.datums, "tokens": tokens, "rank": args.rank,
        "micro_batch_tokens": MICRO_BATCH_TOKENS,
        "peft_loop_s": median(raw), "worker_s": median(ours),
        "peft_tokens_per_s": tokens / median(raw), "worker_tokens_per_s": tokens / median(ours),
        "throughput_ratio": median(raw) / median(ours),
        "peft_peak_rss_rise_mb": baseline_mem.rise_mb, "worker_peak_rss_rise_mb": worker_mem.rise_mb,
        "runs": {"peft": raw, "worker": ours},
    }
    save("train_throughput", result)
    return result


if __name__ == "__main__":
    main()
