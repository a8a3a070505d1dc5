# ruff: noqa: N999 (a demo script, named like the upstream one)
"""GRPO on GSM8K with the synchronous client API: one prompt's group at a time.

Each step: snapshot the current LoRA into a sampler, sample `group_size` completions per prompt, reward
them by their last \\boxed{} answer, turn rewards into group-relative advantages, build right-shifted
datums, and run one forward_backward + optim_step.

    python recipes/01-demo-sync.py --steps 10 --batch-size 4 --group-size 8 --max-tokens 512 \\
        --data-file ../shared/data/gsm8k --eval-every 5 --swanlab-mode local

Tiny models on CPU: `--dataset arithmetic` (2-digit additions) is the task they can learn. `--dataset countdown`
(reach a target from 3-4 numbers with + - * /, as in TinyZero) is scored by recipes/countdown.py.
The GRPO variants (`--advantage std`, `--loss-agg`, `--kl-coef`, `--clip-high`, `--dynamic-sampling`):
recipes/grpo_variants.py.
"""

import time

from grpo_lib import (
    EVAL_GRADERS,
    PROMPTS,
    MetricsLogger,
    StepBatch,
    StepStats,
    batch_rows,
    build_arg_parser,
    countdown_parts,
    countdown_reward,
    eval_data_file,
    evaluate,
    extra_rows,
    grade,
    load_rows,
    loss_fn_config,
    make_custom_cispo_loss,
    make_service_client,
    num_steps,
    ppo_bounds,
    render_prompt,
    resolve_log_dir,
    sample_seed,
    should_eval,
    shuffle_rows,
    stop_sequences,
)
from tqdm import tqdm

import pytrio_compat as trio

# The upstream demos set these (older PyTRIO option names); kept so the script reads the same.
trio.configure(actor_event_wait_timeout=600, actor_event_request_timeout=600, timeout=600)


def main(argv=None):
    args = build_arg_parser("GRPO demo, synchronous client").parse_args(argv)
    train_rows = shuffle_rows(load_rows(args.dataset, "train", args.data_file, seed=args.seed), args.seed)
    eval_rows = (load_rows(args.dataset, "test", eval_data_file(args), n=args.eval_size)
                 if args.eval_every > 0 else [])
    total_steps = num_steps(args, len(train_rows))
    log_dir = resolve_log_dir(args.log_dir)
    print(f"{len(train_rows)} train rows, {total_steps} steps, logging to {log_dir}")

    service_client = make_service_client(args)
    training_client = service_client.create_lora_training_client(
        base_model=args.base_model, rank=args.lora_rank, seed=args.seed, train_unembed=args.train_unembed
    )
    tokenizer = training_client.get_tokenizer()
    stop = stop_sequences(tokenizer)
    fewshot, suffix = PROMPTS[args.dataset]  # the few-shot turns before each question, the answer format after it
    # Reward: the boxed number against the answer's; countdown checks the boxed expression exactly and gives 0.1
    # when it is well-formed but wrong. Evaluation counts right answers only.
    reward = countdown_reward if args.dataset == "countdown" else grade
    eval_grader = EVAL_GRADERS[args.dataset]
    adam_params = trio.AdamParams(learning_rate=args.learning_rate, beta1=args.beta1, beta2=args.beta2,
                                  eps=args.adam_eps)
    config = {**vars(args), "script": "sync", "num_steps": total_steps, "train_rows": len(train_rows)}
    logger = MetricsLogger(log_dir, config, args.swanlab_mode, args.swanlab_project)
    first_step_datums = None

    for step in range(total_steps):
        stats = StepStats()
        rows = batch_rows(train_rows, step, args.batch_size, args.all_data)

        # 1. A sampler that holds the current weights (on-policy sampling).
        with stats.timer("time/sync"):
            sampler = training_client.save_weights_and_get_sampling_client()
        metrics_extra = {}
        if should_eval(args, step):
            with stats.timer("time/eval"):
                metrics_extra["eval/accuracy"] = evaluate(sampler, tokenizer, eval_rows, args.max_tokens, fewshot,
                                                          suffix, eval_grader)

        # 2. Rollouts: group_size completions per prompt, one prompt after the other.
        def rollouts(rows, first, sampler=sampler, step=step, stats=stats):
            prompts = [render_prompt(tokenizer, row["question"], fewshot, suffix) for row in rows]
            results = []
            with stats.timer("time/sample"):
                for i, prompt in enumerate(tqdm(prompts, desc=f"step {step}", unit="prompt", leave=False)):
                    params = trio.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                 top_p=args.top_p, stop=stop,
                                                 seed=sample_seed(args.seed, step, first + i))
                    results.append(sampler.sample(prompt=trio.ModelInput.from_ints(prompt),
                                                  num_samples=args.group_size, sampling_params=params).result())
            return list(zip(prompts, rows, results))

        # 3. Rewards -> group-relative advantages -> datums (groups with equal rewards teach nothing). With
        # --dynamic-sampling, more prompts until batch-size groups have rewards that differ (grpo_variants.py).
        batch = StepBatch(args, reward, tokenizer, stats, countdown_parts if args.dataset == "countdown" else None)
        batch.add(rollouts(rows, 0))
        while missing := batch.missing():
            batch.rounds += 1
            more = extra_rows(train_rows, args.seed, step, batch.rounds, missing)
            batch.add(rollouts(more, batch.rounds * args.batch_size))
        datums = batch.datums()
        metrics_extra.update(batch.metrics())
        if step == 0:
            first_step_datums = datums

        # 4. One update: forward_backward and optim_step submitted back to back, then awaited.
        fb_output = optim_output = None
        if not datums:
            print(f"step {step}: no datums: skipping update")
        else:
            with stats.timer("time/train"):
                if args.loss_fn == "cispo" and args.custom_cispo:
                    cispo = make_custom_cispo_loss(args.cispo_clip_low, args.cispo_clip_high)
                    fb = training_client.forward_backward_custom(datums, cispo)
                else:
                    fb = training_client.forward_backward(datums, loss_fn=args.loss_fn,
                                                                 loss_fn_config=loss_fn_config(args))
                op = training_client.optim_step(adam_params)
                fb_output = fb.result()
                optim_output = op.result()

        bounds = (args.cispo_clip_low, args.cispo_clip_high) if args.loss_fn == "cispo" else None
        logger.log({**stats.metrics(datums, fb_output, optim_output, bounds, ppo_bounds(args)), **metrics_extra},
                   step=step)

    final_accuracy = None
    if args.eval_every > 0:
        sampler = training_client.save_weights_and_get_sampling_client()
        final_accuracy = evaluate(sampler, tokenizer, eval_rows, args.max_tokens, fewshot, suffix, eval_grader)
        logger.log({"eval/accuracy": final_accuracy}, step=total_steps)

    final_path = training_client.save_weights_for_sampler(name="final").result().path
    print(f"final sampler weights: {final_path}")
    curves = logger.close()
    return {
        "history": logger.history,
        "final_path": final_path,
        "final_eval_accuracy": final_accuracy,
        "first_step_datums": first_step_datums,
        "log_dir": str(log_dir),
        "curves": str(curves),
    }


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.1f}s")
