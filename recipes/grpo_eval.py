"""Evaluation: greedy accuracy on held-out questions."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

from grpo_grading import grade
from grpo_prompts import FEWSHOT_PREFIX, completion_text, render_prompt, stop_sequences

import pytrio_compat as trio


def _prompts(tokenizer: Any, rows: Sequence[dict], fewshot: Sequence[dict]) -> list[trio.ModelInput]:
    if not rows:
        raise ValueError("evaluate needs at least one row")
    return [trio.ModelInput.from_ints(render_prompt(tokenizer, row["question"], fewshot)) for row in rows]


def _greedy_params(tokenizer: Any, max_tokens: int) -> trio.SamplingParams:
    return trio.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop_sequences(tokenizer))


def _accuracy(tokenizer: Any, results: Sequence[Any], rows: Sequence[dict]) -> float:
    scores = [grade(completion_text(tokenizer, res.sequences[0]), row["answer"]) for res, row in zip(results, rows)]
    return sum(scores) / len(scores)


def evaluate(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX,
) -> float:
    """Fraction of `rows` answered correctly with greedy decoding (all requests submitted, then awaited)."""
    params = _greedy_params(tokenizer, max_tokens)
    futures = [sampling_client.sample(prompt=p, num_samples=1, sampling_params=params)
               for p in _prompts(tokenizer, rows, fewshot)]
    return _accuracy(tokenizer, [fut.result() for fut in futures], rows)


async def evaluate_async(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX,
) -> float:
    """`evaluate` with `asyncio.gather` over `sample_async`."""
    params = _greedy_params(tokenizer, max_tokens)
    results = await asyncio.gather(*(sampling_client.sample_async(prompt=p, num_samples=1, sampling_params=params)
                                     for p in _prompts(tokenizer, rows, fewshot)))
    return _accuracy(tokenizer, results, rows)


def should_eval(args: argparse.Namespace, step: int) -> bool:
    """Evaluate at the start of every `--eval-every`-th step (step 0 gives the baseline)."""
    return args.eval_every > 0 and step % args.eval_every == 0
