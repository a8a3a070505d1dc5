"""Evaluation: greedy accuracy on held-out questions."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytrio_compat as trio
from countdown import grade_countdown
from grpo_grading import grade
from grpo_prompts import FEWSHOT_PREFIX, QUESTION_SUFFIX, as_model_input, completion_text, row_prompt, stop_sequences

Grader = Callable[[str, str], float]  # (completion text, the row's answer) -> 1.0 right / 0.0 wrong

# What counts as a right answer to a held-out question: the boxed number (gsm8k, arithmetic) or a boxed
# expression that solves the Countdown problem (without the format bonus the training reward gives).
EVAL_GRADERS: dict[str, Grader] = {"gsm8k": grade, "arithmetic": grade, "countdown": grade_countdown,
                                   "shapes": grade}


def _prompts(tokenizer: Any, rows: Sequence[dict], fewshot: Sequence[dict], suffix: str) -> list[trio.ModelInput]:
    if not rows:
        raise ValueError("evaluate needs at least one row")
    return [as_model_input(row_prompt(tokenizer, row, fewshot, suffix)) for row in rows]


def _greedy_params(tokenizer: Any, max_tokens: int) -> trio.SamplingParams:
    return trio.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop_sequences(tokenizer))


def accuracy(tokenizer: Any, results: Sequence[Any], rows: Sequence[dict], grader: Grader = grade) -> float:
    """Fraction of `rows` whose greedy completion (`results[i].sequences[0]`) `grader` scores 1."""
    scores = [grader(completion_text(tokenizer, res.sequences[0]), row["answer"]) for res, row in zip(results, rows)]
    return sum(scores) / len(scores)


def greedy_results(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX, suffix: str = QUESTION_SUFFIX,
) -> list[Any]:
    """One greedy completion per row: every request submitted, then each awaited (a SampleResponse per row).

    The SamplingClient keeps `sampling_request_max_in_flight` of them running (16 by default; the demos set 256)
    and the worker prefills the requests that wait together as one group (what follows their shared few-shot
    prefix) and decodes them as one batch, a request joining it as another ends; a problem's greedy tokens do not
    depend on which others share its batch (tests/recipes/test_eval_batching.py, docs/benchmarks.md,
    "Evaluation")."""
    params = _greedy_params(tokenizer, max_tokens)
    futures = [sampling_client.sample(prompt=p, num_samples=1, sampling_params=params)
               for p in _prompts(tokenizer, rows, fewshot, suffix)]
    return [fut.result() for fut in futures]


def evaluate(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX, suffix: str = QUESTION_SUFFIX, grader: Grader = grade,
) -> float:
    """Fraction of `rows` answered correctly with greedy decoding (all requests submitted, then awaited).

    `fewshot` and `suffix` make the prompt (`grpo_prompts.PROMPTS`), `grader` judges it (`EVAL_GRADERS`)."""
    results = greedy_results(sampling_client, tokenizer, rows, max_tokens, fewshot, suffix)
    return accuracy(tokenizer, results, rows, grader)


async def evaluate_async(
    sampling_client: Any, tokenizer: Any, rows: Sequence[dict], max_tokens: int,
    fewshot: Sequence[dict] = FEWSHOT_PREFIX, suffix: str = QUESTION_SUFFIX, grader: Grader = grade,
) -> float:
    """`evaluate` with `asyncio.gather` over `sample_async`."""
    params = _greedy_params(tokenizer, max_tokens)
    results = await asyncio.gather(*(sampling_client.sample_async(prompt=p, num_samples=1, sampling_params=params)
                                     for p in _prompts(tokenizer, rows, fewshot, suffix)))
    return accuracy(tokenizer, results, rows, grader)


def should_eval(args: argparse.Namespace, step: int) -> bool:
    """Evaluate at the start of every `--eval-every`-th step (step 0 gives the baseline)."""
    return args.eval_every > 0 and step % args.eval_every == 0
