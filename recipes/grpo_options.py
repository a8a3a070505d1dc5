"""The demos' command line and run setup: options, log folder, step count, sampling seeds, the client."""

from __future__ import annotations

import argparse
import math
import shlex
import zlib
from datetime import datetime
from pathlib import Path
from typing import Any

import pytrio_compat as trio
from grpo_variants import add_variant_options, check_variant_options, policy_config

LOSS_FNS = ("importance_sampling", "ppo", "cispo")
SWANLAB_MODES = ("online", "local", "offline", "disabled")
DATASETS = ("gsm8k", "arithmetic", "countdown", "shapes")
MAX_STEPS_OFF_POLICY = 1  # the async demo samples the next step while this one trains: one step behind at most


# Defaults that depend on --dataset. gsm8k: the upstream PyTRIO GSM8K demos. arithmetic: the CPU demo of
# scripts/demo.sh, chosen from the measurements in docs/benchmarks.md ("Learning: recipe vs plain loop"); it
# evaluates at the first and the last step only (an evaluation does not change the training, and each of its
# 200 problems costs a prefill of the 160-token few-shot prompt: docs/benchmarks.md, "Evaluation").
# Its embedded worker trains under bf16 autocast (the sampler stays float32): 0.66x the forward_backward time on
# this CPU, held-out gains over 3 seeds within the noise of float32 training (docs/benchmarks.md, "The CPU demo").
# countdown: the arithmetic settings with room for a worked answer and its boxed expression (the few-shot
# answers are 32 and 50 SmolLM2 tokens); not tuned, and not shown to learn (TinyZero trained a 3B model on it).
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "gsm8k": {"base_model": "Qwen/Qwen3.5-4B", "lora_rank": 32, "train_unembed": True, "steps": 10,
              "group_size": 4, "max_tokens": 1024, "learning_rate": 4e-5, "beta2": 0.95, "adam_eps": 1e-12,
              "eval_every": 0, "eval_size": 50, "worker_args": ""},
    "arithmetic": {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "lora_rank": 16, "train_unembed": True,
                   "steps": 20, "group_size": 8, "max_tokens": 40, "learning_rate": 2e-4, "beta2": 0.95,
                   "adam_eps": 1e-12, "eval_every": 20, "eval_size": 200, "worker_args": "--autocast bf16"},
    "countdown": {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "lora_rank": 16, "train_unembed": True,
                  "steps": 20, "group_size": 8, "max_tokens": 96, "learning_rate": 2e-4, "beta2": 0.95,
                  "adam_eps": 1e-12, "eval_every": 10, "eval_size": 100, "worker_args": ""},
    # shapes (recipes/shapes.py): count the shapes in a generated picture; needs a vision-language model (the
    # recipes' default Qwen3.5 is one). Not tuned.
    "shapes": {"base_model": "Qwen/Qwen3.5-4B", "lora_rank": 16, "train_unembed": True, "steps": 20,
               "group_size": 8, "max_tokens": 32, "learning_rate": 1e-4, "beta2": 0.95, "adam_eps": 1e-12,
               "eval_every": 10, "eval_size": 64, "worker_args": ""},
}


