"""Sampling throughput: the worker (over HTTP, shared-prefix KV cache) vs raw transformers generate().

The baseline is what a user would write: ``model.generate(num_return_sequences=G, output_logits=True)``
plus a log_softmax for the sampled tokens' logprobs. Both produce exactly ``max_tokens`` tokens per
sample (EOS disabled) at temperature 1 on the same model and prompt; medians over ``--repeats`` runs.

    python benchmarks/sampling_throughput.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--group 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import SMOLLM2, few_shot_prompt, median, save, timer  # noqa: E402


def raw_generate(model, prompt: list[int], group: int, tokens: int) -> None:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens, num_return_sequences=group,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    seqs = out.sequences[:, len(prompt):]
    lp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, seqs[..., None])
    assert lp.shape[:2] == (group, tokens)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=4, help="prompts sent together in the batched case")
    args = parser.parse_args(argv)

    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import pytrio_compat as trio
    from server_mock.engine.loading import resolve_source

    source = resolve_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prompt = few_shot_prompt(tokenizer)
    produced = args.group * args.tokens

    service = trio.ServiceClient()  # a worker started for this benchmark, on this machine
    sampler = service.create_sampling_client(base_model=args.model)
    params = trio.SamplingParams(max_tokens=args.tokens, temperature=1.0, stop=[])
    sampler.sample(trio.ModelInput.from_ints(prompt), num_samples=args.group, sampling_params=params).result()
    raw_generate(model, prompt, args.group, 4)  # warm-up both

    raw_t, ours_t, raw_batch_t, ours_batch_t = [], [], [], []
    prompts = [few_shot_prompt(tokenizer, f"What is {20 + i} + {31 + 2 * i}?") for i in range(args.concurrent)]

    async def concurrent_requests():
        return await asyncio.gather(*[sampler.sample_async(trio.ModelInput.from_ints(p), num_samples=args.group,
                                                           sampling_params=params) for p in prompts])

    for _ in range(args.repeats):
        with torch.no_grad(), timer(raw_t):
            raw_generate(model, prompt, args.group, args.tokens)
        with timer(ours_t):
            sampler.sample(trio.ModelInput.from_ints(prompt), num_samples=args.group, sampling_params=params).result()
        with torch.no_grad(), timer(raw_batch_t):
            for p in prompts:  # what a sync loop over a batch's prompts does
                raw_generate(model, p, args.group, args.tokens)
        with timer(ours_batch_t):
            asyncio.run(concurrent_requests())
    service.close()
    result = {
        "model": args.model, "prompt_tokens": len(prompt), "group": args.group, "new_tokens": args.tokens,
        "raw_generate_s": median(raw_t), "worker_s": median(ours_t),
        "raw_tokens_per_s": produced / median(raw_t), "worker_tokens_per_s": produced / median(ours_t),
        "speedup_single_prompt": median(raw_t) / median(ours_t),
        "concurrent_prompts": args.concurrent,
        "raw_sequential_batch_s": median(raw_batch_t), "worker_concurrent_batch_s": median(ours_batch_t),
        "speedup_batch": median(raw_batch_t) / median(ours_batch_t),
        "runs": {"raw": raw_t, "worker": ours_t, "raw_batch": raw_batch_t, "worker_batch": ours_batch_t},
    }
    save("sampling_throughput", result)
    return result


if __name__ == "__main__":
    main()
