# ruff: noqa: N999 (a demo script, named like the upstream one)
"""GRPO on GSM8K with the async client API: all prompts of a step are sampled concurrently.

The step is the same as in 01-demo-sync.py (sampler snapshot, group sampling, \\boxed{} rewards,
group-relative advantages, right-shifted datums, forward_backward + optim_step); only the waiting
differs: `asyncio.gather` over `sample_async`, and the training calls are awaited twice (once to
submit, once for the result).

    python recipes/02-demo-async.py --steps 10 --batch-size 4 --group-size 8 --max-tokens 512 \\
        --data-file ../shared/data/gsm8k --eval-every 5 --swanlab-mode local

With the same --seed, step 0 builds exactly the datums of the sync demo. The GRPO variants (`--advantage std`,
`--loss-agg`, `--kl-coef`, `--clip-high`, `--dynamic-sampling`): recipes/grpo_variants.py.
"""

import asyncio
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
    evaluate_async,
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


async def run(args):
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
    config = {**vars(args), "script": "async", "num_steps": total_steps, "train_rows": len(train_rows)}
    logger = MetricsLogger(log_dir, config, args.swanlab_mode, args.swanlab_project)
    first_step_datums = None

    async def sample_group(sampler, prompt, seed, bar):
        params = trio.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_p=args.top_p, stop=stop, seed=seed)
        result = await sampler.sample_async(prompt=trio.ModelInput.from_ints(prompt),
                                            num_samples=args.group_size, sampling_params=params)
        bar.update(1)
        return result

    for step in range(total_steps):
        stats = StepStats()
        rows = batch_rows(train_rows, step, args.batch_size, args.all_data)

        # 1. A sampler that holds the current weights (on-policy sampling).
        with stats.timer("time/sync"):
            sampler = await training_client.save_weights_and_get_sampling_client_async()
        metrics_extra = {}
        if should_eval(args, step):
            with stats.timer("time/eval"):
                metrics_extra["eval/accuracy"] = await evaluate_async(
                    sampler, tokenizer, eval_rows, args.max_tokens, fewshot, suffix, eval_grader
                )

        # 2. Rollouts: every prompt's group in flight at once; the bar advances as each group finishes.
        async def rollouts(rows, first, sampler=sampler, step=step, stats=stats):
            prompts = [render_prompt(tokenizer, row["question"], fewshot, suffix) for row in rows]
            bar = tqdm(total=len(prompts), desc=f"step {step}", unit="prompt", leave=False)
            with stats.timer("time/sample"):
                results = await asyncio.gather(*(
                    sample_group(sampler, prompt, sample_seed(args.seed, step, first + i), bar)
                    for i, prompt in enumerate(prompts)
                ))
            bar.close()
            return list(zip(prompts, rows, results))

        # 3. Rewards -> group-relative advantages -> datums (groups with equal rewards teach nothing). With
        # --dynamic-sampling, more prompts until batch-size groups have rewards that differ (grpo_variants.py).
        batch = StepBatch(args, reward, tokenizer, stats, countdown_parts if args.dataset == "countdown" else None)
        batch.add(await rollouts(rows, 0))
        while missing := batch.missing():
            batch.rounds += 1
            more = extra_rows(train_rows, args.seed, step, batch.rounds, missing)
            batch.add(await rollouts(more, batch.rounds * args.batch_size))
        datums = batch.datums()
        metrics_extra.update(batch.metrics())
        if step == 0:
            first_step_datums = datums

        # 4. One update: submit forward_backward and optim_step (first await), then wait for both (second).
        fb_output = optim_output = None
        if not datums:
            print(f"step {step}: no datums: skipping update")
        else:
            with stats.timer("time/train"):
                if args.loss_fn == "cispo" and args.custom_cispo:
                    cispo = make_custom_cispo_loss(args.cispo_clip_low, args.cispo_clip_high)
                    fb = await training_client.forward_backward_custom_async(datums, cispo)
                else:
                    fb = await training_client.forward_backward_async(datums, loss_fn=args.loss_fn,
                                                                 loss_fn_config=loss_fn_config(args))
                op = await training_client.optim_step_async(adam_params)
                fb_output = await fb
                optim_output = await op

        bounds = (args.cispo_clip_low, args.cispo_clip_high) if args.loss_fn == "cispo" else None
        logger.log({**stats.metrics(datums, fb_output, optim_output, bounds, ppo_bounds(args)), **metrics_extra},
                   step=step)

    final_accuracy = None
    if args.eval_every > 0:
        sampler = await training_client.save_weights_and_get_sampling_client_async()
        final_accuracy = await evaluate_async(sampler, tokenizer, eval_rows, args.max_tokens, fewshot, suffix,
                                              eval_grader)
        logger.log({"eval/accuracy": final_accuracy}, step=total_steps)

    final_path = (await (await training_client.save_weights_for_sampler_async(name="final"))).path
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


def main(argv=None):
    args = build_arg_parser("GRPO demo, async client").parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.1f}s")
