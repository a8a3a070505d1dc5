"""Countdown: reach a target number from three or four given numbers with + - * / and parentheses.

The task TinyZero used to reproduce DeepSeek-R1-Zero (reasoning learned from RL alone) on a 3B model: an
answer is easy to check exactly and hard to guess, so the reward says precisely whether the problem is solved.

* Problems are generated, not downloaded: numbers 1-99, a target 1-100 built by combining the numbers in a
  random expression tree with exact rational arithmetic, so every target is reachable and the tree is a
  worked solution (the witness). A fixed hash of the problem puts it in the train or the test split, so the
  splits are disjoint whatever the seed; the seed only chooses which problems are drawn, and their order.
* The answer is an expression inside `\\boxed{}`, as for the recipes' other datasets (see COUNTDOWN_SUFFIX).
* The reward never runs model text: the boxed expression is read by a small tokenizer and a recursive-descent
  parser that know only integers, + - * /, and parentheses, with the length, node count and nesting bounded
  before anything is evaluated, and is evaluated with `fractions.Fraction` (exact; division by zero is wrong).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Union

from grpo_grading import extract_boxed


# ---- expressions: integers, + - * / and parentheses ------------------------------------------------------

# A parsed expression: an int (a number as written) or (operator, left, right).
Expr = Union[int, tuple[str, "Expr", "Expr"]]

OPERATORS = "+-*/"
# Spellings of the operators that models write (LaTeX inside \boxed{}, Unicode), read as the plain ones.
OPERATOR_SPELLINGS = {"\\times": "*", "\\cdot": "*", "\\div": "/", "×": "*", "·": "*", "÷": "/", "−": "-"}

# Bounds checked before evaluation. A Countdown answer uses at most 4 numbers (7 nodes); these leave room for
# spaces, LaTeX operators and redundant parentheses, and refuse anything longer at once, so reading and
# evaluating a boxed answer takes at most a few hundred steps.
MAX_EXPRESSION_CHARS = 200
MAX_NODES = 15  # numbers + operators
MAX_DEPTH = 10  # nesting of parentheses
MAX_DIGITS = 6  # per number (the given numbers have at most 2)


class ExpressionError(ValueError):
    """The text is not an expression the Countdown reward accepts (the message says why)."""


def _spelling_at(text: str, i: int) -> str | None:
    return next((s for s in OPERATOR_SPELLINGS if text.startswith(s, i)), None)


def tokenize(text: str) -> list[str]:
    """The tokens of `text`: numbers (digit strings), operators and parentheses; spaces are dropped.

    Refused: text over MAX_EXPRESSION_CHARS, more than MAX_NODES numbers and operators, a number of more than
    MAX_DIGITS digits, `**`, a decimal point, and any other character (names, calls, `=`, `^`, ...).
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    tokens: list[str] = []
    nodes, i = 0, 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        if "0" <= ch <= "9":
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_DIGITS:
                raise ExpressionError(f"a number of more than {MAX_DIGITS} digits")
            token, i = text[i:j], j
        elif text.startswith("**", i):
            raise ExpressionError("powers (**) are not allowed")
        elif ch in OPERATORS or ch in "()":
            token, i = ch, i + 1
        elif ch == ".":
            raise ExpressionError("decimal numbers are not allowed")
        elif (spelling := _spelling_at(text, i)) is not None:
            token, i = OPERATOR_SPELLINGS[spelling], i + len(spelling)
        else:
            raise ExpressionError(f"unexpected character {ch!r}")
        if token not in "()":
            nodes += 1
            if nodes > MAX_NODES:
                raise ExpressionError(f"more than {MAX_NODES} numbers and operators")
        tokens.append(token)
    return tokens


class _Parser:
    """Recursive descent over the tokens, operators left-associative, * / binding tighter than + -:

        expression := term (("+" | "-") term)*
        term       := factor (("*" | "/") factor)*
        factor     := NUMBER | "(" expression ")"

    No unary operators: the given numbers are positive and a solution combines them with binary operators.
    """

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("the expression ends too early")
        self.pos += 1
        return token

    def expression(self, depth: int) -> Expr:
        node = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            node = (op, node, self.term(depth))
        return node

    def term(self, depth: int) -> Expr:
        node = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            node = (op, node, self.factor(depth))
        return node

    def factor(self, depth: int) -> Expr:
        token = self.take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            node = self.expression(depth + 1)
            if self.take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return node
        if token.isdigit():
            return int(token)
        raise ExpressionError(f"expected a number or '(', got {token!r}")


