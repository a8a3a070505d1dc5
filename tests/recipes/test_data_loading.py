"""GSM8K rows from local jsonl/parquet files and folders, the hub-unreachable error, and the arithmetic task."""

import json
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipes.grpo_lib import (
    DataUnavailableError,
    arithmetic_rows,
    eval_data_file,
    grade,
    gsm8k_final_answer,
    load_rows,
)


@pytest.fixture
def tiny_jsonl(fixtures_dir) -> Path:
    return fixtures_dir / "gsm8k_tiny.jsonl"


@pytest.fixture
def expected_rows(tiny_jsonl) -> list[dict]:
    with open(tiny_jsonl) as f:
        return [json.loads(line) for line in f]


def write_parquet(rows: list[dict], path: Path, extra_column: bool = False) -> Path:
    columns = {"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]}
    if extra_column:
        columns["source"] = ["handwritten"] * len(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def test_fixture_rows_are_gsm8k_format(expected_rows):
    assert len(expected_rows) == 12
    for row in expected_rows:
        assert set(row) == {"question", "answer"}
        assert re.fullmatch(r"-?\d+", gsm8k_final_answer(row["answer"]))
        # every worked answer is graded right when boxed
        assert grade(f"\\boxed{{{gsm8k_final_answer(row['answer'])}}}", row["answer"]) == 1.0


def test_load_jsonl(tiny_jsonl, expected_rows):
    rows = load_rows("gsm8k", "train", tiny_jsonl)
    assert rows == expected_rows
    assert load_rows("gsm8k", "train", str(tiny_jsonl), n=5) == expected_rows[:5]


def test_load_parquet_matches_jsonl(tmp_path, expected_rows):
    path = write_parquet(expected_rows, tmp_path / "gsm8k_tiny.parquet", extra_column=True)
    rows = load_rows("gsm8k", "train", path)
    assert rows == expected_rows  # extra columns dropped, order kept


def test_load_from_folder_picks_the_split(tmp_path, tiny_jsonl, expected_rows):
    shutil.copy(tiny_jsonl, tmp_path / "train.jsonl")
    with open(tmp_path / "test.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in expected_rows[:3])
    assert load_rows("gsm8k", "train", tmp_path) == expected_rows
    assert load_rows("gsm8k", "test", tmp_path) == expected_rows[:3]


def test_load_from_hf_style_parquet_folder(tmp_path, expected_rows):
    write_parquet(expected_rows[:8], tmp_path / "main" / "train-00000-of-00001.parquet")
    write_parquet(expected_rows[8:], tmp_path / "main" / "test-00000-of-00001.parquet")
    assert load_rows("gsm8k", "train", tmp_path) == expected_rows[:8]
    assert load_rows("gsm8k", "test", tmp_path) == expected_rows[8:]


def test_missing_split_or_file_is_a_clear_error(tmp_path, tiny_jsonl):
    shutil.copy(tiny_jsonl, tmp_path / "train.jsonl")
    with pytest.raises(FileNotFoundError, match="test"):
        load_rows("gsm8k", "test", tmp_path)
    with pytest.raises(FileNotFoundError, match="no such"):
        load_rows("gsm8k", "train", tmp_path / "nope.jsonl")


def test_rows_without_question_or_answer_are_rejected(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q?", "solution": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="answer"):
        load_rows("gsm8k", "train", path)


def test_hub_unreachable_tells_user_to_pass_data_file(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the libraries read these variables at import time, so set their module flags too
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(DataUnavailableError) as info:
        load_rows("gsm8k", "train")
    message = str(info.value)
    assert "--data-file" in message
    assert "../shared/data/gsm8k" in message
    assert "openai/gsm8k" in message
    assert time.perf_counter() - t0 < 10


def test_unknown_dataset_rejected():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_rows("mathqa", "train")


# ---- test-split location --------------------------------------------------------------------------------------


def ns(**kw):
    base = {"test_file": None, "dataset": "gsm8k", "data_file": None}
    return SimpleNamespace(**{**base, **kw})


def test_eval_data_file_resolution(tmp_path, tiny_jsonl):
    assert eval_data_file(ns()) is None  # hub
    assert eval_data_file(ns(dataset="arithmetic")) is None
    assert eval_data_file(ns(data_file=str(tmp_path), test_file="t.jsonl")) == "t.jsonl"
    assert eval_data_file(ns(data_file=str(tmp_path))) == str(tmp_path)  # folder: its test file
    shutil.copy(tiny_jsonl, tmp_path / "train.jsonl")
    shutil.copy(tiny_jsonl, tmp_path / "test.jsonl")
    assert eval_data_file(ns(data_file=str(tmp_path / "train.jsonl"))) == str(tmp_path / "test.jsonl")
    with pytest.raises(ValueError, match="--test-file"):
        eval_data_file(ns(data_file=str(tiny_jsonl)))


# ---- arithmetic ------------------------------------------------------------------------------------------------


def pair(row):
    a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["question"]).groups()
    return int(a), int(b)


def test_arithmetic_rows_format():
    rows = load_rows("arithmetic", "train", seed=3, n=20)
    assert len(rows) == 20
    for row in rows:
        a, b = pair(row)
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["answer"] == f"{a} + {b} = {a + b}\n#### {a + b}"
        assert grade(f"so \\boxed{{{a + b}}}", row["answer"]) == 1.0
        assert grade(f"so \\boxed{{{a + b + 1}}}", row["answer"]) == 0.0


def test_arithmetic_splits_are_disjoint_and_cover_all_pairs():
    train = {pair(r) for r in arithmetic_rows("train", seed=0)}
    test_a = {pair(r) for r in arithmetic_rows("test", seed=0)}
    test_b = {pair(r) for r in arithmetic_rows("test", seed=99)}
    assert test_a == test_b  # the split does not depend on the seed
    assert not train & test_a
    assert len(train) + len(test_a) == 90 * 90
    assert 0.05 < len(test_a) / (90 * 90) < 0.15


def test_arithmetic_order_is_seeded():
    assert load_rows("arithmetic", "train", seed=1) == load_rows("arithmetic", "train", seed=1)
    assert load_rows("arithmetic", "train", seed=1, n=50) != load_rows("arithmetic", "train", seed=2, n=50)


def test_arithmetic_rejects_data_file_and_unknown_split(tiny_jsonl):
    with pytest.raises(ValueError, match="--data-file"):
        load_rows("arithmetic", "train", tiny_jsonl)
    with pytest.raises(ValueError, match="split"):
        load_rows("arithmetic", "validation")


SHARED_GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(not (SHARED_GSM8K / "test.jsonl").exists(), reason="no shared GSM8K copy on this machine")
def test_shared_gsm8k_copy_loads_and_grades():
    rows = load_rows("gsm8k", "test", SHARED_GSM8K)
    assert len(rows) == 1319
    for row in rows:
        truth = gsm8k_final_answer(row["answer"])
        assert grade(f"\\boxed{{{truth}}}", row["answer"]) == 1.0
