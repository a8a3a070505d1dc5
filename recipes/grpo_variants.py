"""GRPO as the textbooks vary it: advantage normalisation, loss aggregation, the KL term, DAPO's dynamic sampling.

* `--advantage mean`: A = r - mean(group) (the upstream scripts, the default). `std`: A = (r - mean) / (std + eps),
  std the group's sample standard deviation (Bessel-corrected, as verl's `norm_adv_by_std_in_grpo` and TRL
  compute it), eps = 1e-6 (verl's).
* `--loss-agg` (verl's `loss_agg_mode` names), exact on top of the worker's summed loss through per-token
  `weights`, constant within a sequence (T_i its completion tokens, B the call's sequences, L = --max-tokens):
    token-sum                 w = 1                 (today's loss; no weights sent)
    token-mean                w = 1 / sum_j T_j      (DAPO; TRL's `dapo` / `bnpo`)
    seq-mean-token-sum        w = 1 / B
    seq-mean-token-mean       w = 1 / (B * T_i)      (the original GRPO; TRL's `grpo`)
    seq-mean-token-sum-norm   w = 1 / (B * L)        (Dr. GRPO; TRL's `dr_grpo`. verl's code divides the
                                                      micro-batch's sum by L and rescales by its accumulation
                                                      steps: the same up to a constant factor)
  The weights scale the KL term too, so beta means what it means in the aggregation chosen.
* `--kl-coef` beta: the worker adds beta * KL(policy || base model) per trained token, from its exact reference
  pass (`--kl-estimator` k1 / k2 / k3). Given (even 0) the worker reports the KL, logged as `kl`. With beta > 0
  groups whose rewards are all equal are trained too: their advantages are 0, but the KL term still applies.
* `--dynamic-sampling` (DAPO): groups whose rewards are all equal are dropped and more prompts sampled until
  `--batch-size` informative groups are in hand, for at most `--max-sampling-rounds` extra rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import zlib
from collections.abc import Sequence

from grpo_datums import build_datum, group_advantages, is_degenerate
from grpo_prompts import completion_text
from shapes import counted

ADVANTAGES = ("mean", "std")
LOSS_AGGS = ("token-sum", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
STD_EPS = 1e-6


def add_variant_options(p: argparse.ArgumentParser) -> None:
    """The command line of the variants (both demos)."""
    p.add_argument("--advantage", choices=ADVANTAGES, default="mean",
                   help="mean: reward - group mean (default); std: (reward - mean) / (group std + 1e-6)")
    p.add_argument("--loss-agg", choices=LOSS_AGGS, default="token-sum",
                   help="how token losses add up (verl's names): token-sum (default, the worker's sum), "
                        "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm")
    p.add_argument("--kl-coef", type=float, default=None,
                   help="beta of the KL penalty to the base model, computed exactly by the worker (not sent by "
                        "default; 0 reports the KL without adding it to the loss)")
    p.add_argument("--kl-estimator", choices=KL_ESTIMATORS, default="k3",
                   help="per-token KL estimator: k1 lp-ref, k2 (lp-ref)^2/2, k3 exp(ref-lp)-(ref-lp)-1 (default)")
    p.add_argument("--log-entropy", action="store_true",
                   help="ask the worker for the policy's per-token entropy and log its mean as `entropy`")
    p.add_argument("--clip-low", type=float, default=None,
                   help="ppo: lower ratio bound (worker default 0.8)")
    p.add_argument("--clip-high", type=float, default=None,
                   help="ppo: upper ratio bound (worker default 1.2; DAPO's clip-higher: 1.28)")
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO: drop groups whose rewards are all equal and sample more prompts until the batch "
                        "is full (at most --max-sampling-rounds extra rounds)")
    p.add_argument("--max-sampling-rounds", type=int, default=3,
                   help="with --dynamic-sampling: extra sampling rounds per step at most (default 3)")


def check_variant_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse combinations that would be silently ignored."""
    if args.kl_coef is not None and args.kl_coef < 0:
        p.error("--kl-coef must be >= 0")
    if args.loss_fn != "ppo" and (args.clip_low is not None or args.clip_high is not None):
        p.error("--clip-low/--clip-high are ppo's ratio bounds (cispo: --cispo-clip-low/--cispo-clip-high)")
    if args.custom_cispo and (args.kl_coef is not None or args.log_entropy or args.loss_agg != "token-sum"):
        p.error("--custom-cispo computes its loss in the script: --kl-coef, --log-entropy and --loss-agg are "
                "for the worker's built-in losses")
    if not 0 <= args.max_sampling_rounds <= 20:
        p.error("--max-sampling-rounds must be in [0, 20]")


def group_advantages_std(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / (std + 1e-6) with the group's sample standard deviation; all zeros for a group of equal
    rewards (or of one)."""
    mean = sum(rewards) / len(rewards)
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    return [(float(r) - mean) / (std + STD_EPS) for r in rewards]


def advantages(rewards: Sequence[float], mode: str) -> list[float]:
    if mode == "mean":
        return group_advantages(rewards)
    if mode == "std":
        return group_advantages_std(rewards)
    raise ValueError(f"unknown advantage mode {mode!r}; use one of {ADVANTAGES}")


def aggregation_weights(mode: str, completion_lengths: Sequence[int], max_tokens: int) -> list[float] | None:
    """Each sequence's per-token weight for `mode` (see the module docstring); None for token-sum."""
    b = len(completion_lengths)
    if mode == "token-sum" or b == 0:
        return None
    if mode == "token-mean":
        return [1.0 / sum(completion_lengths)] * b
    if mode == "seq-mean-token-sum":
        return [1.0 / b] * b
    if mode == "seq-mean-token-mean":
        return [1.0 / (b * t) for t in completion_lengths]
    if mode == "seq-mean-token-sum-norm":
        return [1.0 / (b * max_tokens)] * b
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGS}")


