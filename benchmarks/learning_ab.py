"""Does the recipe learn as much as a plain training loop? An A/B on the demo's task.

A: the GRPO recipe (`recipes/02-demo-async.py`) through the SDK against a worker (one worker for all runs).
B: a plain in-process loop written here with transformers + PEFT + torch.optim.AdamW: on-policy sampling with
   `generate()`, advantage = reward - group mean, loss = -sum(ratio * A) / trained tokens, one AdamW step per
   batch, LoRA on every linear layer but lm_head.

Both see the same task (SmolLM2-135M-Instruct, few-shot two-digit addition, the recipe's prompt and grader),
the same prompts in the same order for a seed, the same hyperparameters, and are scored on one fixed held-out
set (greedy, the first --eval-size problems of the arithmetic test split). A recipe "variant" adds recipe
options, so one difference at a time can be switched:

    python benchmarks/learning_ab.py --arms plain recipe:default recipe:no_unembed --seeds 0 1 2
    python benchmarks/learning_ab.py --report      # curves, gaps and the plot from the results so far

Every finished run is appended to --results (JSON lines), so a long sweep can be stopped and resumed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))
from benchmarks.common import RESULTS, SMOLLM2  # noqa: E402

# Recipe options per variant, on top of the shared ones (the names are what docs/benchmarks.md reports).
RECIPE_VARIANTS: dict[str, list[str]] = {
    "default": ["--beta2", "0.95", "--adam-eps", "1e-12"],  # the worker's AdamParams defaults, lm_head LoRA
    "beta2": ["--beta2", "0.99", "--adam-eps", "1e-12"],
    "eps": ["--beta2", "0.95", "--adam-eps", "1e-8"],
    "no_unembed": ["--beta2", "0.95", "--adam-eps", "1e-12", "--no-train-unembed"],
    "matched": ["--beta2", "0.99", "--adam-eps", "1e-8", "--no-train-unembed"],
}
PLAIN_ADAM = {"beta2": 0.99, "eps": 1e-8}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shared_recipe_args(args) -> list[str]:
    return ["--base-model", args.model, "--dataset", "arithmetic", "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--group-size", str(args.group_size),
            "--max-tokens", str(args.max_tokens), "--learning-rate", str(args.lr), "--lora-rank", str(args.rank),
            "--eval-every", str(args.eval_every), "--eval-size", str(args.eval_size), "--swanlab-mode", "disabled"]


# ---------------------------------------------------------------------------------------------------------
# A: the recipe through the SDK and a worker
# ---------------------------------------------------------------------------------------------------------


def run_recipe(args, variant: str, seed: int, worker) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_async", ROOT / "recipes" / "02-demo-async.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    argv = [*shared_recipe_args(args), *RECIPE_VARIANTS[variant], "--seed", str(seed),
            "--base-url", worker.base_url, "--api-key", worker.api_key,
            "--log-dir", str(Path(args.log_root) / f"recipe-{variant}-s{seed}")]
    summary = demo.main(argv)
    history = summary["history"]
    return {"rewards": [row["reward"] for row in history if "reward" in row],
            "eval": {row["step"]: row["eval/accuracy"] for row in history if "eval/accuracy" in row}}


# ---------------------------------------------------------------------------------------------------------
# B: a plain in-process loop (transformers + PEFT + torch.optim.AdamW)
# ---------------------------------------------------------------------------------------------------------


class PlainLoop:
    def __init__(self, args, seed: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from server_mock.engine.loading import resolve_source

        source = resolve_source(args.model)
        self.tok = AutoTokenizer.from_pretrained(source)
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        config = LoraConfig(r=args.rank, lora_alpha=args.plain_alpha, lora_dropout=0.0,
                            target_modules=list(LORA_TARGETS))
        self.model = get_peft_model(base, config)
        self.stop_ids = sorted({self.tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", self.tok.eos_token)
                                if t in self.tok.get_vocab()})
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, PLAIN_ADAM["beta2"]),
                                     eps=PLAIN_ADAM["eps"], weight_decay=0.0)
        self.args = args

    def generate(self, prompts: list[list[int]], n: int, greedy: bool, seed: int = 0) -> list[list[int]]:
        """Completion tokens (up to and including the first stop token) for each prompt, n per prompt."""
        import torch

        width = max(len(p) for p in prompts)
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=self.args.max_tokens,
                do_sample=not greedy, temperature=None if greedy else 1.0, top_p=None if greedy else 1.0,
                top_k=None if greedy else 0, num_return_sequences=n, eos_token_id=self.stop_ids, pad_token_id=pad)
        completions = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.stop_ids), len(row))
            completions.append(row[:cut])
        return completions

    def train_step(self, prompts: list[list[int]], completions: list[list[int]], advantages: list[float]) -> None:
        import torch
        import torch.nn.functional as F

        total_tokens = sum(len(c) for c in completions)
        self.opt.zero_grad()
        for p, c, a in zip(prompts, completions, advantages):  # one sequence at a time: no padding to get wrong
            ids = torch.tensor([p + c])
            logits = self.model(input_ids=ids).logits[0, len(p) - 1:-1].float()
            lp = torch.gather(F.log_softmax(logits, -1), 1, torch.tensor(c)[:, None])[:, 0]
            ratio = torch.exp(lp - lp.detach())  # on-policy: 1 in value, d ratio = d lp
            (-(ratio * a).sum() / total_tokens).backward()
        self.opt.step()

    def evaluate(self, rows, render, grade, batch: int = 50) -> float:
        self.model.eval()
        correct = 0
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            outs = self.generate([render(r["question"]) for r in chunk], 1, greedy=True)
            correct += sum(grade(self.tok.decode(o, skip_special_tokens=True), r["answer"])
                           for o, r in zip(outs, chunk))
        return correct / len(rows)


def run_plain(args, seed: int) -> dict:
    from grpo_lib import (
        FEWSHOT,
        batch_rows,
        grade,
        group_advantages,
        is_degenerate,
        load_rows,
        render_prompt,
        sample_seed,
        shuffle_rows,
    )

    loop = PlainLoop(args, seed)

    def render(question):
        return render_prompt(loop.tok, question, FEWSHOT["arithmetic"])

    train = shuffle_rows(load_rows("arithmetic", "train", seed=seed), seed)
    eval_rows = load_rows("arithmetic", "test", n=args.eval_size)
    rewards, evals = [], {}
    for step in range(args.steps + 1):
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            evals[step] = loop.evaluate(eval_rows, render, grade)
            print(f"plain s{seed} step {step}: eval {evals[step]:.3f}", flush=True)
        if step == args.steps:
            break
        rows = batch_rows(train, step, args.batch_size, False)
        prompts = [render(r["question"]) for r in rows]
        loop.model.eval()
        completions = loop.generate(prompts, args.group_size, greedy=False, seed=sample_seed(seed, step, 0))
        train_p, train_c, train_a, step_rewards = [], [], [], []
        for i, row in enumerate(rows):
            group = completions[i * args.group_size:(i + 1) * args.group_size]
            r = [grade(loop.tok.decode(c, skip_special_tokens=True), row["answer"]) for c in group]
            step_rewards += r
            if not is_degenerate(r):
                for c, a in zip(group, group_advantages(r)):
                    train_p.append(prompts[i])
                    train_c.append(c)
                    train_a.append(a)
        rewards.append(sum(step_rewards) / len(step_rewards))
        if train_c:
            loop.model.train()
            loop.train_step(train_p, train_c, train_a)
        print(f"plain s{seed} step {step}: reward {rewards[-1]:.3f} datums {len(train_c)}", flush=True)
    return {"rewards": rewards, "eval": evals}


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def load_results(path: Path) -> dict[str, list[dict]]:
    by_arm: dict[str, list[dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_arm.setdefault(rec["arm"], []).append(rec)
    return by_arm


def summarize(records: list[dict]) -> dict:
    """Mean and spread (sample std over seeds) of the held-out accuracy gain, and the mean curves."""
    gains = []
    for rec in records:
        steps = sorted(int(s) for s in rec["eval"])
        gains.append(rec["eval"][str(steps[-1])] - rec["eval"][str(steps[0])])
    eval_steps = sorted({int(s) for rec in records for s in rec["eval"]})
    curve = {s: statistics.mean(rec["eval"][str(s)] for rec in records if str(s) in rec["eval"]) for s in eval_steps}
    n = min(len(rec["rewards"]) for rec in records)
    reward = [statistics.mean(rec["rewards"][i] for rec in records) for i in range(n)]
    return {"seeds": [rec["seed"] for rec in records], "gain_mean": statistics.mean(gains),
            "gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0, "gains": gains,
            "eval_curve": curve, "reward_curve": reward,
            "minutes_mean": statistics.mean(rec["seconds"] for rec in records) / 60}


def report(path: Path, plot_path: Path) -> dict:
    by_arm = load_results(path)
    summary = {arm: summarize(recs) for arm, recs in by_arm.items()}
    for arm, s in summary.items():
        curve = ", ".join(f"{k}: {v:.3f}" for k, v in s["eval_curve"].items())
        early = statistics.mean(s["reward_curve"][:5]) if s["reward_curve"] else float("nan")
        late = statistics.mean(s["reward_curve"][-5:]) if s["reward_curve"] else float("nan")
        print(f"{arm:22s} seeds {s['seeds']}  held-out {{{curve}}}  gain {s['gain_mean']:+.3f} "
              f"± {s['gain_std']:.3f}  reward first/last 5 {early:.2f} -> {late:.2f}  {s['minutes_mean']:.1f} min")
    if "plain" in summary:
        for arm, s in summary.items():
            if arm != "plain":
                print(f"gap plain - {arm}: {summary['plain']['gain_mean'] - s['gain_mean']:+.3f}")
    if summary:
        plot(by_arm, plot_path)
    return summary


def plot(by_arm: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_reward) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (arm, recs) in enumerate(sorted(by_arm.items())):
        color = f"C{i}"
        for rec in recs:
            steps = sorted(int(s) for s in rec["eval"])
            ax_eval.plot(steps, [rec["eval"][str(s)] for s in steps], color=color, alpha=0.25)
            ax_reward.plot(rec["rewards"], color=color, alpha=0.15)
        s = summarize(recs)
        steps = list(s["eval_curve"])
        at = [[rec["eval"][str(k)] for rec in recs if str(k) in rec["eval"]] for k in steps]
        ax_eval.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=color, alpha=0.12)
        ax_eval.plot(steps, list(s["eval_curve"].values()), color=color, marker="o",
                     label=f"{arm} (n={len(recs)}, gain {s['gain_mean']:+.2f} ± {s['gain_std']:.2f})")
        window = 5
        mean = s["reward_curve"]
        smooth = [statistics.mean(mean[max(0, k - window + 1):k + 1]) for k in range(len(mean))]
        ax_reward.plot(smooth, color=color, linewidth=2, label=f"{arm}: mean over seeds, moving average of {window}")
    ax_eval.set_title("greedy held-out accuracy (band: range over seeds, line: mean)")
    ax_reward.set_title("sampled reward per step (thin: each seed)")
    for ax in (ax_eval, ax_reward):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------------------
# Probe: what one update does, per setting (signal on the trained completions vs drift elsewhere)
# ---------------------------------------------------------------------------------------------------------

PROBE_SETTINGS = {  # name: (train_unembed, beta2, eps)
    "default": (True, 0.95, 1e-12), "eps": (True, 0.95, 1e-8),
    "no_unembed": (False, 0.95, 1e-12), "matched": (False, 0.99, 1e-8),
}


def _token_logprobs(client, datums) -> list[list[float]]:
    out = client.forward(datums, "cross_entropy").result()
    return [list(o["logprobs"].data) for o in out.loss_fn_outputs]


def run_probe(args, seed: int = 0) -> dict:
    """One step-0 batch (sampled as the recipe does), one update per setting from the same LoRA init.

    signal: mean change of the per-token logprob on the trained completions, weighted by the sign of their
    advantage (> 0: good completions up, bad ones down); drift: mean |change| of the logprob of the base
    model's greedy answers to held-out problems (positions the update had no reason to touch).
    """
    from grpo_lib import (
        FEWSHOT,
        batch_rows,
        build_datum,
        grade,
        group_advantages,
        is_degenerate,
        load_rows,
        render_prompt,
        sample_seed,
        shuffle_rows,
        stop_sequences,
    )

    import pytrio_compat as trio
    from pytrio_compat.embedded import EmbeddedWorker

    worker = EmbeddedWorker()
    service = trio.ServiceClient(base_url=worker.base_url, api_key=worker.api_key)
    base = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=seed)
    tok = base.get_tokenizer()
    sampler = base.save_weights_and_get_sampling_client()
    fewshot = FEWSHOT["arithmetic"]
    rows = batch_rows(shuffle_rows(load_rows("arithmetic", "train", seed=seed), seed), 0, args.batch_size, False)
    datums, signs = [], []
    for i, row in enumerate(rows):
        prompt = render_prompt(tok, row["question"], fewshot)
        params = trio.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=stop_sequences(tok),
                                     seed=sample_seed(seed, 0, i))
        res = sampler.sample(prompt=trio.ModelInput.from_ints(prompt), num_samples=args.group_size,
                             sampling_params=params).result()
        rewards = [grade(tok.decode(s.tokens, skip_special_tokens=True), row["answer"]) for s in res.sequences]
        if not is_degenerate(rewards):
            for s, a in zip(res.sequences, group_advantages(rewards)):
                datums.append(build_datum(prompt, s.tokens, s.logprobs, a))
                signs.append(1.0 if a > 0 else -1.0)
    greedy = trio.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=stop_sequences(tok))
    held_out, held_lens = [], []
    for row in load_rows("arithmetic", "test", n=args.eval_size):
        prompt = render_prompt(tok, row["question"], fewshot)
        seq = sampler.sample(prompt=trio.ModelInput.from_ints(prompt), num_samples=1,
                             sampling_params=greedy).result().sequences[0]
        held_out.append(build_datum(prompt, seq.tokens, seq.logprobs, 0.0))
        held_lens.append(len(seq.tokens))
    before_train, before_held = _token_logprobs(base, datums), _token_logprobs(base, held_out)
    results = {"datums": len(datums), "held_out": len(held_out)}
    for name, (unembed, beta2, eps) in PROBE_SETTINGS.items():
        client = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=seed,
                                                     train_unembed=unembed)
        client.forward_backward(datums, "importance_sampling").result()
        client.optim_step(trio.AdamParams(learning_rate=args.lr, beta2=beta2, eps=eps)).result()
        after_train, after_held = _token_logprobs(client, datums), _token_logprobs(client, held_out)
        signal, n = 0.0, 0
        for d, s, b, a in zip(datums, signs, before_train, after_train):
            mask = [x != 0.0 for x in d.loss_fn_inputs["advantages"].data]
            signal += sum(s * (y - x) for x, y, m in zip(b, a, mask) if m)
            n += sum(mask)
        drift, m = 0.0, 0
        for c, b, a in zip(held_lens, before_held, after_held):  # the last c positions are the answer
            drift += sum(abs(y - x) for x, y in zip(b[-c:], a[-c:]))
            m += c
        results[name] = {"signal": signal / max(n, 1), "drift": drift / max(m, 1)}
        print(f"probe {name:11s} signal {results[name]['signal']:+.4f}  drift {results[name]['drift']:.4f}",
              flush=True)
    worker.stop()
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=["plain", "recipe:default"],
                   help=f"plain, or recipe:<variant> with variant in {sorted(RECIPE_VARIANTS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--plain-alpha", type=float, default=32.0, help="LoRA alpha of the plain loop")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--results", type=Path, default=RESULTS / "learning_ab.jsonl")
    p.add_argument("--plot", type=Path, default=RESULTS / "learning_ab.png")
    p.add_argument("--log-root", default="/tmp/learning/runs")
    p.add_argument("--report", action="store_true", help="only summarise the results so far")
    p.add_argument("--probe", action="store_true", help="one update per setting from one step-0 batch")
    args = p.parse_args(argv)
    if args.eval_size < 1 or args.steps < 1:
        p.error("--eval-size and --steps must be >= 1")
    if args.probe:
        out = run_probe(args, args.seeds[0])
        (RESULTS / "learning_probe.json").write_text(json.dumps(out, indent=2) + "\n")
        return
    if not args.report:
        unknown = [a for a in args.arms if a != "plain" and a.removeprefix("recipe:") not in RECIPE_VARIANTS]
        if unknown:
            p.error(f"unknown arms {unknown}: use plain or recipe:<{'|'.join(RECIPE_VARIANTS)}>")
        run_arms(args)
    report(args.results, args.plot)


def run_arms(args) -> None:
    worker = None
    for seed in args.seeds:
        for arm in args.arms:
            t0 = time.time()
            if arm == "plain":
                out = run_plain(args, seed)
            else:
                if worker is None:
                    from pytrio_compat.embedded import EmbeddedWorker

                    worker = EmbeddedWorker()
                out = run_recipe(args, arm.removeprefix("recipe:"), seed, worker)
            rec = {"arm": arm, "seed": seed, "steps": args.steps, "eval_size": args.eval_size,
                   "seconds": time.time() - t0, **out, "eval": {str(k): v for k, v in out["eval"].items()}}
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with open(args.results, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"== {arm} seed {seed}: eval {rec['eval']} in {rec['seconds'] / 60:.1f} min", flush=True)
    if worker is not None:
        worker.stop()


if __name__ == "__main__":
    main()
