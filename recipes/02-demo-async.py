# ruff: noqa: N999 (a demo script, named like the upstream one)
"""GRPO on GSM8K with the async client API: all prompts of a step are sampled concurrently.

The step is the same as in 01-demo-sync.py (sampler snapshot, group sampling, \\boxed{} rewards,
group-relative advantages, right-shifted datums, forward_backward + optim_step); only the waiting
differs: `asyncio.gather` over `sample_async`, and the training calls are awaited twice (once to
submit, once for the result).

    python recipes/02-demo-async.py --steps 10 --batch-size 4 --group-size 8 --max-tokens 512 \\
        --data-file ../shared/data/gsm8k --eval-every 5 --swanlab-mode local

`--max-steps-off-policy 1` starts the next step's rollouts as soon as this step's update is submitted, from this
step's sampler, so the worker decodes them while the script waits for the update: every step after the first
trains on samples one update old (logged as `sampler/staleness`). The losses' importance ratio is
exp(learner logprob - sampler logprob), with the sampler's logprobs in each datum, so they stay correctly weighted.

With the same --seed, step 0 builds exactly the datums of the sync demo. The GRPO variants (`--advantage std`,
`--loss-agg`, `--kl-coef`, `--clip-high`, `--dynamic-sampling`): recipes/grpo_variants.py. Everything around
the step (options, data, clients, evaluation, logs): recipes/grpo_demo.py.
"""

import asyncio
import time

from grpo_lib import Demo, StepStats, build_datum, completion_text, countdown_reward, grade, group_advantages
from tqdm import tqdm

import pytrio_compat as trio

# The upstream demos set these (older PyTRIO option names); kept so the script reads the same.
trio.configure(actor_event_wait_timeout=600, actor_event_request_timeout=600, timeout=600)
# The held-out evaluation sends every problem at once: the worker prefills the waiting requests as one group and
# decodes them as one batch (200 problems: 48 s where 16 at a time take 99 s; benchmarks/eval_batching.py).
trio.configure(sampling_request_max_in_flight=256)


async def rollouts(demo, sampler, rows, step, first=0):
    """`group_size` completions for each row's prompt, every prompt in flight at once: (prompt, row, response)."""
    prompts = [demo.prompt(row) for row in rows]
    bar = tqdm(total=len(prompts), desc=f"step {step}", unit="prompt", leave=False)

    async def group(i, prompt):
        result = await sampler.sample_async(prompt=demo.model_input(prompt), num_samples=demo.args.group_size,
                                            sampling_params=demo.sampling_params(step, first + i))
        bar.update(1)
        return result

    results = await asyncio.gather(*(group(i, prompt) for i, prompt in enumerate(prompts)))
    bar.close()
    return list(zip(prompts, rows, results))


async def run(demo):
    args, training_client, tokenizer = demo.args, demo.training_client, demo.tokenizer
    # Reward: the boxed number against the answer's (countdown: the boxed expression, 0.1 when only well-formed).
    reward = countdown_reward if args.dataset == "countdown" else grade
    ahead = None  # (the next step's rollouts, started while this step trained; the step whose weights sample them)

    for step in range(demo.total_steps):
        stats, extra = StepStats(), {}

        # 1. A sampler that holds the current weights (the weights after `step` updates); greedy held-out
        # accuracy now and then.
        with stats.timer("time/sync"):
            sampler = await training_client.save_weights_and_get_sampling_client_async()
        if demo.should_eval(step):
            with stats.timer("time/eval"):
                extra["eval/accuracy"] = await demo.evaluate_async(sampler)

        # 2. Rollouts: every prompt's group in flight at once, from this sampler (on-policy), or, with
        # --max-steps-off-policy 1, the ones started from the previous step's sampler while that step trained.
        with stats.timer("time/sample"):
            if ahead is None:
                ahead = (asyncio.create_task(rollouts(demo, sampler, demo.rows(step), step)), step)
            task, sampled_at = ahead
            groups, ahead = await task, None
        staleness = step - sampled_at  # updates between the sampler's weights and the ones this step trains
        assert 0 <= staleness <= args.max_steps_off_policy, (step, sampled_at)

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
                    batch.add(await rollouts(demo, sampler, more, step, first))
            datums = batch.datums()
            extra.update(batch.metrics())

        # 4. One update: submit forward_backward and optim_step (first await), then wait for both (second). With
        # --max-steps-off-policy 1 the next step's rollouts start in between, from this step's sampler.
        fb_output = optim_output = None
        with stats.timer("time/train"):
            if datums:
                if (custom_loss := demo.custom_loss()) is not None:  # --custom-cispo: the loss computed here
                    fb = await training_client.forward_backward_custom_async(datums, custom_loss)
                else:
                    fb = await training_client.forward_backward_async(datums, loss_fn=args.loss_fn,
                                                                      loss_fn_config=demo.loss_fn_config())
                op = await training_client.optim_step_async(demo.adam_params)
            if args.max_steps_off_policy and step + 1 < demo.total_steps:
                ahead = (asyncio.create_task(rollouts(demo, sampler, demo.rows(step + 1), step + 1)), step)
            if datums:
                fb_output, optim_output = await fb, await op
            else:
                print(f"step {step}: no datums: skipping update")
        demo.log(step, stats, datums, fb_output, optim_output, {**extra, "sampler/staleness": float(staleness)})

    final_accuracy = None
    if args.eval_every > 0:
        final_accuracy = await demo.evaluate_async(await training_client.save_weights_and_get_sampling_client_async())
    final_path = (await (await training_client.save_weights_for_sampler_async(name="final"))).path
    return demo.finish(final_path, final_accuracy)


def main(argv=None):
    return asyncio.run(run(Demo("GRPO demo, async client", argv, script="async")))


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.1f}s")
