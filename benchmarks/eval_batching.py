"""One greedy held-out evaluation of the CPU demo, submitted with the SDK's default in-flight limit (16 sample calls
per sampler, so the worker decodes at most 16 prompts together) and with higher ones (256: every prompt at once,
decoded as one batch within the worker's 65,536-token batch budget), back to back on one worker.

Reports the seconds of each, their ratio, and whether every problem got the same greedy tokens (so the same
accuracy to the last problem). The sampler is the demo's step-0 snapshot (SmolLM2-135M-Instruct, LoRA rank 16
on attention, MLP and the output head, seed 0).

    python benchmarks/eval_batching.py [--problems 200] [--in-flight 16,256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))
from benchmarks.common import SMOLLM2, save  # noqa: E402


def main(argv=None) -> dict:
    import grpo_eval
    from grpo_data import load_rows
    from grpo_prompts import PROMPTS

    import pytrio_compat as trio
    from pytrio_compat.embedded import EmbeddedWorker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--in-flight", default="16,256",
                        help="comma-separated sampling_request_max_in_flight values, the first is the baseline")
    args = parser.parse_args(argv)
    limits = [int(x) for x in args.in_flight.split(",") if x]

    rows = load_rows("arithmetic", "test", n=args.problems)
    fewshot, suffix = PROMPTS["arithmetic"]
    worker = EmbeddedWorker()
    runs = []
    try:
        reference = None
        for limit in limits:
            trio.configure(sampling_request_max_in_flight=limit)
            service = trio.ServiceClient(base_url=worker.base_url, api_key=worker.api_key)
            training = service.create_lora_training_client(base_model=args.model, rank=16, seed=0,
                                                           train_unembed=True)
            tokenizer = training.get_tokenizer()
            sampler = training.save_weights_and_get_sampling_client()
            if reference is None:  # load the model and warm the decode path before the first timed run
                grpo_eval.greedy_results(sampler, tokenizer, rows[:4], args.max_tokens, fewshot, suffix)
            started = time.perf_counter()
            results = grpo_eval.greedy_results(sampler, tokenizer, rows, args.max_tokens, fewshot, suffix)
            seconds = time.perf_counter() - started
            tokens = [list(r.sequences[0].tokens) for r in results]
            accuracy = grpo_eval.accuracy(tokenizer, results, rows, grpo_eval.EVAL_GRADERS["arithmetic"])
            if reference is None:
                reference = tokens
            same = sum(a == b for a, b in zip(tokens, reference))
            prefill = sum(r.metrics.get("time/prefill", 0.0) for r in results)  # each request's own prefill
            runs.append({"in_flight": limit, "seconds": seconds, "accuracy": accuracy, "same_tokens": same,
                         "prefill_seconds": prefill})
            print(f"in flight {limit}: {seconds:.1f}s (prefill {prefill:.1f}s), accuracy {accuracy:.3f}, "
                  f"{same}/{len(rows)} problems with the baseline's tokens", flush=True)
            service.close()
    finally:
        worker.stop()
    base = runs[0]["seconds"]
    payload = {"problems": args.problems, "max_tokens": args.max_tokens, "runs": runs,
               "ratios": {str(r["in_flight"]): r["seconds"] / base for r in runs}}
    save("eval_batching", payload)
    return payload


if __name__ == "__main__":
    main()
