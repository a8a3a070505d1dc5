"""Prompts: the few-shot conversations, chat-template rendering, stop strings, completion text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from countdown import COUNTDOWN_FEWSHOT_PREFIX, COUNTDOWN_SUFFIX

QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
FEWSHOT_PREFIX: list[dict[str, str]] = [
    {"role": "user", "content": "How many r's are in strawberry?" + QUESTION_SUFFIX},
    {
        "role": "assistant",
        "content": (
            "<think>\n\n</think>\n\n"
            "Let's spell the word out and number all the letters: "
            "1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. "
            "We have r's at positions 3, 8, and 9. "
            "There are three r's. \\boxed{3}"
        ),
    },
]


# For --dataset arithmetic: two worked 2-digit additions instead. Small models (SmolLM2-135M) rarely box an
# answer after the strawberry example alone (reward ~0, so GRPO has no signal); with these they box ~95% of
# answers and get ~25% right at temperature 1, so most groups have mixed rewards.
ARITHMETIC_FEWSHOT_PREFIX: list[dict[str, str]] = [
    {"role": "user", "content": "What is 23 + 45?" + QUESTION_SUFFIX},
    {"role": "assistant", "content": "23 + 45 = 68. \\boxed{68}"},
    {"role": "user", "content": "What is 58 + 37?" + QUESTION_SUFFIX},
    {"role": "assistant", "content": "58 + 37 = 95. \\boxed{95}"},
]
FEWSHOT = {"gsm8k": FEWSHOT_PREFIX, "arithmetic": ARITHMETIC_FEWSHOT_PREFIX}  # the boxed-number datasets


class Prompting(NamedTuple):
    """What surrounds a dataset's question: the few-shot turns before it, the answer-format suffix after it."""

    fewshot: list[dict[str, str]]
    suffix: str


# countdown asks for a boxed expression instead of a number (recipes/countdown.py).
PROMPTS: dict[str, Prompting] = {
    **{name: Prompting(turns, QUESTION_SUFFIX) for name, turns in FEWSHOT.items()},
    "countdown": Prompting(COUNTDOWN_FEWSHOT_PREFIX, COUNTDOWN_SUFFIX),
}


def build_messages(
    question: str, fewshot: Sequence[dict] = FEWSHOT_PREFIX, suffix: str = QUESTION_SUFFIX
) -> list[dict[str, str]]:
    """The few-shot prefix followed by the question and the answer-format suffix."""
    return [*fewshot, {"role": "user", "content": question + suffix}]


def render_prompt(
    tokenizer: Any, question: str, fewshot: Sequence[dict] = FEWSHOT_PREFIX, suffix: str = QUESTION_SUFFIX
) -> list[int]:
    """Prompt tokens from the tokenizer's own chat template (generation prompt on, thinking off)."""
    text = tokenizer.apply_chat_template(
        build_messages(question, fewshot, suffix), tokenize=False, add_generation_prompt=True,
        enable_thinking=False,
    )
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if not tokens:
        raise ValueError("the rendered prompt is empty")
    return [int(t) for t in tokens]


def stop_sequences(tokenizer: Any) -> list[str]:
    """Stop strings: the tokenizer's eos token, plus `<|im_end|>` when the vocabulary has it."""
    candidates = [getattr(tokenizer, "eos_token", None)]
    if "<|im_end|>" in tokenizer.get_vocab():
        candidates.append("<|im_end|>")
    return list(dict.fromkeys(c for c in candidates if c))


def completion_text(tokenizer: Any, sequence: Any) -> str:
    """The text of a sampled sequence (the server's `text` when present, else decoded tokens)."""
    if getattr(sequence, "text", None) is not None:
        return sequence.text
    return tokenizer.decode(sequence.tokens, skip_special_tokens=True)
