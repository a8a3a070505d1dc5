"""Countdown: the expression reader, the reward, and the generated problems (reachable, repeatable, split)."""

import functools
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest
import recipe_fakes
from hypothesis import given, settings
from hypothesis import strategies as st
from recipe_fakes import FakeSampler

import pytrio_compat as trio
from recipes.shapes import SHAPES_FEWSHOT
from recipes.countdown import (
    COUNTDOWN_FEWSHOT_PREFIX,
    COUNTDOWN_SUFFIX,
    MAX_DEPTH,
    MAX_EXPRESSION_CHARS,
    MAX_NODES,
    NUMBER_RANGE,
    SPLIT_SIZES,
    TARGET_RANGE,
    CountdownScore,
    ExpressionError,
    countdown_reward,
    countdown_rows,
    evaluate_expression,
    expression_numbers,
    grade_countdown,
    is_test_problem,
    parse_expression,
    problem_of_answer,
    random_problem,
    render_expression,
    score_countdown,
)
from recipes.grpo_lib import (
    DATASET_DEFAULTS,
    EVAL_GRADERS,
    FEWSHOT,
    PROMPTS,
    QUESTION_SUFFIX,
    build_arg_parser,
    build_datum,
    evaluate,
    evaluate_async,
    grade,
    group_advantages,
    is_degenerate,
    load_rows,
    render_prompt,
    sample_seed,
    shuffle_rows,
)

DEMOS = ["01-demo-sync.py", "02-demo-async.py"]


def solvable(numbers, target) -> bool:
    """Brute force, independent of the generator: merge any two remaining values with any operator (both
    orders), exactly, until one value is left."""
    values = [Fraction(x) for x in numbers]
    if len(values) == 1:
        return values[0] == target
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            a, b = values[i], values[j]
            rest = values[:i] + values[i + 1:j] + values[j + 1:]
            results = [a + b, a - b, b - a, a * b] + ([a / b] if b else []) + ([b / a] if a else [])
            if any(solvable(rest + [r], target) for r in results):
                return True
    return False


def test_solver_itself():
    assert solvable([4, 9, 6], 42) and solvable([25, 3, 8, 2], 63) and solvable([3, 3, 8, 8], 24)  # 8/(3-8/3)
    assert not solvable([1, 1, 1], 100) and not solvable([2, 2], 5)


# ---- worked examples -----------------------------------------------------------------------------------------

NUMBERS, TARGET = (4, 9, 6), 42


@pytest.mark.parametrize(
    "completion, format_ok, correct",
    [
        ("9 * 4 = 36 and 36 + 6 = 42. \\boxed{9 * 4 + 6}", True, True),
        ("\\boxed{6 + 4 * 9}", True, True),  # any order, precedence respected
        ("\\boxed{(9 * 4) + (6)}", True, True),  # redundant parentheses are fine
        ("\\boxed{9 \\times 4 + 6}", True, True),  # LaTeX and Unicode operators read as * and /
        ("\\boxed{9×4+6}", True, True),
        ("\\boxed{4 * 9} ... no: \\boxed{4 * 9 + 6}", True, True),  # the last box is the answer
        ("\\boxed{(9 + 4) * 6}", True, False),  # the right numbers, the wrong value (78)
        ("\\boxed{9 * 4}", True, False),  # 6 not used
        ("\\boxed{9 * 4 + 6 + 6 - 6}", True, False),  # 6 used three times
        ("\\boxed{(9 * 4 + 6) * (4 + 6 - 9)}", True, False),  # 42, but each number used twice
        ("\\boxed{7 * 6}", True, False),  # 42, but 7 is not given
        ("\\boxed{42}", True, False),  # the value, not an expression of the numbers
        ("\\boxed{9 * 4 + 6 = 42}", False, False),  # '=' is not part of an expression
        ("\\boxed{9 ** 1 * 4 + 6}", False, False),  # powers refused
        ("\\boxed{9 * 4.0 + 6}", False, False),  # decimals refused
        ("\\boxed{-4 + 9 * 6 - 8}", False, False),  # no unary minus
        ("\\boxed{__import__('os').getpid()}", False, False),  # names, calls, attributes: never run
        ("\\boxed{abs(9) * 4 + 6}", False, False),
        ("\\boxed{9 * 4 + }", False, False),
        ("\\boxed{(9 * 4 + 6}", False, False),
        ("9 * 4 + 6 = 42", False, False),  # no box
        ("\\boxed{9 * 4 + 6", False, False),  # cut off before the box closed
    ],
)
def test_score_worked_examples(completion, format_ok, correct):
    score = score_countdown(completion, NUMBERS, TARGET)
    assert score == CountdownScore(format_ok=format_ok, correct=correct)
    assert score.reward() == (1.0 if correct else 0.1 if format_ok else 0.0)
    assert score.reward(format_bonus=0.0) == float(correct)


