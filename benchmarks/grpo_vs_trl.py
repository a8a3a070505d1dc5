"""The same GRPO configuration run with TRL's GRPOTrainer and with our async recipe against the worker.

Same model (SmolLM2-135M-Instruct), data (few-shot two-digit addition), group size, prompts per step,
completion length, learning rate, LoRA rank and targets; one optimizer step per batch, no KL term, rewards
minus the group mean (TRL: ``scale_rewards="none"``). Reports the median step time of each and plots both
reward curves in one figure.

    pip install trl   # not a dependency of the project
    LD_PRELOAD=$(python -m server_mock.allocator) python benchmarks/grpo_vs_trl.py [--steps 6] [--worker-args ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))
from benchmarks.common import RESULTS, SMOLLM2, median, save  # noqa: E402
from server_mock.allocator import loaded_allocator  # noqa: E402


def run_trl(args, rows) -> dict:
    import torch
    from datasets import Dataset
    from grpo_lib import FEWSHOT, build_messages, grade
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from server_mock.engine.loading import resolve_source
    from server_mock.lora import LORA_ALPHA, linear_groups

    source = resolve_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": build_messages(r["question"], FEWSHOT["arithmetic"]),
                                  "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **_):
        return [grade(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.rewards, self._t = [], [], None

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    timing = StepTimes()
    config = GRPOConfig(
        output_dir=str(RESULTS / "trl-run"), use_cpu=True, bf16=False, max_steps=args.steps, logging_steps=1,
        report_to="none", learning_rate=args.learning_rate, per_device_train_batch_size=args.batch * args.group,
        num_generations=args.group, max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, scale_rewards="none", loss_type="grpo", gradient_accumulation_steps=1,
        seed=args.seed, save_strategy="no", shuffle_dataset=True,
    )
    # attention and MLP layers: TRL refuses a LoRA on lm_head (ours runs with --no-train-unembed to match)
    targets = [name for name, group in linear_groups(model).items() if group != "train_unembed"]
    peft_config = LoraConfig(r=args.rank, lora_alpha=LORA_ALPHA, target_modules=targets)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[timing])
    trainer.train()
    return {"step_s": timing.times, "reward": timing.rewards}


def run_ours(args) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_async", ROOT / "recipes" / "02-demo-async.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    summary = demo.main([
        "--base-model", args.model, "--dataset", "arithmetic", "--steps", str(args.steps),
        "--batch-size", str(args.batch), "--group-size", str(args.group), "--max-tokens", str(args.max_tokens),
        "--learning-rate", str(args.learning_rate), "--lora-rank", str(args.rank), "--seed", str(args.seed),
        "--log-dir", str(RESULTS / "ours-run"), "--no-train-unembed", "--eval-every", "0",  # TRL evaluates nothing
        "--worker-args", args.worker_args,
    ])
    history = [row for row in summary["history"] if "time/step" in row]  # training steps only
    return {"step_s": [row["time/step"] for row in history], "reward": [row["reward"] for row in history]}


def plot(ours: dict, trl: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(ours["reward"], marker="o", label="pytrio_compat (async recipe + worker)")
    a.plot(trl["reward"], marker="s", label="TRL GRPOTrainer")
    a.set_xlabel("step"), a.set_ylabel("mean sampled reward"), a.legend()
    b.plot(ours["step_s"], marker="o", label="pytrio_compat")
    b.plot(trl["step_s"], marker="s", label="TRL")
    b.set_xlabel("step"), b.set_ylabel("step time (s)"), b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-args", default="",
                        help="flags of our worker (default none: float32 training, as TRL's here; the CPU demo's "
                             "is '--autocast bf16')")
    args = parser.parse_args(argv)

    from grpo_lib import arithmetic_rows

    rows = arithmetic_rows("train", seed=args.seed)[: args.steps * args.batch * 4]
    ours = run_ours(args)
    trl = run_trl(args, rows)
    # the first step of each includes warm-up (model load, first compilation of kernels): leave it out
    result = {
        "config": vars(args), "ours_median_step_s": median(ours["step_s"][1:]),
        "trl_median_step_s": median(trl["step_s"][1:]),
        "step_time_ratio_ours_over_trl": median(ours["step_s"][1:]) / median(trl["step_s"][1:]),
        "ours": ours, "trl": trl,
        # TRL runs in this process; our worker restarts itself with tcmalloc where installed (server_mock/allocator.py):
        # run this benchmark with LD_PRELOAD set to the same library to compare like with like
        "allocator_this_process": loaded_allocator(),
    }
    RESULTS.mkdir(exist_ok=True)
    plot(ours, trl, RESULTS / "grpo_vs_trl.png")
    save("grpo_vs_trl", result)
    (RESULTS / "grpo_vs_trl_curves.json").write_text(json.dumps({"ours": ours, "trl": trl}))
    return result


if __name__ == "__main__":
    main()
