"""What the two GRPO demos share, gathered in one import: `from grpo_lib import ...`.

Each concern lives in its own module, so it can be read and tested on its own (see `tests/recipes/`):

* `grpo_options`  the command line, log folder, step count, per-prompt sampling seeds, the service client;
* `grpo_prompts`  few-shot conversations, chat-template rendering, stop strings, completion text;
* `grpo_grading`  the `\\boxed{}` grader (and the upstream one, for comparison);
* `countdown`     the Countdown task: generated problems, its prompt, the exact expression reward;
* `grpo_datums`   group-relative advantages, right-shifted datums, KL and token counts, CISPO as a custom loss;
* `grpo_variants` std-normalised advantages, loss aggregation by weights, the KL term, DAPO's dynamic sampling;
* `grpo_data`     GSM8K (local file or hub), generated two-digit additions and Countdown, shuffling and batching;
* `grpo_logging`  per-step metrics, metrics.jsonl / console / SwanLab, curves.png;
* `grpo_eval`     greedy held-out accuracy;
* `grpo_demo`     what both demos set up around their step (`Demo`: options, data, clients, prompts, logs).

Conventions (the same as the PyTRIO / Tinker cookbook GRPO recipes):
* reward: 1.0 when the last `\\boxed{...}` of a completion equals the number after `#### ` in the GSM8K
  answer, else 0.0 (countdown: 1.0 when the boxed expression solves the problem, 0.1 when it is only
  well-formed, as TinyZero rewards it);
* advantage: reward - mean(group rewards), no std scaling; groups whose rewards are all equal carry no
  signal and are skipped (`--advantage std`, `--kl-coef`, `--loss-agg`, `--dynamic-sampling`: grpo_variants);
* datum: model_input = prompt + completion[:-1]; target_tokens, logprobs and advantages are shifted so
  that position t predicts token t+1, with the P-1 prompt positions zeroed.
"""

# ruff: noqa: F401 (re-exports)

from grpo_options import (
    LOSS_FNS, SWANLAB_MODES, DATASETS, build_arg_parser, resolve_log_dir, num_steps, sample_seed,
    make_service_client, loss_fn_config, ppo_bounds, DATASET_DEFAULTS, RecipeArgParser,
)
from grpo_variants import (
    ADVANTAGES, LOSS_AGGS, KL_ESTIMATORS, StepBatch, advantages, aggregation_weights, build_step_datums,
    extra_rows, group_advantages_std, policy_config,
)
from grpo_prompts import (
    QUESTION_SUFFIX, FEWSHOT_PREFIX, ARITHMETIC_FEWSHOT_PREFIX, FEWSHOT, Prompting, PROMPTS, build_messages,
    render_prompt, row_prompt, as_model_input, stop_sequences, completion_text,
)
from grpo_grading import (
    extract_boxed, normalize_number, gsm8k_final_answer, grade, upstream_grade,
)
from countdown import (
    countdown_reward, grade_countdown, countdown_rows, countdown_parts,
)
from grpo_datums import (
    group_advantages, is_degenerate, build_datum, count_train_tokens, kl_sample_train, make_custom_cispo_loss,
    ratio_clip_fraction, ppo_clip_fraction, logprob_gap_max,
)
from grpo_data import (
    HUB_HINT, DataUnavailableError, load_rows, eval_data_file, arithmetic_rows, shuffle_rows,
    batch_rows,
)
from grpo_logging import (
    StepStats, PLOTTED, REWARD_WINDOW, MetricsLogger, curve_lines, moving_average, plot_curves,
)
from grpo_eval import (
    EVAL_GRADERS, accuracy, evaluate, evaluate_async, greedy_results, should_eval,
)
from grpo_demo import Demo