def test_division_by_zero_is_wrong_not_an_error():
    assert evaluate_expression(parse_expression("3 / (5 - 5)")) is None
    assert evaluate_expression(parse_expression("(3 / (5 - 5)) * 0")) is None  # no value, even times zero
    assert score_countdown("\\boxed{3 / (5 - 5)}", (5, 5, 3), 1) == CountdownScore(format_ok=True, correct=False)
    assert score_countdown("\\boxed{9 * 4 + 6 / (9 - 9)}", (9, 4, 6, 9), 42) == CountdownScore(True, False)


def test_exact_arithmetic():
    assert score_countdown("\\boxed{3 / 4 * 8}", (3, 4, 8), 6).correct  # 3/4 is not an integer on the way
    assert score_countdown("\\boxed{8 / (3 - 8 / 3)}", (8, 3, 8, 3), 24).correct  # 24 exactly, not 23.99...
    assert not score_countdown("\\boxed{8 / 3 * 3 + 1}", (8, 3, 3, 1), 10).correct  # 9


def test_reward_and_grade_read_the_rows_answer():
    answer = "9 * 4 + 6 = 42\n#### 42"
    assert sorted(problem_of_answer(answer)[0]) == [4, 6, 9] and problem_of_answer(answer)[1] == 42
    assert countdown_reward("\\boxed{6 + 9 * 4}", answer) == 1.0
    assert countdown_reward("\\boxed{6 + 9 + 4}", answer) == 0.1
    assert countdown_reward("\\boxed{6 + 9 + 4}", answer, format_bonus=0.0) == 0.0
    assert countdown_reward("no answer", answer) == 0.0
    assert grade_countdown("\\boxed{6 + 9 * 4}", answer) == 1.0
    assert grade_countdown("\\boxed{6 + 9 + 4}", answer) == 0.0  # evaluation counts solutions only
    with pytest.raises(ValueError, match="####"):
        problem_of_answer("9 * 4 + 6 = 42")


# ---- the reader's refusals and bounds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, reason",
    [
        ("2 ** 3", "powers"),
        ("2 ^ 3", "unexpected character '\\^'"),
        ("x + 1", "unexpected character 'x'"),
        ("(lambda: 1)()", "unexpected character 'l'"),
        ("1.5 + 2", "decimal"),
        (".5 + 2", "decimal"),
        ("1e3", "unexpected character 'e'"),
        ("-3 + 5", "expected a number"),
        ("+3", "expected a number"),
        ("3 5", "unexpected '5' after"),
        ("(3 + 5", "ends too early"),
        ("3 + 5)", "unexpected '\\)' after"),
        ("()", "expected a number"),
        ("", "empty"),
        ("   ", "empty"),
    ],
)
def test_refused_expressions(text, reason):
    with pytest.raises(ExpressionError, match=reason):
        parse_expression(text)


