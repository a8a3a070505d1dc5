"""What the two GRPO demos share, gathered in one import: `from grpo_lib import ...`.

Each concern lives in its own module, so it can be read and tested on its own (see `tests/recipes/`):

* `grpo_options`  the command line, log folder, step count, per-prompt sampling seeds, the service client;
* `grpo_prompts`  few-shot conversations, chat-template rendering, stop strings, completion text;
* `grpo_grading`  the `\\boxed{}` grader (and the upstream one, for comparison);
* `grpo_datums`   group-relative advantages, right-shifted datums, KL and token counts, CISPO as a custom loss;
* `grpo_data`     GSM8K (local file or hub) and generated two-digit additions, shuffling and batching;
* `grpo_logging`  per-step metrics, metrics.jsonl / console / SwanLab, curves.png;
* `grpo_eval`     greedy held-out accuracy.

Conventions (the same as the PyTRIO / Tinker cookbook GRPO recipes):
* reward: 1.0 when the last `\\boxed{...}` of a completion equals the number after `#### ` in the GSM8K
  answer, else 0.0;
* advantage: reward - mean(group rewards), no std scaling; groups whose rewards are all equal carry no
  signal and are skipped;
* datum: model_input = prompt + completion[:-1]; target_tokens, logprobs and advantages are shifted so
  that position t predicts token t+1, with the P-1 prompt positions zeroed.
"""

# ruff: noqa: F401 (re-exports)

from grpo_data import (
    HUB_HINT,
    DataUnavailableError,
    _load_hub_gsm8k,
    arithmetic_rows,
    batch_rows,
    eval_data_file,
    load_rows,
    shuffle_rows,
)
from grpo_datums import (
    build_datum,
    count_train_tokens,
    group_advantages,
    is_degenerate,
    kl_sample_train,
    make_custom_cispo_loss,
    ratio_clip_fraction,
)
from grpo_eval import (
    evaluate,
    evaluate_async,
    should_eval,
)
from grpo_grading import (
    extract_boxed,
    grade,
    gsm8k_final_answer,
    normalize_number,
    upstream_grade,
)
from grpo_logging import (
    PLOTTED,
    REWARD_WINDOW,
    MetricsLogger,
    StepStats,
    curve_lines,
    moving_average,
    plot_curves,
)
from grpo_options import (
    DATASET_DEFAULTS,
    DATASETS,
    LOSS_FNS,
    SWANLAB_MODES,
    RecipeArgParser,
    build_arg_parser,
    loss_fn_config,
    make_service_client,
    num_steps,
    resolve_log_dir,
    sample_seed,
)
from grpo_prompts import (
    ARITHMETIC_FEWSHOT_PREFIX,
    FEWSHOT,
    FEWSHOT_PREFIX,
    QUESTION_SUFFIX,
    build_messages,
    completion_text,
    render_prompt,
    stop_sequences,
)
