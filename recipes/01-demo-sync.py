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
recipes/grpo_variants.py. Everything around the step (options, data, clients, evaluation, logs):
recipes/grpo_demo.py.
"""

import time

from grpo_lib import Demo, StepStats, build_datum, completion_text, countdown_reward, grade, group_advantages
from tqdm import tqdm

import pytrio_compat as trio

# The upstream demos set these (older PyTRIO option names); kept so the script reads the same.
trio.configure(actor_event_wait_timeout=600, actor_event_request_timeout=600, timeout=600)
# The held-out evaluation sends every problem at once: the worker prefills the waiting requests as one group and
# decodes them as one batch (200 problems: 48 s where 16 at a time take 99 s; benchmarks/eval_batching.py).
trio.configure(sampling_request_max_in_flight=256)


def rollouts(demo, sampler, rows, step, first=0):
    """`group_size` completions for each row's prompt, one prompt after the other: (prompt, row, response)."""
    groups = []
    for i, row in enumerate(tqdm(rows, desc=f"step {step}", unit="prompt", leave=False)):
        prompt = demo.prompt(row)
        result = sampler.sample(prompt=demo.model_input(prompt), num_samples=demo.args.group_size,
                                sampling_params=demo.sampling_params(step, first + i)).result()
        groups.append((prompt, row, result))
    return groups


def main(argv=None):
    demo = Demo("GRPO demo, synchronous client", argv, script="sync")
    args, training_client, tokenizer = demo.args, demo.training_client, demo.tokenizer
    # Reward: the boxed number against the answer's (countdown: the boxed expression, 0.1 when only well-formed).
    reward = countdown_reward if args.dataset == "countdown" else grade

    for step in range(demo.total_steps):
        stats, extra = StepStats(), {}

        # 1. A sampler that holds the current weights (on-policy sampling); greedy held-out accuracy now and then.
        with stats.timer("time/sync"):
            sampler = training_client.save_weights_and_get_sampling_client()
        if demo.should_eval(step):
            with stats.timer("time/eval"):
                extra["eval/accuracy"] = demo.evaluate(sampler)

        # 2. Rollouts: group_size completions per prompt.
        with stats.timer("time/sample"):
            groups = rollouts(demo, sampler, demo.rows(step), step)

        # 3. Rewards -> group-relative advantages -> datums. A group whose rewards are all equal has advantages
        # of 0: it teaches nothing and is skipped.
        if not demo.uses_variants:
            datums = []
            for prompt, row, result in groups:
                rewards = [reward(completion_text(tokenizer, seq), row["answer"]) for seq in result.sequences]
                stats.add_group(rewards, result.sequences, result.metrics)
                if len(set(rewards)) == 1:
                    continue
                for seq, advantage in zip(result.sequences, group_advantages(rewards)):  # reward - group mean
                    if seq.tokens:
                        datums.append(build_datum(prompt, seq.tokens, seq.logprobs, advantage))
        else:  # --advantage std, --loss-agg, --kl-coef, --dynamic-sampling; countdown, shapes: grpo_variants.py
            batch = demo.variant_batch(reward, stats)
            batch.add(groups)
            for more, first in demo.more_rows(batch, step):  # --dynamic-sampling: until the batch is informative
                with stats.timer("time/sample"):
                    batch.add(rollouts(demo, sampler, more, step, first))
            datums = batch.datums()
            extra.update(batch.metrics())

        # 4. One update: forward_backward and optim_step submitted back to back, then awaited.
        fb_output = optim_output = None
        if not datums:
            print(f"step {step}: no datums: skipping update")
        else:
            with stats.timer("time/train"):
                if (custom_loss := demo.custom_loss()) is not None:  # --custom-cispo: the loss computed here
                    fb = training_client.forward_backward_custom(datums, custom_loss)
                else:
                    fb = training_client.forward_backward(datums, loss_fn=args.loss_fn,
                                                          loss_fn_config=demo.loss_fn_config())
                op = training_client.optim_step(demo.adam_params)
                fb_output, optim_output = fb.result(), op.result()
        demo.log(step, stats, datums, fb_output, optim_output, {**extra, "sampler/staleness": 0.0})

    final_accuracy = None
    if args.eval_every > 0:
        final_accuracy = demo.evaluate(training_client.save_weights_and_get_sampling_client())
    final_path = training_client.save_weights_for_sampler(name="final").result().path
    return demo.finish(final_path, final_accuracy)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.1f}s")