def test_a_10kB_expression_is_refused_by_its_length_before_tokenizing():
    text = "1+" * 5000 + "1"
    with pytest.raises(ExpressionError, match=f"longer than {MAX_EXPRESSION_CHARS} characters"):
        parse_expression(text)
    assert score_countdown(f"\\boxed{{{text}}}", NUMBERS, TARGET) == CountdownScore(False, False)


def test_short_expressions_with_many_nodes_are_refused_by_the_node_bound():
    text = "+".join(["1"] * 8)  # 15 characters, 15 nodes: allowed
    assert len(expression_numbers(parse_expression(text))) == 8
    with pytest.raises(ExpressionError, match=f"more than {MAX_NODES} numbers and operators"):
        parse_expression(text + "+1")


def test_deep_parentheses_are_refused_by_the_depth_bound():
    assert parse_expression("(" * MAX_DEPTH + "4" + ")" * MAX_DEPTH) == 4
    deep = "(" * (MAX_DEPTH + 1) + "4" + ")" * (MAX_DEPTH + 1)
    with pytest.raises(ExpressionError, match=f"nested deeper than {MAX_DEPTH}"):
        parse_expression(deep)
    # within the length bound but far past the depth bound: refused at depth MAX_DEPTH, no deep recursion
    with pytest.raises(ExpressionError, match="nested deeper"):
        parse_expression("(" * 99 + "4" + ")" * 99)


def test_long_numbers_are_refused_before_conversion():
    with pytest.raises(ExpressionError, match="more than 6 digits"):
        parse_expression("9" * 150)  # int() of it would be fine, but not of 5000 digits: never reached


def tree_depth(tree) -> int:
    return 0 if isinstance(tree, int) else 1 + max(tree_depth(tree[1]), tree_depth(tree[2]))


@given(st.text(alphabet="0123456789+-*/() .x^=", max_size=300))
@settings(max_examples=300)
def test_any_text_is_refused_or_parsed_within_bounds(text):
    try:
        tree = parse_expression(text)
    except ExpressionError:
        return
    n_numbers = len(expression_numbers(tree))
    assert 2 * n_numbers - 1 <= MAX_NODES
    assert tree_depth(tree) < MAX_NODES
    evaluate_expression(tree)  # a value or None, never an exception
    score_countdown(f"\\boxed{{{text}}}", NUMBERS, TARGET)


trees = st.recursive(
    st.integers(1, 99),
    lambda sub: st.tuples(st.sampled_from("+-*/"), sub, sub),
    max_leaves=6,
)


@given(trees)
@settings(max_examples=300)
def test_render_keeps_the_value_and_the_numbers(tree):
    text = render_expression(tree)
    again = parse_expression(text)
    assert evaluate_expression(again) == evaluate_expression(tree)
    assert expression_numbers(again) == expression_numbers(tree)
    assert render_expression(again) == text


def test_render_uses_only_the_needed_parentheses():
    assert render_expression(("-", ("*", ("+", 25, 8), 2), 3)) == "(25 + 8) * 2 - 3"
    assert render_expression(("-", 8, ("-", 3, 2))) == "8 - (3 - 2)"
    assert render_expression(("+", 8, ("-", 3, 2))) == "8 + 3 - 2"
    assert render_expression(("/", 8, ("*", 3, 2))) == "8 / (3 * 2)"
    assert render_expression(("*", 8, ("/", 3, 2))) == "8 * 3 / 2"


# ---- generated problems --------------------------------------------------------------------------------------


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=200)
def test_every_generated_problem_is_reachable_and_its_witness_scores_right(seed):
    problem = random_problem(random.Random(seed))
    assert len(problem.numbers) in (3, 4)
    assert all(NUMBER_RANGE[0] <= x <= NUMBER_RANGE[1] for x in problem.numbers)
    assert TARGET_RANGE[0] <= problem.target <= TARGET_RANGE[1]
    assert solvable(problem.numbers, problem.target)
    assert score_countdown(f"\\boxed{{{problem.witness}}}", problem.numbers, problem.target) == CountdownScore(
        True, True)


