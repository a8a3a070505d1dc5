"""Evaluation: greedy accuracy on held-out questions."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import pytrio_compat as trio
from grpo_grading import grade
from grpo_prompts import FEWSHOT_PREFIX, completion_text, render_prompt, stop_sequences


def _greedy_params(tokenizer: Any, max_tokens: int) -> trio.SamplingParams:
    return trio.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop_sequences(tokenizer))


def evaluate(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX,
) -> float:
    """Fraction of `rows` answered correctly with greedy decoding (all requests submitted, then awaited)."""
    if not rows:
        raise ValueError("evaluate needs at least one row")
    params = _greedy_params(tokenizer, max_tokens)
    futures = [
        sampling_client.sample(prompt=trio.ModelInput.from_ints(render_prompt(tokenizer, row["question"], fewshot)),
                               num_samples=1, sampling_params=params)
        for row in rows
    ]
    scores = [grade(completion_text(tokenizer, fut.result().sequences[0]), row["answer"])
              for fut, row in zip(futures, rows)]
    return sum(scores) / len(scores)


async def evaluate_async(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX,
) -> float:
    """`evaluate` with `asyncio.gather` over `sample_async`."""
    if not rows:
        raise ValueError("evaluate needs at least one row")
    params = _greedy_params(tokenizer, max_tokens)
    results = await asyncio.gather(*(
        sampling_client.sample_async(
            prompt=trio.ModelInput.from_ints(render_prompt(tokenizer, row["question"], fewshot)),
            num_samples=1, sampling_params=params)
        for row in rows
    ))
    scores = [grade(completion_text(tokenizer, res.sequences[0]), row["answer"]) for res, row in zip(results, rows)]
    return sum(scores) / len(scores)


def should_eval(args: argparse.Namespace, step: int) -> bool:
    """Evaluate at the start of every `--eval-every`-th step (step 0 gives the baseline)."""
    return args.eval_every > 0 and step % args.eval_every == 0
