"""Reward of the GSM8K demos: last \\boxed{} answer vs the number after '####'."""

import pytest

from recipes.grpo_lib import extract_boxed, grade, gsm8k_final_answer, normalize_number, upstream_grade


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("first \\boxed{3}, then I rechecked: \\boxed{75}", "75"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{42}}", "{42}"),
        ("\\boxed{1{,}000}", "1{,}000"),
        ("\\boxed{ 18 }", "18"),
        ("no box here, 42", None),
        ("\\boxed{}", None),
        ("\\boxed{7} and an empty \\boxed{}", "7"),
        ("\\boxed{5} but then it was cut off: \\boxed{12", "5"),
        ("cut off before closing \\boxed{\\frac{1}{2}", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("42", "42"),
        (" 42 ", "42"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("$18", "18"),
        ("\\$18", "18"),
        ("1000.", "1000"),
        ("1000.00", "1000"),
        ("0.50", "0.5"),
        ("1 000", "1000"),
        ("-7", "-7"),
        ("{42}", "42"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{6}{3}", "2"),
        ("-\\frac{3}{4}", "-0.75"),
        ("\\frac{1}{3}", "\\frac13"),  # not a terminating decimal: left as cleaned text, never equal to a number
        ("seven", "seven"),
    ],
)
def test_normalize_number(raw, expected):
    assert normalize_number(raw) == expected


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7") == "7"
    assert gsm8k_final_answer("The order holds 1250 pencils.\n#### 1,250") == "1250"
    assert gsm8k_final_answer("#### 12\n") == "12"
    with pytest.raises(ValueError, match="####"):
        gsm8k_final_answer("no final answer marker")


def test_grade_right_wrong_and_missing():
    answer = "Half of 96 is <<96/2=48>>48.\nA quarter of 48 is <<48/4=12>>12.\n#### 12"
    assert grade("48 / 4 = 12, so \\boxed{12}", answer) == 1.0
    assert grade("\\boxed{48}", answer) == 0.0
    assert grade("The answer is 12.", answer) == 0.0  # a bare number does not count: the format is part of it
    assert grade("\\boxed{12} ... no wait, \\boxed{13}", answer) == 0.0  # the LAST box is the answer
    assert grade("\\boxed{13} ... no wait, \\boxed{12}", answer) == 1.0


def test_grade_is_exact_not_substring():
    assert grade("\\boxed{120}", "#### 12") == 0.0
    assert grade("\\boxed{2}", "#### 12") == 0.0
    assert grade("\\boxed{12.5}", "#### 12") == 0.0


# Cases where the upstream demo's regex grader (first '}' ends the box; only commas and trailing dots
# stripped) gives the wrong reward and ours gives the right one.
UPSTREAM_WRONG = [
    ("\\boxed{\\frac{1}{2}}", "#### 0.5"),  # nested braces: upstream reads '\frac{1'
    ("\\boxed{{42}}", "#### 42"),  # doubled braces: upstream reads '{42'
    ("\\boxed{1{,}000}", "#### 1000"),  # LaTeX thousands separator: upstream reads '1{,'
    ("\\boxed{\\$1,000}", "#### 1000"),  # dollar sign kept by upstream
    ("\\boxed{$18}", "#### 18"),
    ("\\boxed{1000.00}", "#### 1000"),  # trailing zeros
    ("\\boxed{1 000}", "#### 1000"),  # inner space
]

# Cases both graders get right: a plain `1,000` and a trailing dot are handled upstream too.
BOTH_RIGHT = [
    ("\\boxed{1,000}", "#### 1000", 1.0),
    ("\\boxed{1000}", "#### 1,000", 1.0),
    ("\\boxed{1000.}", "#### 1000", 1.0),
    ("\\boxed{ 72 }", "#### 72", 1.0),
    ("\\boxed{71}", "#### 72", 0.0),
    ("no box", "#### 72", 0.0),
    ("\\boxed{7} then \\boxed{}", "#### 7", 1.0),
]


@pytest.mark.parametrize("completion, answer", UPSTREAM_WRONG)
def test_upstream_grader_misses_what_ours_gets(completion, answer):
    assert upstream_grade(completion, answer) == 0.0
    assert grade(completion, answer) == 1.0


@pytest.mark.parametrize("completion, answer, expected", BOTH_RIGHT)
def test_graders_agree_on_simple_cases(completion, answer, expected):
    assert upstream_grade(completion, answer) == expected
    assert grade(completion, answer) == expected