def parse_expression(text: str) -> Expr:
    """The expression tree of `text`, or ExpressionError. Bounded: see `tokenize` and MAX_DEPTH."""
    tokens = tokenize(text)
    if not tokens:
        raise ExpressionError("empty expression")
    parser = _Parser(tokens)
    tree = parser.expression(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after the expression")
    return tree


def combine(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    """`a op b` exactly; None for a division by zero."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 else a / b


def evaluate_expression(tree: Expr) -> Fraction | None:
    """The exact value of `tree`; None when it divides by zero."""
    if isinstance(tree, int):
        return Fraction(tree)
    op, left, right = tree
    a, b = evaluate_expression(left), evaluate_expression(right)
    return None if a is None or b is None else combine(op, a, b)


def expression_numbers(tree: Expr) -> list[int]:
    """The numbers written in `tree`, left to right."""
    if isinstance(tree, int):
        return [tree]
    _, left, right = tree
    return expression_numbers(left) + expression_numbers(right)


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def render_expression(tree: Expr) -> str:
    """`tree` as text with only the parentheses it needs: `(25 + 8) * 2 - 3`."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree

    def side(child: Expr, is_right: bool) -> str:
        text = render_expression(child)
        if isinstance(child, int):
            return text
        child_prec, prec = _PRECEDENCE[child[0]], _PRECEDENCE[op]
        # a - (b + c) and a / (b * c) need theirs; a + (b - c) and a * (b / c) do not (exact arithmetic)
        if child_prec < prec or (is_right and child_prec == prec and op in "-/"):
            return f"({text})"
        return text

    return f"{side(left, False)} {op} {side(right, True)}"


# ---- problems ----------------------------------------------------------------------------------------------

NUMBER_RANGE = (1, 99)
TARGET_RANGE = (1, 100)
NUMBER_COUNTS = (3, 4)
SPLIT_SIZES = {"train": 5_000, "test": 500}


@dataclass(frozen=True)
class CountdownProblem:
    """Numbers to use (each exactly once, in the order the question lists them), the target, and one
    expression that reaches it (the generator's own solution)."""

    numbers: tuple[int, ...]
    target: int
    witness: str


def is_test_problem(numbers: Sequence[int], target: int) -> bool:
    """Whether the problem belongs to the test split (about 10% do). A fixed hash of the sorted numbers and
    the target, independent of any seed and of the order the numbers are listed in."""
    key = ",".join(str(x) for x in sorted(numbers)) + f"->{target}"
    return zlib.crc32(key.encode()) % 10 == 0


def random_problem(rng: random.Random) -> CountdownProblem:
    """A problem drawn from `rng`: 3 or 4 numbers in NUMBER_RANGE, and the value of a random expression tree
    over them (random pairs merged with random operators until one tree is left); numbers and tree are drawn
    again until that value is an integer within TARGET_RANGE (no fraction, zero, negative or huge target)."""
    count = rng.choice(NUMBER_COUNTS)  # drawn once, so the rejections do not favour three numbers
    while True:
        numbers = tuple(rng.randint(*NUMBER_RANGE) for _ in range(count))
        parts: list[tuple[Expr, Fraction | None]] = [(x, Fraction(x)) for x in numbers]
        while len(parts) > 1:
            (left, a), (right, b) = (parts.pop(rng.randrange(len(parts))) for _ in range(2))
            op = rng.choice(OPERATORS)
            value = None if a is None or b is None else combine(op, a, b)
            parts.append(((op, left, right), value))
        tree, value = parts[0]
        if value is not None and value.denominator == 1 and TARGET_RANGE[0] <= value <= TARGET_RANGE[1]:
            return CountdownProblem(numbers, int(value), render_expression(tree))


def countdown_problems(split: str, seed: int = 0) -> Iterator[CountdownProblem]:
    """An endless stream of distinct problems of `split`, the same for the same (split, seed)."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"countdown has splits 'train' and 'test', not {split!r}")
    rng = random.Random(zlib.crc32(f"countdown:{split}:{seed}".encode()))
    seen: set[tuple[tuple[int, ...], int]] = set()
    want_test = split == "test"
    while True:
        problem = random_problem(rng)
        key = (tuple(sorted(problem.numbers)), problem.target)
        if is_test_problem(*key) == want_test and key not in seen:
            seen.add(key)
            yield problem


def countdown_question(numbers: Sequence[int], target: int) -> str:
    """The question of one problem, e.g. "Using the numbers 4, 9, 6, make 42." (COUNTDOWN_SUFFIX follows)."""
    return f"Using the numbers {', '.join(str(x) for x in numbers)}, make {target}."


def problem_row(problem: CountdownProblem) -> dict:
    """A row like the other datasets' (`question`, and a GSM8K-style `answer`: the worked solution, then
    `#### <target>`) with the problem's `numbers` and `target` beside them."""
    return {
        "question": countdown_question(problem.numbers, problem.target),
        "answer": f"{problem.witness} = {problem.target}\n#### {problem.target}",
        "numbers": list(problem.numbers),
        "target": problem.target,
    }


def countdown_rows(split: str, seed: int = 0, n: int | None = None) -> list[dict]:
    """The first `n` rows (default: SPLIT_SIZES[split], 5,000 train / 500 test) of the split's stream.

    A prefix of a longer request: `countdown_rows(s, seed, 5) == countdown_rows(s, seed)[:5]`.
    """
    if split not in SPLIT_SIZES:
        raise ValueError(f"countdown has splits 'train' and 'test', not {split!r}")
    count = SPLIT_SIZES[split] if n is None else min(n, SPLIT_SIZES[split])
    stream = countdown_problems(split, seed)
    return [problem_row(next(stream)) for _ in range(count)]


def problem_of_answer(answer_text: str) -> tuple[list[int], int]:
    """The numbers and the target of a row's `answer`: the numbers of its worked solution (which uses each
    given number once) and the number after `####`."""
    marker = answer_text.rfind("####")
    if marker == -1:
        raise ValueError(f"no '#### <target>' in Countdown answer: {answer_text!r}")
    target = int(answer_text[marker + 4:].strip())
    solution = answer_text[:marker].strip().splitlines()[0].split("=")[0]
    return expression_numbers(parse_expression(solution)), target


# ---- prompt ------------------------------------------------------------------------------------------------

COUNTDOWN_SUFFIX = (
    " Use each number exactly once, with + - * / and parentheses, and write the expression, not its value,"
    " inside \\boxed{}."
)
# Two worked problems (3 and 4 numbers, one needing parentheses), in the style of the arithmetic few-shot.
COUNTDOWN_FEWSHOT_PREFIX: list[dict[str, str]] = [
    {"role": "user", "content": countdown_question((4, 9, 6), 42) + COUNTDOWN_SUFFIX},
    {"role": "assistant", "content": "9 * 4 = 36 and 36 + 6 = 42. \\boxed{9 * 4 + 6}"},
    {"role": "user", "content": countdown_question((25, 3, 8, 2), 63) + COUNTDOWN_SUFFIX},
    {"role": "assistant", "content": "25 + 8 = 33, 33 * 2 = 66 and 66 - 3 = 63. \\boxed{(25 + 8) * 2 - 3}"},
]


# ---- reward ------------------------------------------------------------------------------------------------

FORMAT_BONUS = 0.1  # TinyZero's format score: a well-formed answer that is wrong


@dataclass(frozen=True)
class CountdownScore:
    """format_ok: the completion ends its answer with a `\\boxed{}` expression the parser accepts.
    correct: that expression uses the given numbers, each exactly once, and equals the target."""

    format_ok: bool
    correct: bool

    def reward(self, format_bonus: float = FORMAT_BONUS) -> float:
        """1.0 when correct, `format_bonus` when only well-formed, else 0.0."""
        return 1.0 if self.correct else format_bonus if self.format_ok else 0.0


def score_countdown(completion_text: str, numbers: Sequence[int], target: int) -> CountdownScore:
    """Score the last `\\boxed{...}` of a completion (see `extract_boxed`) as an answer to the problem."""
    boxed = extract_boxed(completion_text)
    if boxed is None:
        return CountdownScore(format_ok=False, correct=False)
    try:
        tree = parse_expression(boxed)
    except ExpressionError:
        return CountdownScore(format_ok=False, correct=False)
    if sorted(expression_numbers(tree)) != sorted(numbers):
        return CountdownScore(format_ok=True, correct=False)
    return CountdownScore(format_ok=True, correct=evaluate_expression(tree) == target)


def countdown_reward(completion_text: str, answer_text: str, format_bonus: float = FORMAT_BONUS) -> float:
    """The training reward of a completion against a row's `answer`: 1.0 right, `format_bonus` well-formed."""
    return score_countdown(completion_text, *problem_of_answer(answer_text)).reward(format_bonus)


def countdown_parts(completion_text: str, answer_text: str) -> CountdownScore:
    """The reward's two parts for a row's `answer`, logged apart: well-formed, and correct."""
    return score_countdown(completion_text, *problem_of_answer(answer_text))


def grade_countdown(completion_text: str, answer_text: str) -> float:
    """1.0 if the completion solves the problem of a row's `answer`, else 0.0 (no format bonus), as
    `grpo_grading.grade` does for the boxed-number datasets."""
    return float(score_countdown(completion_text, *problem_of_answer(answer_text)).correct)
