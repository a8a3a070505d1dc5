"""What the two demos set up around their GRPO step: the options, the data, the clients, the prompts, each
prompt's sampling parameters, evaluation, the variants' step and the logs. The step itself is in the demos."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytrio_compat as trio
from countdown import countdown_parts
from grpo_data import batch_rows, eval_data_file, load_rows, shuffle_rows
from grpo_datums import make_custom_cispo_loss
from grpo_eval import EVAL_GRADERS, evaluate, evaluate_async, should_eval
from grpo_logging import MetricsLogger, StepStats
from grpo_options import build_arg_parser, loss_fn_config, make_service_client, num_steps, ppo_bounds, \
    resolve_log_dir, sample_seed
from grpo_prompts import PROMPTS, as_model_input, row_prompt, stop_sequences
from grpo_variants import StepBatch, extra_rows

# The options that leave the baseline step (reward, reward - group mean, one datum per completion), and the
# datasets whose rewards or prompts it does not handle: with any of them the demos build a step's datums
# through grpo_variants.StepBatch. (--clip-low/--clip-high, --log-entropy and the losses need no other step:
# they go to the worker in loss_fn_config.)
_VARIANT_DATASETS = ("countdown", "shapes")


class Demo:
    """One demo run: its parsed options (`args`), train and held-out rows, `training_client`, `tokenizer`,
    and the pieces of the step that are the same in both demos."""

    def __init__(self, description: str, argv: Sequence[str] | None, script: str) -> None:
        parser = build_arg_parser(description)
        self.args = args = parser.parse_args(argv)
        if script == "sync" and args.max_steps_off_policy:
            parser.error("--max-steps-off-policy is for 02-demo-async.py: the sync demo samples every step from "
                         "its own weights")
        self.train_rows = shuffle_rows(load_rows(args.dataset, "train", args.data_file, seed=args.seed), args.seed)
        self.eval_rows = (load_rows(args.dataset, "test", eval_data_file(args), n=args.eval_size)
                          if args.eval_every > 0 else [])
        self.total_steps = num_steps(args, len(self.train_rows))
        self.log_dir = resolve_log_dir(args.log_dir)
        print(f"{len(self.train_rows)} train rows, {self.total_steps} steps, logging to {self.log_dir}")
        service_client = make_service_client(args)
        self.training_client = service_client.create_lora_training_client(
            base_model=args.base_model, rank=args.lora_rank, seed=args.seed, train_unembed=args.train_unembed)
        self.tokenizer = self.training_client.get_tokenizer()
        self._stop = stop_sequences(self.tokenizer)
        self._fewshot, self._suffix = PROMPTS[args.dataset]  # the few-shot turns, the answer format after a question
        self.adam_params = trio.AdamParams(learning_rate=args.learning_rate, beta1=args.beta1, beta2=args.beta2,
                                           eps=args.adam_eps)
        config = {**vars(args), "script": script, "num_steps": self.total_steps, "train_rows": len(self.train_rows)}
        self.logger = MetricsLogger(self.log_dir, config, args.swanlab_mode, args.swanlab_project)
        self.first_step_datums: list | None = None

    # --- sampling -----------------------------------------------------------------------------------------

    def rows(self, step: int) -> list[dict]:
        """The step's `--batch-size` rows of the shuffled train split."""
        return batch_rows(self.train_rows, step, self.args.batch_size, self.args.all_data)

    def prompt(self, row: dict) -> Any:
        """The row's question as the chat-rendered few-shot prompt: its token ids (an image prompt of
        --dataset shapes: a ModelInput with the image)."""
        return row_prompt(self.tokenizer, row, self._fewshot, self._suffix)

    @staticmethod
    def model_input(prompt: Any) -> trio.ModelInput:
        """A prompt as `sample` takes it."""
        return as_model_input(prompt)

    def sampling_params(self, step: int, index: int) -> trio.SamplingParams:
        """Sampling parameters of the `index`-th prompt of `step`: its seed is the same in both demos."""
        a = self.args
        return trio.SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                   stop=self._stop, seed=sample_seed(a.seed, step, index))

    # --- the variants' step -----------------------------------------------------------------------------------

    @property
    def uses_variants(self) -> bool:
        """Whether this run's datums come from grpo_variants.StepBatch rather than the demos' baseline step."""
        a = self.args
        return (a.dataset in _VARIANT_DATASETS or a.advantage != "mean" or a.loss_agg != "token-sum"
                or a.kl_coef is not None or a.dynamic_sampling)

    def variant_batch(self, reward, stats: StepStats) -> StepBatch:
        """A step's groups turned into datums with the variant options (add the groups, then `more_rows` says
        which more prompts --dynamic-sampling wants)."""
        parts = countdown_parts if self.args.dataset == "countdown" else None
        return StepBatch(self.args, reward, self.tokenizer, stats, parts)

    def more_rows(self, batch: StepBatch, step: int) -> Iterator[tuple[list[dict], int]]:
        """--dynamic-sampling's extra rounds of the step: for each, the rows to sample and the index of the first
        among the step's prompts (its sampling seeds), while the batch still wants informative groups (the caller
        adds each round's groups to `batch` before asking for the next). None without --dynamic-sampling."""
        while missing := batch.missing():
            batch.rounds += 1
            rows = extra_rows(self.train_rows, self.args.seed, step, batch.rounds, missing)
            yield rows, batch.rounds * self.args.batch_size

    # --- training -------------------------------------------------------------------------------------------

    def loss_fn_config(self) -> dict | None:
        return loss_fn_config(self.args)

    def custom_loss(self):
        """The client-side CISPO loss with --loss-fn cispo --custom-cispo, else None (the worker's built-in loss)."""
        a = self.args
        if a.loss_fn == "cispo" and a.custom_cispo:
            return make_custom_cispo_loss(a.cispo_clip_low, a.cispo_clip_high)
        return None

    # --- evaluation and logs ------------------------------------------------------------------------------

    def should_eval(self, step: int) -> bool:
        return should_eval(self.args, step)

    def evaluate(self, sampler: Any) -> float:
        """Greedy accuracy on the held-out rows, all submitted at once (grpo_eval.py)."""
        return evaluate(sampler, self.tokenizer, self.eval_rows, self.args.max_tokens, self._fewshot, self._suffix,
                        EVAL_GRADERS[self.args.dataset])

    async def evaluate_async(self, sampler: Any) -> float:
        return await evaluate_async(sampler, self.tokenizer, self.eval_rows, self.args.max_tokens, self._fewshot,
                                    self._suffix, EVAL_GRADERS[self.args.dataset])

    def log(self, step: int, stats: StepStats, datums: list, fb_output: Any, optim_output: Any,
            extra: dict[str, float]) -> None:
        """One metrics.jsonl row (and console line, SwanLab point) for the step."""
        a = self.args
        cispo = (a.cispo_clip_low, a.cispo_clip_high) if a.loss_fn == "cispo" else None
        metrics = stats.metrics(datums, fb_output, optim_output, cispo, ppo_bounds(a))
        self.logger.log({**metrics, **extra}, step=step)
        if step == 0:
            self.first_step_datums = datums

    def finish(self, final_path: str, final_accuracy: float | None) -> dict:
        """Log the final evaluation, draw the curves; what the run did (the demos' `main` returns it)."""
        if final_accuracy is not None:
            self.logger.log({"eval/accuracy": final_accuracy}, step=self.total_steps)
        print(f"final sampler weights: {final_path}")
        curves = self.logger.close()
        return {"history": self.logger.history, "final_path": final_path, "final_eval_accuracy": final_accuracy,
                "first_step_datums": self.first_step_datums, "log_dir": str(self.log_dir), "curves": str(curves)}

