"""The learning A/B harness (benchmarks/learning_ab.py): its plain loop's update and its summary numbers,
each against a direct computation. The plain loop runs on the tiny random model."""

from __future__ import annotations

import argparse
import statistics

import pytest
import torch
import torch.nn.functional as F

from benchmarks.learning_ab import PlainLoop, summarize


@pytest.fixture
def loop(tiny_model_dir):
    args = argparse.Namespace(model=str(tiny_model_dir), rank=4, plain_alpha=8.0, lr=1e-3, max_tokens=5)
    return PlainLoop(args, seed=0)


def test_plain_loop_gradient_is_minus_advantage_weighted_logprob_over_tokens(loop):
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11]]
    completions = [[20, 21, 22], [23, 24], [25, 26, 27, 28]]
    advantages = [0.5, -0.5, 0.25]
    params = {n: p for n, p in loop.model.named_parameters() if p.requires_grad}
    # the lora_B start at zero; move them so every LoRA factor gets a gradient
    with torch.no_grad():
        for n, p in params.items():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    loop.opt.step = lambda: None  # keep the gradients of train_step, skip the update
    loop.model.train()
    loop.train_step(prompts, completions, advantages)
    got = {n: p.grad.clone() for n, p in params.items()}

    # direct: one padded batch, -(sum_i A_i * sum_t lp_it) / total tokens
    loop.model.zero_grad()
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, :len(p) + len(c)] = 1
    logprobs = F.log_softmax(loop.model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    total = sum(len(c) for c in completions)
    loss = 0.0
    for i, (p, c, a) in enumerate(zip(prompts, completions, advantages)):
        positions = torch.arange(len(p) - 1, len(p) + len(c) - 1)
        loss = loss - a * logprobs[i, positions, torch.tensor(c)].sum() / total
    loss.backward()
    assert max(float(p.grad.abs().max()) for p in params.values()) > 1e-6
    for n, p in params.items():
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-4)


def test_plain_loop_generation_stops_at_the_stop_token(loop):
    loop.model.eval()
    outs = loop.generate([[5, 6, 7], [9, 10]], 3, greedy=False, seed=1)
    assert len(outs) == 6
    for out in outs:
        assert 1 <= len(out) <= 5
        assert all(t not in loop.stop_ids for t in out[:-1])  # a stop token can only be the last one


def test_summarize_gains_and_curves():
    records = [{"seed": 0, "eval": {"0": 0.4, "10": 0.5, "20": 0.7}, "rewards": [0.1, 0.3, 0.5], "seconds": 60},
               {"seed": 1, "eval": {"0": 0.4, "10": 0.45, "20": 0.6}, "rewards": [0.2, 0.2, 0.4, 0.9],
                "seconds": 120}]
    s = summarize(records)
    assert s["gains"] == pytest.approx([0.3, 0.2])
    assert s["gain_mean"] == pytest.approx(0.25) and s["gain_std"] == pytest.approx(statistics.stdev([0.3, 0.2]))
    assert s["eval_curve"] == pytest.approx({0: 0.4, 10: 0.475, 20: 0.65})
    assert s["reward_curve"] == pytest.approx([0.15, 0.25, 0.45])  # as long as the shortest run
    assert s["minutes_mean"] == pytest.approx(1.5)
