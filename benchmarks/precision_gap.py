"""How far the sampler's logprobs are from the trainer's in bfloat16, with and without the float32 output head.

The gap users see as ``kl_sample_train`` (mean of sampler - trainer logprob over sampled tokens) comes from
the two sides computing the same numbers differently: the sampler decodes one token at a time against a
KV cache, the trainer runs whole sequences. In bfloat16 every matmul rounds; the output head's rounding alone
moves a logprob by ~1e-2. The worker computes the head in float32 by default (``--no-float32-head`` turns it off).

Measured in process on the worker's own ``LocalModelHost``: sample a GRPO-like group per prompt, then score the
same tokens with the trainer's forward pass (LoRA adapter attached, as in training).

    python benchmarks/precision_gap.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import sampler_minus_trainer  # noqa: E402

PROMPTS = ["What is 17 + 25? Answer with a number.", "Name three colours.", "Write one sentence about the sea.",
           "What is the capital of France?"]


def measure(source: str, device: str, dtype_name: str, float32_head: bool, autocast: bool = False,
            group: int = 8, max_tokens: int = 32, prompt_ids: list[list[int]] | None = None) -> dict:
    """Max |sampler - trainer| logprob and kl_sample_train over ``group`` samples of each prompt."""
    import torch

    from pytrio_compat.wire import LoraSpec
    from server_mock.config import TrainOptions
    from server_mock.engine.local_host import LocalModelHost
    from server_mock.sampling.generate import SampleSpec, generate_batch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    host = LocalModelHost("m", source, device, dtype, options=TrainOptions(float32_head=float32_head,
                                                                      autocast_bf16=autocast))
    adapter = host.create_adapter("probe", LoraSpec(rank=16, seed=0))
    if prompt_ids is None:
        prompt_ids = [host.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)["input_ids"]
                      for p in PROMPTS]
    model = host.sampling_model(host.snapshot(adapter))
    specs = [SampleSpec(prompt_tokens=list(p), num_samples=group, max_tokens=max_tokens, seed=i)
             for i, p in enumerate(prompt_ids)]
    results = generate_batch(model, specs, host.tokenizer, support=host.sampling_support)
    gaps = sampler_minus_trainer(host, adapter, specs, results)
    flat = np.concatenate(gaps)
    return {"dtype": dtype_name, "trainer_autocast_bf16": autocast, "float32_head": float32_head,
            "tokens": int(flat.size), "max_abs_gap": float(np.abs(flat).max()),
            "kl_sample_train": float(flat.mean()), "mean_abs_gap": float(np.abs(flat).mean())}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "precision_gap.json"))
    args = parser.parse_args(argv)
    from server_mock.engine.loading import resolve_source

    source = resolve_source(args.model)
    rows = []
    for dtype, autocast in (("float32", False), ("float32", True), ("bfloat16", False)):
        for head in (False, True):
            if dtype == "float32" and not autocast and not head:
                continue  # float32 throughout: the head option changes nothing
            row = measure(source, args.device, dtype, head, autocast)
            rows.append(row)
            print(json.dumps(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
