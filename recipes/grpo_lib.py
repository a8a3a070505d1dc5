"""What the two GRPO demos share: options, prompts, grading, advantages, datums, data, logging, evaluation.

The demos (`01-demo-sync.py`, `02-demo-async.py`) keep the GRPO step itself in view; everything here is
a small function with one job, so each piece can be tested on its own (see `tests/recipes/`).

Conventions (the same as the PyTRIO / Tinker cookbook GRPO recipes):
* reward: 1.0 when the last `\\boxed{...}` of a completion equals the number after `#### ` in the GSM8K
  answer, else 0.0;
* advantage: reward - mean(group rewards), no std scaling; groups whose rewards are all equal carry no
  signal and are skipped;
* datum: model_input = prompt + completion[:-1]; target_tokens, logprobs and advantages are shifted so
  that position t predicts token t+1, with the P-1 prompt positions zeroed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pytrio_compat as trio

# ---------------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------------

LOSS_FNS = ("importance_sampling", "ppo", "cispo")
SWANLAB_MODES = ("online", "local", "offline", "disabled")
DATASETS = ("gsm8k", "arithmetic")


def build_arg_parser(description: str) -> argparse.ArgumentParser:
    """The command line shared by both demos (defaults follow the upstream PyTRIO GSM8K demos)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--base-model", default="Qwen/Qwen3.5-4B", help="base model to put the LoRA on")
    p.add_argument("--lora-rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--no-train-unembed", dest="train_unembed", action="store_false",
                   help="no LoRA on the output projection (lm_head); attention and MLP only")
    p.add_argument("--steps", type=int, default=10, help="number of GRPO steps (batch-size prompts each)")
    p.add_argument("--all-data", action="store_true", help="one pass over the whole train split; ignores --steps")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="completions sampled per prompt")
    p.add_argument("--max-tokens", type=int, default=1024, help="max new tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top_p")
    p.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and the LoRA init")
    p.add_argument("--learning-rate", type=float, default=4e-5, help="Adam learning rate")
    p.add_argument("--beta1", type=float, default=0.9, help="Adam beta1")
    p.add_argument("--beta2", type=float, default=0.95, help="Adam beta2")
    p.add_argument("--loss-fn", choices=LOSS_FNS, default="importance_sampling",
                   help="importance_sampling / ppo (built in) or cispo (custom loss computed locally)")
    p.add_argument("--cispo-clip-low", type=float, default=0.0, help="CISPO lower bound on the ratio")
    p.add_argument("--cispo-clip-high", type=float, default=4.0, help="CISPO upper bound on the ratio")
    p.add_argument("--swanlab-mode", choices=SWANLAB_MODES, default="disabled",
                   help="SwanLab logging: online (cloud), local / offline (files under the log dir), disabled")
    p.add_argument("--swanlab-project", default="pytrio-compat-grpo", help="SwanLab project name")
    p.add_argument("--base-url", default=None,
                   help="service URL (default: PYTRIO_BASE_URL; with none set, a local worker is started)")
    p.add_argument("--api-key", default=None, help="API key (default: PYTRIO_API_KEY)")
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k",
                   help="gsm8k, or arithmetic (generated 2-digit additions, learnable by tiny models)")
    p.add_argument("--data-file", default=None,
                   help="local GSM8K data: a .jsonl/.parquet file with question/answer columns, or a folder "
                        "holding train/test files (e.g. ../shared/data/gsm8k); default: the HF hub")
    p.add_argument("--test-file", default=None,
                   help="local test split for evaluation (default: the test file in the --data-file folder)")
    p.add_argument("--log-dir", default=None, help="where metrics.jsonl, config.json, curves.png go "
                                                   "(default: runs/<timestamp>)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="greedy test accuracy every N steps and at the end (0 = no evaluation)")
    p.add_argument("--eval-size", type=int, default=50, help="number of test questions per evaluation")
    return p


def resolve_log_dir(log_dir: str | None) -> Path:
    """`log_dir` as given, else a fresh `runs/<timestamp>` (suffixed if that folder already exists)."""
    if log_dir:
        return Path(log_dir)
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, i = base, 1
    while path.exists():
        path, i = Path(f"{base}-{i}"), i + 1
    return path


def num_steps(args: argparse.Namespace, n_train_rows: int) -> int:
    """`--steps`, or with `--all-data` enough steps to see every train row once."""
    if args.all_data:
        return math.ceil(n_train_rows / args.batch_size)
    return args.steps


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


def sample_seed(seed: int, step: int, prompt_index: int) -> int:
    """Sampling seed for one prompt of one step: the same in the sync and the async demo."""
    return zlib.crc32(f"{seed}:{step}:{prompt_index}".encode()) & 0x7FFFFFFF


def make_service_client(args: argparse.Namespace) -> Any:
    """`trio.ServiceClient` with `--api-key` / `--base-url` when given (else the SDK's env/profile defaults)."""
    kwargs = {k: v for k, v in (("api_key", args.api_key), ("base_url", args.base_url)) if v is not None}
    return trio.ServiceClient(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# Prompting: the one-shot "strawberry" conversation of the cookbook rl_loop / PyTRIO demos
# ---------------------------------------------------------------------------------------------------------

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
FEWSHOT = {"gsm8k": FEWSHOT_PREFIX, "arithmetic": ARITHMETIC_FEWSHOT_PREFIX}


def build_messages(question: str, fewshot: Sequence[dict] = FEWSHOT_PREFIX) -> list[dict[str, str]]:
    """The few-shot prefix followed by the question and the answer-format suffix."""
    return [*fewshot, {"role": "user", "content": question + QUESTION_SUFFIX}]


def render_prompt(tokenizer: Any, question: str, fewshot: Sequence[dict] = FEWSHOT_PREFIX) -> list[int]:
    """Prompt tokens from the tokenizer's own chat template (generation prompt on, thinking off)."""
    text = tokenizer.apply_chat_template(
        build_messages(question, fewshot), tokenize=False, add_generation_prompt=True, enable_thinking=False
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


# ---------------------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------------------

_BOXED = "\\boxed{"
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")


def extract_boxed(text: str) -> str | None:
    """Content of the LAST complete, non-empty `\\boxed{...}`, braces balanced (`\\boxed{\\frac{1}{2}}` works).

    An unclosed box (a truncated completion) or an empty one is passed over for the previous box.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        content = text[start + len(_BOXED):i - 1].strip()
        if depth == 0 and content:
            return content
        start = text.rfind(_BOXED, 0, start)
    return None


def normalize_number(s: str) -> str:
    """Canonical text of a numeric answer: no `$`, commas, spaces, braces or trailing dot; `1000.00` -> `1000`.

    A simple `\\frac{a}{b}` becomes its decimal value when that is exact. Non-numbers are returned cleaned.
    """
    s = s.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    m = _FRAC.match(s.replace(" ", ""))
    if m:
        sign, num, den = m.groups()
        if int(den) != 0:
            value = Decimal(int(num)) / Decimal(int(den))
            if value * int(den) == int(num):
                return normalize_number(sign + format(value, "f"))
    s = s.replace(",", "").replace(" ", "").replace("{", "").replace("}", "").rstrip(".")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return s
    if not value.is_finite():
        return s
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def gsm8k_final_answer(answer_text: str) -> str:
    """The normalised number after `#### ` in a GSM8K answer."""
    marker = answer_text.rfind("####")
    if marker == -1:
        raise ValueError(f"no '#### <answer>' in GSM8K answer: {answer_text!r}")
    tail = answer_text[marker + 4:].strip()
    return normalize_number(tail.splitlines()[0] if tail else "")


def grade(completion_text: str, answer_text: str) -> float:
    """1.0 if the completion's last `\\boxed{}` equals the GSM8K answer's final number, else 0.0."""
    boxed = extract_boxed(completion_text)
    if boxed is None:
        return 0.0
    truth = gsm8k_final_answer(answer_text)
    return 1.0 if truth and normalize_number(boxed) == truth else 0.0


def upstream_grade(completion_text: str, answer_text: str) -> float:
    """The PyTRIO GSM8K demo's grader, kept only so tests can show where it and `grade` differ.

    It takes the last `\\boxed\\{([^}]+)\\}` regex match (stops at the first `}`, skips empty boxes) and only
    strips commas, surrounding spaces and trailing dots.
    """
    def norm(t: str) -> str:
        return t.replace(",", "").strip().rstrip(".")

    matches = re.findall(r"\\boxed\{([^}]+)\}", completion_text)
    truth = re.search(r"####\s*(.+)", answer_text)
    if not matches or truth is None:
        return 0.0
    return 1.0 if norm(matches[-1].strip()) == norm(norm(truth.group(1))) else 0.0


# ---------------------------------------------------------------------------------------------------------
# Advantages and datums
# ---------------------------------------------------------------------------------------------------------


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO advantages of one group: each reward minus the group mean (no std scaling)."""
    mean = sum(rewards) / len(rewards)
    return [float(r) - mean for r in rewards]


def is_degenerate(rewards: Sequence[float]) -> bool:
    """True when every reward in the group is the same: all advantages are 0, nothing to learn."""
    return all(r == rewards[0] for r in rewards)


def build_datum(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    completion_logprobs: Sequence[float],
    advantage: float,
) -> trio.Datum:
    """One training example for a policy loss (length P+C-1, position t predicts token t+1).

    model_input   = prompt + completion[:-1]
    target_tokens = [0]*(P-1)   + completion
    logprobs      = [0.0]*(P-1) + sampler logprobs of the completion
    advantages    = [0.0]*(P-1) + [A]*C
    """
    prompt, completion = [int(t) for t in prompt_tokens], [int(t) for t in completion_tokens]
    if not prompt or not completion:
        raise ValueError("build_datum needs a non-empty prompt and completion")
    if len(completion_logprobs) != len(completion):
        raise ValueError(f"{len(completion)} completion tokens but {len(completion_logprobs)} logprobs")
    pad = len(prompt) - 1
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(prompt + completion[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * pad + completion,
            "logprobs": [0.0] * pad + [float(x) for x in completion_logprobs],
            "advantages": [0.0] * pad + [float(advantage)] * len(completion),
        },
    )


def count_train_tokens(datums: Sequence[trio.Datum]) -> int:
    """Positions that carry a learning signal (advantage != 0)."""
    return sum(sum(1 for a in d.loss_fn_inputs["advantages"].data if a != 0.0) for d in datums)


def kl_sample_train(datums: Sequence[trio.Datum], fb_output: Any) -> float | None:
    """Mean of (sampler logprob - learner logprob) over trained positions (advantage != 0).

    The learner logprobs come from `fb_output.loss_fn_outputs[i]["logprobs"]`; near 0 means the sampler and
    the trainer agree on the policy. None when there is nothing to compare.
    """
    total, count = 0.0, 0
    outputs = getattr(fb_output, "loss_fn_outputs", None) or []
    for datum, out in zip(datums, outputs):
        if "logprobs" not in out:
            return None
        learner = out["logprobs"].data
        sampler = datum.loss_fn_inputs["logprobs"].data
        for q, lp, a in zip(sampler, learner, datum.loss_fn_inputs["advantages"].data):
            if a != 0.0:
                total += float(q) - float(lp)
                count += 1
    return total / count if count else None


def make_custom_cispo_loss(clip_low: float = 0.0, clip_high: float = 4.0) -> Callable:
    """CISPO as a client-side loss for `training_client.forward_backward_custom(datums, loss_fn)`.

    loss = -sum_t sg(clip(r_t, clip_low, clip_high)) * lp_t * A_t,  r_t = exp(lp_t - q_t)
    with lp the learner logprobs (differentiable), q the sampler logprobs and A the advantages, both read
    from each datum's loss_fn_inputs. Metrics: `loss_mean` (loss / positions) and `cispo/clip_fraction`
    (share of trained positions whose ratio was clipped).
    """
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= clip_high, got {clip_low}, {clip_high}")

    def loss_fn(data: list[trio.Datum], logprobs_list: list[Any]) -> tuple[Any, dict[str, float]]:
        import torch

        if len(data) != len(logprobs_list):
            raise ValueError(f"{len(data)} datums but {len(logprobs_list)} logprob tensors")
        total = None
        positions, trained, clipped = 0, 0, 0
        for datum, lp in zip(data, logprobs_list):
            lp = lp.float().reshape(-1)
            q = torch.tensor(datum.loss_fn_inputs["logprobs"].data, dtype=torch.float32, device=lp.device)
            adv = torch.tensor(datum.loss_fn_inputs["advantages"].data, dtype=torch.float32, device=lp.device)
            ratio = torch.exp(lp.detach() - q)
            weight = ratio.clamp(min=clip_low, max=clip_high)
            term = -(weight * lp * adv).sum()
            total = term if total is None else total + term
            mask = adv != 0
            positions += lp.numel()
            trained += int(mask.sum())
            clipped += int(((ratio != weight) & mask).sum())
        if total is None:
            raise ValueError("CISPO loss got no datums")
        metrics = {
            "loss_mean": float(total.detach()) / max(positions, 1),
            "cispo/clip_fraction": clipped / trained if trained else 0.0,
        }
        return total, metrics

    return loss_fn


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------

HUB_HINT = (
    "Pass --data-file with a local copy instead: a folder with train/test .jsonl or .parquet files "
    "(e.g. --data-file ../shared/data/gsm8k), or a single .jsonl/.parquet file with question/answer columns."
)


class DataUnavailableError(RuntimeError):
    """GSM8K could not be loaded (no local file given and the Hugging Face hub is unreachable)."""


def load_rows(
    dataset: str, split: str, data_file: str | os.PathLike | None = None, seed: int = 0, n: int | None = None
) -> list[dict[str, str]]:
    """Rows `{"question", "answer"}` (GSM8K format) of one split, at most `n` of them.

    gsm8k: from `data_file` (a .jsonl/.parquet file, or a folder with `<split>.jsonl` / `<split>.parquet` /
    `<split>-*.parquet`) when given, else `datasets.load_dataset("openai/gsm8k", "main", split=split)`;
    rows keep the file order. arithmetic: generated 2-digit additions, ordered by `seed`.
    """
    if dataset == "arithmetic":
        if data_file is not None:
            raise ValueError("--data-file is only used with --dataset gsm8k")
        rows = arithmetic_rows(split, seed)
    elif dataset == "gsm8k":
        rows = _read_rows(_split_file(Path(data_file), split)) if data_file else _load_hub_gsm8k(split)
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {DATASETS}")
    return rows if n is None else rows[:n]


def eval_data_file(args: argparse.Namespace) -> str | None:
    """The file (or folder) that holds the test split: `--test-file`, else the `--data-file` folder, else
    a sibling of a `--data-file` named with "test" for "train". None means the hub (or arithmetic)."""
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


# ---------------------------------------------------------------------------------------------------------
# Step metrics
# ---------------------------------------------------------------------------------------------------------


class StepStats:
    """Collects what one GRPO step produced and turns it into the logged metrics."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.rewards: list[float] = []
        self.gen_lens: list[int] = []
        self.n_truncated = 0
        self.n_groups = 0
        self.n_degenerate = 0
        self.times: dict[str, float] = {}

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Adds the time spent in the block to `name` (e.g. "time/sample")."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def add_group(self, rewards: Sequence[float], sequences: Sequence[Any],
                  worker_metrics: dict[str, float] | None = None) -> None:
        """Record one prompt's rewards, its sampled sequences (`tokens`, `stop_reason`) and the worker's
        timings for the request (a batch's time is shared by the requests decoded in it)."""
        metrics = worker_metrics or {}
        share = 1.0 / max(1.0, float(metrics.get("batch_requests", 1.0)))
        for key, name in (("time/queue", "worker/queue"), ("time/prefill", "worker/prefill"),
                          ("time/decode", "worker/decode")):
            if key in metrics:
                self.times[name] = self.times.get(name, 0.0) + float(metrics[key]) * share
        self.rewards.extend(float(r) for r in rewards)
        self.gen_lens.extend(len(s.tokens) for s in sequences)
        self.n_truncated += sum(1 for s in sequences if getattr(s, "stop_reason", None) == "length")
        self.n_groups += 1
        self.n_degenerate += int(is_degenerate(rewards))

    def metrics(
        self, datums: Sequence[trio.Datum], fb_output: Any = None, optim_output: Any = None
    ) -> dict[str, float]:
        """reward, frac_degenerate, rollout/*, datums, train_tokens, loss_mean, kl_sample_train, time/*."""
        n = len(self.gen_lens)
        out: dict[str, float] = {
            "reward": sum(self.rewards) / len(self.rewards) if self.rewards else 0.0,
            "frac_degenerate": self.n_degenerate / self.n_groups if self.n_groups else 0.0,
            "rollout/avg_gen_len": sum(self.gen_lens) / n if n else 0.0,
            "rollout/frac_truncated": self.n_truncated / n if n else 0.0,
            "datums": float(len(datums)),
            "train_tokens": float(count_train_tokens(datums)),
        }
        if fb_output is not None:
            fb_metrics = dict(getattr(fb_output, "metrics", {}) or {})
            if "loss_mean" in fb_metrics:
                out["loss_mean"] = float(fb_metrics["loss_mean"])
            out.update({k: float(v) for k, v in fb_metrics.items() if k.startswith("cispo/")})
            kl = kl_sample_train(datums, fb_output)
            if kl is not None:
                out["kl_sample_train"] = kl
        for output, name in ((fb_output, "worker/forward_backward"), (optim_output, "worker/optim")):
            worker = dict(getattr(output, "metrics", {}) or {}) if output is not None else {}
            if "time/run" in worker:
                self.times[name] = float(worker["time/run"])
                if output is fb_output:  # optim_step queues behind its own forward_backward: not a wait
                    self.times["worker/queue"] = self.times.get("worker/queue", 0.0) + float(worker.get("time/queue", 0))
        if optim_output is not None:
            for key in ("grad_norm", "optim/grad_norm", "gradient_norm"):
                value = (getattr(optim_output, "metrics", {}) or {}).get(key)
                if value is not None:
                    out["optim/grad_norm"] = float(value)
                    break
        for key in ("time/sync", "time/sample", "time/train"):
            out[key] = self.times.get(key, 0.0)
        out.update({k: v for k, v in self.times.items() if k not in out})
        out["time/step"] = time.perf_counter() - self.started
        worker_busy = sum(v for k, v in self.times.items() if k.startswith("worker/") and k != "worker/queue")
        if worker_busy:
            # what the worker did not account for: HTTP, encoding, polling and this script's own work
            out["time/client_and_transport"] = max(0.0, out["time/step"] - worker_busy
                                                   - self.times.get("worker/queue", 0.0) - out["time/sync"])
        return out


# ---------------------------------------------------------------------------------------------------------
# Logging: metrics.jsonl + console + SwanLab + curves.png
# ---------------------------------------------------------------------------------------------------------

_SUMMARY_KEYS = (
    ("reward", "reward {:.3f}"), ("frac_degenerate", "degenerate {:.0%}"), ("datums", "datums {:.0f}"),
    ("train_tokens", "train_tokens {:.0f}"), ("rollout/avg_gen_len", "gen_len {:.1f}"),
    ("loss_mean", "loss_mean {:.4f}"), ("kl_sample_train", "kl {:+.2e}"), ("eval/accuracy", "eval_acc {:.3f}"),
    ("time/step", "{:.1f}s"),
)
PLOTTED = ("reward", "loss_mean", "kl_sample_train", "eval/accuracy")


def _swanlab_has_dashboard() -> bool:
    try:
        import swanboard  # noqa: F401
    except ImportError:
        return False
    return True


class MetricsLogger:
    """Writes `config.json`, appends one `metrics.jsonl` row per `log()`, prints a one-line summary,
    mirrors the metrics to SwanLab (unless disabled) and draws `curves.png` on `close()`."""

    def __init__(
        self,
        log_dir: str | os.PathLike,
        config: dict,
        swanlab_mode: str = "disabled",
        swanlab_project: str = "pytrio-compat-grpo",
        run_name: str | None = None,
    ) -> None:
        if swanlab_mode not in SWANLAB_MODES:
            raise ValueError(f"swanlab_mode must be one of {SWANLAB_MODES}, got {swanlab_mode!r}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, float]] = []
        self.metrics_path = self.log_dir / "metrics.jsonl"
        self.metrics_path.write_text("")
        (self.log_dir / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        self._swanlab = None
        if swanlab_mode != "disabled":
            import swanlab

            mode = swanlab_mode
            if mode == "local" and not _swanlab_has_dashboard():
                # "local" only differs from "offline" in starting the swanboard dashboard hook, which is an
                # optional extra; the run files are the same.
                print("swanlab: 'swanlab[dashboard]' is not installed; writing the run in offline format "
                      f"under {self.log_dir / 'swanlog'}", file=sys.stderr)
                mode = "offline"
            self._swanlab = swanlab
            swanlab.init(project=swanlab_project, experiment_name=run_name, mode=mode,
                         logdir=str(self.log_dir / "swanlog"), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        parts = [fmt.format(metrics[key]) for key, fmt in _SUMMARY_KEYS if key in metrics]
        print(f"step {step:4d} | " + " | ".join(parts), flush=True)
        if self._swanlab is not None:
            self._swanlab.log(dict(metrics), step=step)

    def close(self) -> Path:
        """Finish SwanLab and write `curves.png`; returns its path."""
        if self._swanlab is not None:
            self._swanlab.finish()
            self._swanlab = None
        return plot_curves(self.history, self.log_dir / "curves.png")

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_curves(history: Sequence[dict], path: str | os.PathLike) -> Path:
    """One panel per metric in PLOTTED (value vs step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, key in zip(axes.flat, PLOTTED):
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------
# Evaluation: greedy accuracy on held-out questions
# ---------------------------------------------------------------------------------------------------------


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
        sampling_client.sample_async(prompt=trio.ModelInput.from_ints(render_prompt(tokenizer, row["question"], fewshot)),
                                     num_samples=1, sampling_params=params)
        for row in rows
    ))
    scores = [grade(completion_text(tokenizer, res.sequences[0]), row["answer"]) for res, row in zip(results, rows)]
    return sum(scores) / len(scores)


def should_eval(args: argparse.Namespace, step: int) -> bool:
    """Evaluate at the start of every `--eval-every`-th step (step 0 gives the baseline)."""
    return args.eval_every > 0 and step % args.eval_every == 0
