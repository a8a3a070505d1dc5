"""Data: GSM8K from a local file or the hub, generated two-digit additions and Countdown problems, shuffling
and batching."""

from __future__ import annotations

import argparse
import json
import os
import random
import zlib
from collections.abc import Sequence
from pathlib import Path

from countdown import countdown_rows
from grpo_options import DATASETS

HUB_HINT = (
    "Pass --data-file with a local copy instead: a folder with train/test .jsonl or .parquet files "
    "(e.g. --data-file ../shared/data/gsm8k), or a single .jsonl/.parquet file with question/answer columns."
)


class DataUnavailableError(RuntimeError):
    """GSM8K could not be loaded (no local file given and the Hugging Face hub is unreachable)."""


def load_rows(
    dataset: str, split: str, data_file: str | os.PathLike | None = None, seed: int = 0, n: int | None = None
) -> list[dict]:
    """Rows `{"question", "answer"}` (GSM8K format) of one split, at most `n` of them.

    gsm8k: from `data_file` (a .jsonl/.parquet file, or a folder with `<split>.jsonl` / `<split>.parquet` /
    `<split>-*.parquet`) when given, else `datasets.load_dataset("openai/gsm8k", "main", split=split)`;
    rows keep the file order. arithmetic: generated 2-digit additions, ordered by `seed`. countdown: generated
    problems drawn by `seed` (`countdown.countdown_rows`; the rows also hold `numbers` and `target`).
    """
    if dataset in ("arithmetic", "countdown") and data_file is not None:
        raise ValueError("--data-file is only used with --dataset gsm8k")
    if dataset == "arithmetic":
        rows = arithmetic_rows(split, seed)
    elif dataset == "countdown":
        return countdown_rows(split, seed, n)  # generated one by one: only the first n
    elif dataset == "gsm8k":
        rows = _read_rows(_split_file(Path(data_file), split)) if data_file else _load_hub_gsm8k(split)
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {DATASETS}")
    return rows if n is None else rows[:n]


def eval_data_file(args: argparse.Namespace) -> str | None:
    """The file (or folder) that holds the test split: `--test-file`, else the `--data-file` folder, else
    a sibling of a `--data-file` named with "test" for "train". None means the hub (or a generated dataset)."""
    if args.test_file or args.dataset != "gsm8k" or not args.data_file:
        return args.test_file
    data = Path(args.data_file)
    if data.is_dir():
        return str(data)
    sibling = data.with_name(data.name.replace("train", "test"))
    if sibling != data and sibling.exists():
        return str(sibling)
    raise ValueError(f"cannot tell where the test split of {data} is: pass --test-file for evaluation")


def _split_file(path: Path, split: str) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no such data file or folder: {path}")
    for pattern in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet", f"{split}-*.parquet",
                    f"**/{split}.jsonl", f"**/{split}-*.parquet"):
        found = sorted(path.glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(f"no {split}.jsonl / {split}.parquet in {path}")


def _read_rows(path: Path) -> list[dict[str, str]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path, columns=["question", "answer"]).to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    rows = []
    for i, rec in enumerate(records):
        if "question" not in rec or "answer" not in rec:
            raise ValueError(f"{path}: row {i} lacks a 'question' or 'answer' field")
        rows.append({"question": str(rec["question"]), "answer": str(rec["answer"])})
    return rows


def _load_hub_gsm8k(split: str) -> list[dict[str, str]]:
    import datasets

    try:
        ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as exc:  # offline mode, DNS failure, proxy...: all mean "no hub"
        raise DataUnavailableError(
            f"could not load openai/gsm8k ({split}) from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). {HUB_HINT}"
        ) from exc
    return [{"question": r["question"], "answer": r["answer"]} for r in ds]


def _is_test_pair(a: int, b: int) -> bool:
    # A fixed hash, independent of any seed, so the splits stay disjoint whatever seeds are used.
    return zlib.crc32(f"{a}+{b}".encode()) % 10 == 0


def arithmetic_rows(split: str, seed: int = 0) -> list[dict[str, str]]:
    """Every 2-digit addition `a + b` (10 <= a, b <= 99) of the split, in a seed-dependent order.

    About 10% of the pairs are the test split, the rest train; a pair is in exactly one of them.
    """
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic has splits 'train' and 'test', not {split!r}")
    want_test = split == "test"
    rows = [
        {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a in range(10, 100)
        for b in range(10, 100)
        if _is_test_pair(a, b) == want_test
    ]
    random.Random(seed).shuffle(rows)
    return rows


def shuffle_rows(rows: Sequence[dict], seed: int) -> list[dict]:
    """A copy of `rows` in a deterministic, seed-dependent order."""
    out = list(rows)
    random.Random(seed).shuffle(out)
    return out


def batch_rows(rows: Sequence[dict], step: int, batch_size: int, all_data: bool) -> list[dict]:
    """The prompts of one step. With `all_data` the last batch may be short; otherwise batches wrap around."""
    start = step * batch_size
    if all_data:
        return list(rows[start:start + batch_size])
    return [rows[(start + k) % len(rows)] for k in range(batch_size)]