def key(row):
    return tuple(sorted(row["numbers"])), row["target"]


@given(st.integers(0, 10**9), st.sampled_from(["train", "test"]))
@settings(max_examples=25, deadline=None)
def test_rows_are_deterministic_and_in_their_split(seed, split):
    rows = countdown_rows(split, seed, n=20)
    assert rows == countdown_rows(split, seed, n=20)
    assert rows[:5] == countdown_rows(split, seed, n=5)  # a shorter request is a prefix
    assert len({key(r) for r in rows}) == len(rows)
    for row in rows:
        assert is_test_problem(row["numbers"], row["target"]) == (split == "test")
        assert row["question"] == f"Using the numbers {', '.join(map(str, row['numbers']))}, make {row['target']}."
        assert sorted(problem_of_answer(row["answer"])[0]) == sorted(row["numbers"])
        witness = row["answer"].split(" = ")[0]
        assert countdown_reward(f"\\boxed{{{witness}}}", row["answer"]) == 1.0
        assert solvable(row["numbers"], row["target"])


@given(st.integers(0, 10**9), st.integers(0, 10**9))
@settings(max_examples=10, deadline=None)
def test_splits_are_disjoint_whatever_the_seeds(train_seed, test_seed):
    train = {key(r) for r in countdown_rows("train", train_seed, n=150)}
    test = {key(r) for r in countdown_rows("test", test_seed, n=150)}
    assert not train & test


def test_full_splits():
    train, test = countdown_rows("train"), countdown_rows("test")
    assert (len(train), len(test)) == (SPLIT_SIZES["train"], SPLIT_SIZES["test"])
    assert len({key(r) for r in train}) == len(train) and len({key(r) for r in test}) == len(test)
    assert not {key(r) for r in train} & {key(r) for r in test}
    counts = [len(r["numbers"]) for r in train]
    assert 0.4 < counts.count(3) / len(counts) < 0.6  # three and four numbers about equally often
    assert countdown_rows("train", seed=1, n=50) != countdown_rows("train", seed=2, n=50)
    assert countdown_rows("test", n=10**6) == test  # capped at the split's size


def test_unknown_split():
    with pytest.raises(ValueError, match="split"):
        countdown_rows("validation")


# ---- prompt ----------------------------------------------------------------------------------------------------

QUESTION = re.compile(r"Using the numbers ([\d, ]+), make (\d+)\.")


def test_fewshot_answers_are_right_and_not_test_problems():
    turns = COUNTDOWN_FEWSHOT_PREFIX
    assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
    for user, assistant in zip(turns[::2], turns[1::2]):
        assert user["content"].endswith(COUNTDOWN_SUFFIX)
        numbers, target = QUESTION.match(user["content"]).groups()
        numbers, target = [int(x) for x in numbers.split(", ")], int(target)
        assert score_countdown(assistant["content"], numbers, target) == CountdownScore(True, True)
        assert not is_test_problem(numbers, target)


# ---- wiring: --dataset countdown through the options, the data, the prompt and both demos ---------------------