class RecipeArgParser(argparse.ArgumentParser):
    """An ArgumentParser that fills the options left unset from DATASET_DEFAULTS[--dataset]."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        for key, value in DATASET_DEFAULTS[parsed.dataset].items():
            if getattr(parsed, key, None) is None:
                setattr(parsed, key, value)
        check_variant_options(self, parsed)
        if not 0 <= parsed.max_steps_off_policy <= MAX_STEPS_OFF_POLICY:
            self.error(f"--max-steps-off-policy must be 0 or {MAX_STEPS_OFF_POLICY} (a step's samples come from "
                       f"the weights before at most that many optim steps), got {parsed.max_steps_off_policy}")
        return parsed, extras


def _default_help(key: str) -> str:
    def shown(value: Any) -> str:
        return "none" if value == "" else str(value)  # an empty default (no extra worker flags) reads as a word

    return "default " + " / ".join(f"{shown(values[key])} ({name})" for name, values in DATASET_DEFAULTS.items())


def build_arg_parser(description: str) -> argparse.ArgumentParser:
    """The command line shared by both demos (defaults per --dataset: DATASET_DEFAULTS)."""
    p = RecipeArgParser(description=description)
    p.add_argument("--base-model", default=None, help=f"base model to put the LoRA on; {_default_help('base_model')}")
    p.add_argument("--lora-rank", type=int, default=None, help=f"LoRA rank; {_default_help('lora_rank')}")
    p.add_argument("--train-unembed", dest="train_unembed", action="store_true", default=None,
                   help=f"LoRA on the output projection (lm_head) too; {_default_help('train_unembed')}")
    p.add_argument("--no-train-unembed", dest="train_unembed", action="store_false",
                   help="no LoRA on the output projection (lm_head); attention and MLP only")
    p.add_argument("--steps", type=int, default=None,
                   help=f"number of GRPO steps (batch-size prompts each); {_default_help('steps')}")
    p.add_argument("--all-data", action="store_true", help="one pass over the whole train split; ignores --steps")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"completions sampled per prompt; {_default_help('group_size')}")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"max new tokens per completion; {_default_help('max_tokens')}")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top_p")
    p.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and the LoRA init")
    p.add_argument("--learning-rate", type=float, default=None,
                   help=f"Adam learning rate; {_default_help('learning_rate')}")
    p.add_argument("--beta1", type=float, default=0.9, help="Adam beta1")
    p.add_argument("--beta2", type=float, default=None, help=f"Adam beta2; {_default_help('beta2')}")
    p.add_argument("--adam-eps", type=float, default=None, help=f"Adam epsilon; {_default_help('adam_eps')}")
    p.add_argument("--loss-fn", choices=LOSS_FNS, default="importance_sampling",
                   help="importance_sampling, ppo or cispo: the worker's built-in losses (one pass)")
    p.add_argument("--custom-cispo", action="store_true",
                   help="with --loss-fn cispo: compute CISPO here through forward_backward_custom (two passes, "
                        "as the upstream scripts do) instead of the worker's built-in cispo")
    p.add_argument("--cispo-clip-low", type=float, default=0.0, help="CISPO lower bound on the ratio")
    p.add_argument("--cispo-clip-high", type=float, default=4.0, help="CISPO upper bound on the ratio")
    p.add_argument("--swanlab-mode", choices=SWANLAB_MODES, default="disabled",
                   help="SwanLab logging: online (cloud), local / offline (files under the log dir), disabled")
    p.add_argument("--swanlab-project", default="pytrio-compat-grpo", help="SwanLab project name")
    p.add_argument("--base-url", default=None,
                   help="service URL (default: PYTRIO_BASE_URL; with none set, a local worker is started)")
    p.add_argument("--api-key", default=None, help="API key (default: PYTRIO_API_KEY)")
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k",
                   help="gsm8k, arithmetic (generated 2-digit additions, learnable by tiny models), or countdown "
                        "(reach a target from 3-4 numbers with + - * /: recipes/countdown.py)")
    p.add_argument("--data-file", default=None,
                   help="local GSM8K data: a .jsonl/.parquet file with question/answer columns, or a folder "
                        "holding train/test files (e.g. ../shared/data/gsm8k); default: the HF hub")
    p.add_argument("--test-file", default=None,
                   help="local test split for evaluation (default: the test file in the --data-file folder)")
    p.add_argument("--log-dir", default=None, help="where metrics.jsonl, config.json, curves.png go "
                                                   "(default: runs/<timestamp>)")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"greedy test accuracy every N steps and at the end (0 = no evaluation); "
                        f"{_default_help('eval_every')}")
    p.add_argument("--eval-size", type=int, default=None,
                   help=f"number of test questions per evaluation; {_default_help('eval_size')}")
    p.add_argument("--max-steps-off-policy", type=int, default=0,
                   help="02-demo-async.py: 1 starts sampling the next step while this step trains, from the "
                        "weights before this step's update (one step off-policy; the loss's importance ratio is "
                        "against the sampler's logprobs); 0 (default) samples every step from its own weights")
    p.add_argument("--worker-args", default=None,
                   help="flags for the worker the SDK starts when no --base-url is given (shell words, e.g. "
                        "'--autocast bf16'; ignored for a remote worker); " + _default_help("worker_args"))
    add_variant_options(p)  # --advantage, --loss-agg, --kl-coef, --dynamic-sampling, ...: grpo_variants.py
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


def sample_seed(seed: int, step: int, prompt_index: int) -> int:
    """Sampling seed for one prompt of one step: the same in the sync and the async demo."""
    return zlib.crc32(f"{seed}:{step}:{prompt_index}".encode()) & 0x7FFFFFFF


def make_service_client(args: argparse.Namespace) -> Any:
    """`trio.ServiceClient` with `--api-key` / `--base-url` when given (else the SDK's env/profile defaults); a
    worker the SDK starts for this process gets `--worker-args`."""
    if args.worker_args:
        trio.configure(embedded_worker_args=tuple(shlex.split(args.worker_args)))
    kwargs = {k: v for k, v in (("api_key", args.api_key), ("base_url", args.base_url)) if v is not None}
    return trio.ServiceClient(**kwargs)


def loss_fn_config(args: argparse.Namespace) -> dict[str, float] | None:
    """The `loss_fn_config` of the built-in loss: CISPO's ratio bounds, and the variants' keys when their flags
    are given (ppo's bounds, the KL, the entropy: grpo_variants.policy_config); None when there is nothing."""
    config: dict = {}
    if args.loss_fn == "cispo":
        config = {"clip_low_threshold": args.cispo_clip_low, "clip_high_threshold": args.cispo_clip_high}
    config.update(policy_config(args))
    return config or None


def ppo_bounds(args: argparse.Namespace) -> tuple[float, float] | None:
    """ppo's ratio bounds as the worker applies them (its defaults 0.8 / 1.2 unless given); None for other losses."""
    if args.loss_fn != "ppo":
        return None
    return (0.8 if args.clip_low is None else args.clip_low, 1.2 if args.clip_high is None else args.clip_high)
