"""Evaluation: greedy accuracy on held-out questions."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytrio_compat as trio
from countdown import grade_countdown
from grpo_grading import grade
from grpo_prompts import FEWSHOT_PREFIX, QUESTION_SUFFIX, completion_text, render_prompt, stop_sequences

Grader = Callable[[str, str], float]  # (completion text, the row's answer) -> 1.0 right / 0.0 wrong

# What counts as a right answer to a held-out question: the boxed number (gsm8k, arithmetic) or a boxed
# expression that solves the Countdown problem (without the format bonus the training reward gives).
EVAL_GRADERS: dict[str, Grader] = {"gsm8k": grade, "arithmetic": grade, "countdown": grade_countdown}


def _prompts(tokenizer: Any, rows: Sequence[dict], fewshot: Sequence[dict], suffix: str) -> list[trio.ModelInput]:
    if not rows:
        raise ValueError("evaluate needs at least one row")
    return [trio.ModelInput.from_ints(render_prompt(tokenizer, row["question"], fewshot, suffix)) for row in rows]


def _greedy_params(tokenizer: Any, max_tokens: int) -> trio.SamplingParams:
    return trio.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop_sequences(tokenizer))


def _accuracy(tokenizer: Any, results: Sequence[Any], rows: Sequence[dict], grader: Grader) -> float:
    scores = [grader(completion_text(tokenizer, res.sequences[0]), row["answer"]) for res, row in zip(results, rows)]
    return sum(scores) / len(scores)


def evaluate(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX, suffix: str = QUESTION_SUFFIX, grader: Grader = grade,
) -> float:
    """Fraction of `rows` answered correctly with greedy decoding (all requests submitted, then awaited).

    `fewshot` and `suffix` make the prompt (`grpo_prompts.PROMPTS`), `grader` judges it (`EVAL_GRADERS`)."""
    params = _greedy_params(tokenizer, max_tokens)
    futures = [sampling_client.sample(prompt=p, num_samples=1, sampling_params=params)
               for p in _prompts(tokenizer, rows, fewshot, suffix)]
    return _accuracy(tokenizer, [fut.result() for fut in futures], rows, grader)


async def evaluate_async(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX, suffix: str = QUESTION_SUFFIX, grader: Grader = grade,
) -> float:
    """`evaluate` with `asyncio.gather` over `sample_async`."""
    params = _greedy_params(tokenizer, max_tokens)
    results = await asyncio.gather(*(sampling_client.sample_async(prompt=p, num_samples=1, sampling_params=params)
                                     for p in _prompts(tokenizer, rows, fewshot, suffix)))
    return _accuracy(tokenizer, results, rows, grader)


def should_eval(args: argparse.Namespace, step: int) -> bool:
    """Evaluate at the start of every `--eval-every`-th step (step 0 gives the baseline)."""
    return args.eval_every > 0 and step % args.eval_every == 0