def test_options_data_and_prompt_of_countdown(recipe_tokenizer):
    args = build_arg_parser("t").parse_args(["--dataset", "countdown"])
    assert all(getattr(args, k) == v for k, v in DATASET_DEFAULTS["countdown"].items())
    assert 64 <= args.max_tokens <= 128
    assert load_rows("countdown", "test", n=7) == countdown_rows("test", 0, 7)
    assert load_rows("countdown", "train", seed=4) == countdown_rows("train", 4)
    with pytest.raises(ValueError, match="--data-file"):
        load_rows("countdown", "train", "somewhere.jsonl")
    # the other datasets keep their prompt; countdown has its own few-shot turns and suffix
    assert {name: tuple(p) for name, p in PROMPTS.items()} == {
        **{name: (turns, QUESTION_SUFFIX) for name, turns in FEWSHOT.items()},
        "countdown": (COUNTDOWN_FEWSHOT_PREFIX, COUNTDOWN_SUFFIX), "shapes": (SHAPES_FEWSHOT, QUESTION_SUFFIX)}
    assert EVAL_GRADERS["countdown"] is not grade and EVAL_GRADERS["arithmetic"] is grade
    question = countdown_rows("test", 0, 1)[0]["question"]
    text = recipe_tokenizer.decode(render_prompt(recipe_tokenizer, question, *PROMPTS["countdown"]))
    assert "strawberry" not in text and "\\boxed{(25 + 8) * 2 - 3}" in text
    assert text.endswith(f"<|im_start|>user\n{question}{COUNTDOWN_SUFFIX}<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@functools.cache
def solutions() -> dict[str, str]:
    """The generator's solution of every question the demos below ask (train seed 7, test seed 0)."""
    return {row["question"]: row["answer"].split(" = ")[0]
            for split, seed in (("train", 7), ("test", 0)) for row in countdown_rows(split, seed)}


class CountdownSampler(FakeSampler):
    """Answers Countdown prompts: sampling picks the solution, a well-formed wrong expression or no box at all
    (seeded); greedy answers right exactly when the target is even, else well-formed but wrong."""

    def _respond(self, prompt, num_samples, sampling_params):
        tok = self.service.tokenizer
        self.service.sample_calls.append({"num_samples": num_samples, "params": sampling_params,
                                          "prompt": list(prompt.to_ints())})
        question = QUESTION.findall(tok.decode(prompt.to_ints()))[-1]
        question = f"Using the numbers {question[0]}, make {question[1]}."
        solution, target = solutions()[question], int(question.rsplit(" ", 1)[1][:-1])
        rng = random.Random(sampling_params.seed)
        seqs = []
        for _ in range(num_samples):
            kind = ("right" if target % 2 == 0 else "formatted") if sampling_params.temperature == 0 else (
                rng.choice(["right", "formatted", "unformatted"]))
            body = {"right": f"\\boxed{{{solution}}}", "formatted": f"\\boxed{{{solution} + 0}}",
                    "unformatted": f"{solution} = {target}"}[kind]
            tokens = tok.encode(body, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
            logprobs = [-round(rng.uniform(0.01, 2.0), 4) for _ in tokens]
            seqs.append(trio.types.SampleSequence(stop_reason="stop", tokens=tokens, logprobs=logprobs,
                                                  text=tok.decode(tokens, skip_special_tokens=True)))
        return trio.types.SampleResponse(sequences=seqs)


@pytest.fixture
def countdown_service(fake_service, monkeypatch):
    monkeypatch.setattr(recipe_fakes, "FakeSampler", CountdownSampler)  # what the fake training client returns
    return fake_service


def countdown_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--dataset", "countdown", "--steps", "2", "--batch-size", "3", "--group-size", "4", "--seed", "7",
            "--eval-every", "1", "--eval-size", "9", "--log-dir", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("script", DEMOS)
def test_demo_runs_countdown(script, tmp_path, countdown_service, load_demo, recipe_tokenizer):
    summary = load_demo(script).main(countdown_args(tmp_path))
    fewshot, suffix = PROMPTS["countdown"]
    train_rows = shuffle_rows(load_rows("countdown", "train", seed=7), 7)

    # Rollouts: the countdown prompt, the dataset's max_tokens; step 0 rebuilt by hand from the library pieces,
    # its rewards computed from the rows' numbers and targets.
    rollouts = [c for c in countdown_service.sample_calls if c["params"].temperature != 0]
    assert len(rollouts) == 2 * 3
    for k, call in enumerate(rollouts):
        step, i = divmod(k, 3)
        assert call["prompt"] == render_prompt(recipe_tokenizer, train_rows[step * 3 + i]["question"], fewshot, suffix)
        assert call["params"].max_tokens == DATASET_DEFAULTS["countdown"]["max_tokens"]
        assert call["params"].seed == sample_seed(7, step, i)
    sampler, expected, rewards_all = CountdownSampler(countdown_service), [], []
    for i, row in enumerate(train_rows[:3]):
        prompt = render_prompt(recipe_tokenizer, row["question"], fewshot, suffix)
        params = trio.SamplingParams(max_tokens=96, temperature=1.0, top_p=1.0, stop=["<|im_end|>"],
                                     seed=sample_seed(7, 0, i))
        result = sampler.sample(trio.ModelInput.from_ints(prompt), 4, params).result()
        rewards = [score_countdown(s.text, row["numbers"], row["target"]).reward() for s in result.sequences]
        rewards_all += rewards
        if not is_degenerate(rewards):
            expected += [build_datum(prompt, s.tokens, s.logprobs, adv)
                         for s, adv in zip(result.sequences, group_advantages(rewards))]
    assert set(rewards_all) == {0.0, 0.1, 1.0}  # no box, well-formed but wrong, right
    assert [d.model_dump() for d in summary["first_step_datums"]] == [d.model_dump() for d in expected]
    history = summary["history"]
    assert history[0]["reward"] == pytest.approx(sum(rewards_all) / len(rewards_all))

    # Evaluation: greedy answers are right for even targets and well-formed otherwise; only right ones count.
    eval_rows = load_rows("countdown", "test", n=9)
    accuracy = sum(r["target"] % 2 == 0 for r in eval_rows) / 9
    assert 0 < accuracy < 1
    assert [row["eval/accuracy"] for row in history] == pytest.approx([accuracy] * 3)
    assert summary["final_eval_accuracy"] == pytest.approx(accuracy)
    assert any(row["datums"] > 0 for row in history)


def test_sync_and_async_agree_on_countdown(tmp_path, countdown_service, load_demo):
    sync = load_demo("01-demo-sync.py").main(countdown_args(tmp_path / "sync"))
    async_ = load_demo("02-demo-async.py").main(countdown_args(tmp_path / "async"))
    assert sync["first_step_datums"]
    assert [d.model_dump() for d in sync["first_step_datums"]] == [d.model_dump() for d in async_["first_step_datums"]]
    for a, b in zip(sync["history"], async_["history"]):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")}


def test_evaluate_with_the_countdown_grader(countdown_service, recipe_tokenizer):
    import asyncio

    rows = load_rows("countdown", "test", n=10)
    accuracy = sum(r["target"] % 2 == 0 for r in rows) / 10
    sampler = CountdownSampler(countdown_service)
    fewshot, suffix = PROMPTS["countdown"]
    assert evaluate(sampler, recipe_tokenizer, rows, 96, fewshot, suffix, EVAL_GRADERS["countdown"]) == accuracy
    coro = evaluate_async(sampler, recipe_tokenizer, rows, 96, fewshot, suffix, EVAL_GRADERS["countdown"])
    assert asyncio.run(coro) == accuracy


@pytest.mark.parametrize("script", DEMOS)
def test_demo_trains_countdown_against_worker(script, demo_on_worker):
    """The real worker and the tiny random model's tokenizer; the reward alternates 1, 0 within each group
    so every step trains (the tiny model never solves a problem)."""
    summary, calls = demo_on_worker(script, "--dataset", "countdown", "--steps", "2", "--learning-rate", "1e-3",
                                    "--eval-every", "2", "--eval-size", "2", reward="countdown_reward")
    history = summary["history"]
    assert len(calls) == 2 * 2 * 4
    assert [row["step"] for row in history] == [0, 1, 2]
    for row in history[:2]:
        assert row["datums"] == 8 and row["reward"] == 0.5 and abs(row["kl_sample_train"]) < 1e-3
    assert history[0]["eval/accuracy"] == 0.0 == history[2]["eval/accuracy"]  # 6 random tokens solve nothing