def sends_weights(args: argparse.Namespace) -> bool:
    """Weights go with the datums when the aggregation needs them or the KL covers the completion tokens."""
    return args.loss_agg != "token-sum" or args.kl_coef is not None


def trains_equal_reward_groups(args: argparse.Namespace) -> bool:
    """With beta > 0 a group of equal rewards still trains (the KL term); dynamic sampling drops such groups."""
    return bool(args.kl_coef) and not args.dynamic_sampling


def build_step_datums(samples: Sequence[tuple], args: argparse.Namespace) -> list:
    """Datums of one step from (prompt tokens, sampled sequence, advantage) triples, weighted for --loss-agg."""
    if not sends_weights(args):
        return [build_datum(p, s.tokens, s.logprobs, a) for p, s, a in samples]
    weights = aggregation_weights(args.loss_agg, [len(s.tokens) for _, s, _ in samples], args.max_tokens)
    weights = weights or [1.0] * len(samples)
    return [build_datum(p, s.tokens, s.logprobs, a, weight=w) for (p, s, a), w in zip(samples, weights)]


def policy_config(args: argparse.Namespace) -> dict:
    """The variant keys of `loss_fn_config` (empty by default, so the default request is unchanged)."""
    config: dict = {}
    if args.loss_fn == "ppo":
        if args.clip_low is not None:
            config["clip_low_threshold"] = args.clip_low
        if args.clip_high is not None:
            config["clip_high_threshold"] = args.clip_high
    if args.kl_coef is not None:
        config["kl_coef"] = args.kl_coef
        config["kl_estimator"] = args.kl_estimator
    if args.log_entropy:
        config["return_entropy"] = True
    return config


# ---- dynamic sampling ------------------------------------------------------------------------------------

def extra_rows(train_rows: Sequence[dict], seed: int, step: int, round_: int, count: int) -> list[dict]:
    """Prompts for extra sampling round `round_` (1, 2, ...) of `step`: drawn by a seed of their own, so the
    main data order of every step stays what it is without dynamic sampling."""
    rng = random.Random(zlib.crc32(f"dynamic:{seed}:{step}:{round_}".encode()))
    return [train_rows[i] for i in rng.sample(range(len(train_rows)), min(count, len(train_rows)))]


def missing_groups(informative: int, batch_size: int) -> int:
    return max(0, batch_size - informative)


class StepBatch:
    """One step's sampled groups turned into training samples: rewards (recorded in `stats`), advantages, and
    which groups train. Groups come in rounds (`add`); with --dynamic-sampling `missing()` says how many more
    informative groups the batch needs."""

    def __init__(self, args: argparse.Namespace, reward, tokenizer, stats, parts=None) -> None:
        self.args, self.reward, self.tokenizer, self.stats, self.parts = args, reward, tokenizer, stats, parts
        self.samples: list[tuple] = []  # (prompt tokens, sampled sequence, advantage)
        self.informative = 0  # groups whose rewards differ
        self.sampled = 0
        self.rounds = 0  # extra rounds taken

    def add(self, groups: Sequence[tuple]) -> None:
        """(prompt tokens, row, SampleResponse) per prompt."""
        keep_equal = trains_equal_reward_groups(self.args)
        for prompt, row, result in groups:
            self.sampled += 1
            if not isinstance(prompt, list):  # an image prompt: its image's token count from the worker's answer
                prompt = counted(prompt, result.input_tokens)
            texts = [completion_text(self.tokenizer, seq) for seq in result.sequences]
            rewards = [self.reward(text, row["answer"]) for text in texts]
            scores = [self.parts(text, row["answer"]) for text in texts] if self.parts else None
            self.stats.add_group(rewards, result.sequences, result.metrics, scores)
            degenerate = is_degenerate(rewards)
            if self.args.dynamic_sampling and not degenerate and self.informative >= self.args.batch_size:
                continue  # DAPO keeps batch-size informative groups
            self.informative += int(not degenerate)
            if degenerate and not keep_equal:
                continue
            for seq, advantage in zip(result.sequences, advantages(rewards, self.args.advantage)):
                if seq.tokens:
                    self.samples.append((prompt, seq, advantage))

    def missing(self) -> int:
        """Informative groups still needed (0 without --dynamic-sampling or once the rounds are spent)."""
        if not self.args.dynamic_sampling or self.rounds >= self.args.max_sampling_rounds:
            return 0
        return missing_groups(self.informative, self.args.batch_size)

    def datums(self) -> list:
        return build_step_datums(self.samples, self.args)

    def metrics(self) -> dict[str, float]:
        if not self.args.dynamic_sampling:
            return {}
        return {"dynamic/extra_rounds": float(self.rounds), "dynamic/groups_sampled": float(self.sampled),
                "dynamic/informative_groups": float(min(self.informative, self.args.batch_size))}
