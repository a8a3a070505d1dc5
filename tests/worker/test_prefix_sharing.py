"""Prefix-shared forward/backward gives the unshared results: logprobs, losses, gradients, weights after a step.

Each test runs the same batch on two hosts of the same tiny model, one sharing prefixes and one not, and
compares. The batches hold GRPO-like groups (several completions of one prompt) whose prompt positions carry
non-zero weights / advantages, plus datums that share nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pytrio_compat.types import AdamParams
from pytrio_compat.wire import LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine.local_host import LocalModelHost
from server_mock.engine.tiny_model import TINY_FAMILIES, make_tiny_model
from server_mock.training import prefix_cache, prefix_planning, prefix_sharing
from server_mock.training.losses import LOSS_FUNCTIONS

TOL = 1e-5  # absolute, and relative for values above 1 (float32 rounding of a differently ordered sum)


# --- grouping -------------------------------------------------------------------------------------------------

def test_groups_follow_the_shared_prompts():
    rng = np.random.default_rng(0)
    p1, p2 = rng.integers(3, 500, 40), rng.integers(3, 500, 40)
    seqs = [np.concatenate([p, rng.integers(3, 500, n)]) for p, n in ((p1, 5), (p2, 7), (p1, 3), (p2, 1), (p1, 9))]
    seqs.append(rng.integers(3, 500, 50))  # shares nothing
    seqs.append(p1[:20].copy())  # shares only 19 tokens with p1's group (at least one token must stay after it)
    groups = prefix_planning.find_groups(seqs, min_tokens=32)
    assert {(g.prefix_len, tuple(sorted(g.members))) for g in groups} == {(40, (0, 2, 4)), (40, (1, 3))}
    assert prefix_planning.find_groups(seqs, min_tokens=0) == []
    assert prefix_planning.find_groups(seqs, min_tokens=41) == []


def test_groups_choose_the_grouping_that_saves_most_tokens():
    """Two prompts that share a 32-token system prompt: one group per prompt saves more than one big group."""
    rng = np.random.default_rng(1)
    system = rng.integers(3, 500, 32)
    a, b = np.concatenate([system, rng.integers(3, 500, 60)]), np.concatenate([system, rng.integers(3, 500, 60)])
    seqs = [np.concatenate([p, rng.integers(3, 500, 4)]) for p in (a, a, a, b, b, b)]
    groups = prefix_planning.find_groups(seqs, min_tokens=16)
    assert sorted((g.prefix_len, sorted(g.members)) for g in groups) == [(92, [0, 1, 2]), (92, [3, 4, 5])]
    # identical sequences: the prefix stops one token short, so each still predicts something
    same = [np.arange(3, 40)] * 3
    assert prefix_planning.find_groups(same, min_tokens=8)[0].prefix_len == 36


def test_chunks_fit_the_budget_after_the_prefixes():
    batch = prefix_planning.PrefixBatch(100, (prefix_planning.PrefixGroup(100, (0, 1, 2, 3, 4)),))
    lengths = [110, 130, 105, 120, 140]  # remainders 10, 30, 5, 20, 40
    chunks = prefix_planning.chunk_batch(batch, lengths, budget=160)  # 60 padded remainder tokens per chunk
    assert chunks == [[(2, 0), (0, 0), (3, 0)], [(1, 0)], [(4, 0)]]
    assert len(prefix_planning.chunk_batch(batch, lengths, budget=50)) == 5  # one row at least


def test_prompts_of_similar_length_share_one_prefix_pass():
    groups = [prefix_planning.PrefixGroup(100, (0, 1)), prefix_planning.PrefixGroup(60, (2, 3)),
              prefix_planning.PrefixGroup(95, (4, 5)), prefix_planning.PrefixGroup(92, (6, 7))]
    batches = prefix_planning.batch_groups(groups, budget=1000)
    assert [(b.prefix_len, [g.members for g in b.groups]) for b in batches] == \
        [(92, [(0, 1), (4, 5), (6, 7)]), (60, [(2, 3)])]
    assert batches[0].rows() == [(0, 0), (1, 0), (4, 1), (5, 1), (6, 2), (7, 2)]
    # the prefix pass itself stays within the budget: 2 x 95 fits 200, a third prompt does not
    assert [len(b.groups) for b in prefix_planning.batch_groups(groups, budget=200)] == [2, 1, 1]
    # chunks after a two-prompt pass: budget minus both prompts
    lengths = [96, 97, 0, 0, 110, 130, 0, 0]  # remainders 1, 2, 15, 35 after the 95-token prefixes
    chunks = prefix_planning.chunk_batch(prefix_planning.PrefixBatch(95, (groups[0], groups[2])), lengths, 230)
    assert chunks == [[(0, 0), (1, 0)], [(4, 1)], [(5, 1)]]  # 230 - 2 x 95 = 40 padded tokens per chunk


def _held_tokens(seqs, budget):
    """The most tokens the worker's plan holds at once in a shared pass: its prompts plus one chunk of remainders."""
    lengths = [len(s) for s in seqs]
    return max(len(batch.groups) * batch.prefix_len + len(c) * (max(lengths[i] for i, _ in c) - batch.prefix_len)
               for batch, chunks in prefix_planning.plan(seqs, budget, 32).shared for c in chunks)


@pytest.mark.parametrize("prompt, completions, groups_of", [(150, (200, 300), 2), (157, (10, 30), 4),
                                                            (40, (5, 400), 3), (600, (1, 50), 5)])
def test_shared_passes_hold_no_more_tokens_than_the_unshared_micro_batches(prompt, completions, groups_of):
    # GSM8K-like (long completions) and demo-like (short ones) batches of groups of 8, the worker's budget
    rng = np.random.default_rng(prompt)
    seqs = []
    for _ in range(groups_of):
        head = rng.integers(3, 500, prompt)
        seqs += [np.concatenate([head, rng.integers(3, 500, int(rng.integers(*completions)))]) for _ in range(8)]
    lengths = [len(s) for s in seqs]
    passes = prefix_planning.plan(seqs, 2048, 32)
    assert not passes.rest and sorted(i for b, _ in passes.shared for i, _ in b.rows()) == list(range(len(seqs)))
    unshared_peak = max(len(b) * max(lengths[i] for i in b) for b in prefix_planning.micro_batches(lengths, 2048))
    assert _held_tokens(seqs, 2048) <= unshared_peak


# --- exactness ------------------------------------------------------------------------------------------------

def make_host(model_dir, share: bool, **options) -> LocalModelHost:
    return LocalModelHost("tiny", str(model_dir), "cpu", torch.float32, 1024,
                          TrainOptions(prefix_share_min_tokens=16 if share else 0, **options))


def make_adapter(host: LocalModelHost):
    if host.peft is not None and "run" in host.peft.peft_config:
        host.peft.delete_adapter("run")  # one a test that stopped midway left behind (parameter names must match)
    adapter = host.create_adapter("run", LoraSpec(rank=4, seed=3, train_unembed=True))
    generator = torch.Generator().manual_seed(0)
    for p in adapter.params.values():  # non-zero B, so every LoRA weight gets a gradient
        p.data.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return adapter


def grpo_batch(loss_fn: str, seed: int = 0, group_sizes=(4, 3), prompt_len: int = 30) -> list[dict]:
    """Groups of completions of one prompt each, plus one unrelated datum; prompt positions weighted too."""
    rng = np.random.default_rng(seed)
    sequences = []
    for size in group_sizes:
        prompt = rng.integers(3, 500, prompt_len)
        sequences += [np.concatenate([prompt, rng.integers(3, 500, int(rng.integers(1, 12)))]) for _ in range(size)]
    sequences.append(rng.integers(3, 500, 25))
    data = []
    for seq in sequences:
        n = len(seq) - 1
        datum = {"tokens": seq[:-1].astype(np.int64), "target_tokens": seq[1:].astype(np.int64)}
        datum["target_tokens"][rng.random(n) < 0.1] = -100
        if loss_fn == "cross_entropy":
            datum["weights"] = rng.uniform(0.2, 1.0, n).astype(np.float32)
        else:
            datum["logprobs"] = rng.uniform(-7, -5, n).astype(np.float32)
            datum["advantages"] = rng.normal(0, 1, n).astype(np.float32)
        if loss_fn == "gspo":
            datum["sequence_ratio_mask"] = (rng.random(n) < 0.7).astype(np.float32)
        if loss_fn == "stable_reinforce":
            datum["recorded_mask"] = (rng.random(n) < 0.7).astype(np.float32)
            datum["recorded_logprobs"] = rng.uniform(-7, -5, n).astype(np.float32) * datum["recorded_mask"]
        data.append(datum)
    return data


def soft_batch(seed: int = 0, k: int = 4, hard_every: int = 3) -> list[dict]:
    """grpo_batch's sequences with K soft targets per position (top-K distillation); every ``hard_every``-th
    datum keeps 1-D targets, so a call mixes both."""
    rng = np.random.default_rng(seed)
    data = grpo_batch("cross_entropy", seed=seed)
    for i, datum in enumerate(data):
        if i % hard_every == hard_every - 1:
            continue
        n = len(datum["tokens"])
        targets = np.concatenate([datum["target_tokens"][:, None], rng.integers(3, 500, (n, k - 1))], axis=1)
        targets[rng.random((n, k)) < 0.1] = -100
        datum["target_tokens"] = targets.astype(np.int64)
        datum["weights"] = rng.uniform(0.0, 1.0, (n, k)).astype(np.float32)
    return data


CONFIGS = {"cross_entropy": {}, "importance_sampling": {}, "dro": {"beta": 0.05},
           "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
           "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
           "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
           "stable_reinforce": {"kl_coeff": 0.05}}


def train_step(host: LocalModelHost, data, loss_fn: str, backward: bool = True):
    adapter = make_adapter(host)
    out = host.forward_backward(adapter, data, loss_fn, CONFIGS[loss_fn], backward=backward)
    grads = {n: p.grad.clone() for n, p in adapter.params.items() if p.grad is not None}
    step = host.optim_step(adapter, AdamParams(learning_rate=1e-2)) if backward else None
    weights = {n: p.detach().clone() for n, p in adapter.params.items()}
    host.drop_adapter(adapter.adapter_id)
    return out, grads, step, weights


def assert_same(shared, plain, backward: bool = True):
    (out_s, grads_s, step_s, w_s), (out_p, grads_p, step_p, w_p) = shared, plain
    for a, b in zip(out_s["outputs"], out_p["outputs"]):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=TOL, rtol=TOL)
        np.testing.assert_allclose(a["elementwise_loss"], b["elementwise_loss"], atol=TOL, rtol=TOL)
    assert out_s["metrics"]["loss:sum"] == pytest.approx(out_p["metrics"]["loss:sum"], rel=TOL, abs=TOL)
    assert out_s["metrics"]["token_count"] == out_p["metrics"]["token_count"]
    if not backward:
        assert not grads_s and not grads_p
        return
    assert set(grads_s) == set(grads_p) and grads_p
    for name in grads_p:
        scale = float(grads_p[name].abs().max())
        assert float((grads_s[name] - grads_p[name]).abs().max()) <= TOL * max(scale, 1.0), name
    assert step_s["grad_norm"] == pytest.approx(step_p["grad_norm"], rel=TOL)
    assert max(float((w_s[n] - w_p[n]).abs().max()) for n in w_p) <= TOL


class Spy:
    """Counts shared prefixes and remainder passes (wraps the real methods; results unchanged)."""

    def __init__(self, monkeypatch):
        self.prefixes, self.chunks = [], []
        init, remainder = prefix_sharing.SharedPrefix.__init__, prefix_sharing.SharedPrefix.remainder_logits
        spy = self

        def counting_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            spy.prefixes.append((self.logits.shape[0], self.prefix_len))  # (prompts, length) of each prefix pass

        def counting_remainder(self, ids, attention, which):
            spy.chunks.append(tuple(ids.shape))
            return remainder(self, ids, attention, which)
        monkeypatch.setattr(prefix_sharing.SharedPrefix, "__init__", counting_init)
        monkeypatch.setattr(prefix_sharing.SharedPrefix, "remainder_logits", counting_remainder)


@pytest.fixture(scope="module")
def hosts(tiny_model_dir):
    return make_host(tiny_model_dir, share=True), make_host(tiny_model_dir, share=False)


@pytest.mark.parametrize("loss_fn", LOSS_FUNCTIONS)
def test_every_loss_matches_the_unshared_path(hosts, loss_fn, monkeypatch):
    shared_host, plain_host = hosts
    assert shared_host.prefix_sharing and not plain_host.prefix_sharing
    spy = Spy(monkeypatch)
    data = grpo_batch(loss_fn)
    shared = train_step(shared_host, data, loss_fn)
    # both prompts ran once, in one pass (29 where a datum's tokens are the prompt alone: one token must follow)
    assert len(spy.prefixes) == 1 and spy.prefixes[0] in ((2, 29), (2, 30))
    assert_same(shared, train_step(plain_host, data, loss_fn))
    assert len(spy.prefixes) == 1  # the plain host never shares


def test_soft_targets_match_the_unshared_path(hosts, monkeypatch):
    spy = Spy(monkeypatch)
    data = soft_batch()
    shared = train_step(hosts[0], data, "cross_entropy")
    assert len(spy.prefixes) == 1
    assert_same(shared, train_step(hosts[1], data, "cross_entropy"))
    for datum, out in zip(data, shared[0]["outputs"]):
        assert out["logprobs"].shape == datum["target_tokens"].shape  # [N, K] or [N]
        assert out["elementwise_loss"].shape == (len(datum["tokens"]),)


def test_soft_target_logprobs_and_loss_match_an_independent_computation(hosts):
    """Every cell's logprob from each datum alone through the PEFT model in float64; the loss -sum w * lp."""
    host = hosts[0]
    data = soft_batch(seed=5, k=3)
    adapter = make_adapter(host)
    out = host.forward_backward(adapter, data, "cross_entropy", {}, backward=False)
    total = 0.0
    with torch.no_grad():
        for datum, result in zip(data, out["outputs"]):
            logits = host.peft(input_ids=torch.from_numpy(datum["tokens"])[None]).logits[0].double()
            targets = datum["target_tokens"].reshape(len(datum["tokens"]), -1)
            expected = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(np.where(targets < 0, 0, targets)))
            expected = np.where(targets < 0, 0.0, expected.numpy()).reshape(datum["target_tokens"].shape)
            np.testing.assert_allclose(result["logprobs"], expected, atol=TOL)
            weights = datum["weights"].reshape(expected.shape)
            total += float(-(np.where(datum["target_tokens"] < 0, 0.0, weights) * expected).sum())
    assert out["metrics"]["loss:sum"] == pytest.approx(total, rel=TOL, abs=TOL)
    host.drop_adapter(adapter.adapter_id)


def test_forward_without_backward_matches(hosts, monkeypatch):
    spy = Spy(monkeypatch)
    data = grpo_batch("importance_sampling", seed=2)
    shared = train_step(hosts[0], data, "importance_sampling", backward=False)
    assert len(spy.prefixes) == 1
    assert_same(shared, train_step(hosts[1], data, "importance_sampling", backward=False), backward=False)


def test_logprobs_match_an_independent_forward_pass(hosts):
    """Each datum alone through the PEFT model (batch 1, no padding, no cache), log_softmax in float64."""
    host = hosts[0]
    data = grpo_batch("cross_entropy", seed=3)
    adapter = make_adapter(host)
    out = host.forward_backward(adapter, data, "cross_entropy", {}, backward=False)
    with torch.no_grad():
        for datum, result in zip(data, out["outputs"]):
            logits = host.peft(input_ids=torch.from_numpy(datum["tokens"])[None]).logits[0].double()
            targets = torch.from_numpy(np.where(datum["target_tokens"] < 0, 0, datum["target_tokens"]))
            expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy()
            expected[datum["target_tokens"] < 0] = 0
            np.testing.assert_allclose(result["logprobs"], expected, atol=TOL)


def test_micro_batches_split_groups(tiny_model_dir, hosts, monkeypatch):
    """A budget of 70 tokens: two 30-token prompts run in one pass and leave ~10 tokens per chunk, so each
    group runs in several chunks against its prefix, and the group of 6 is larger than any one micro-batch."""
    host = make_host(tiny_model_dir, share=True, micro_batch_tokens=70)
    spy = Spy(monkeypatch)  # after the load-time probe
    data = grpo_batch("ppo", seed=4, group_sizes=(6, 2))
    shared = train_step(host, data, "ppo")
    assert len(spy.prefixes) == 1 and spy.prefixes[0][0] == 2
    prompts, length = spy.prefixes[0]
    assert len(spy.chunks) >= 4 and all(rows * rest <= 70 - prompts * length or rows == 1 for rows, rest in spy.chunks)
    assert_same(shared, train_step(hosts[1], data, "ppo"))


def test_activation_checkpointing_matches(tiny_model_dir, hosts, monkeypatch):
    host = make_host(tiny_model_dir, share=True, activation_checkpointing=True)
    assert host.prefix_sharing
    spy = Spy(monkeypatch)
    data = grpo_batch("cispo", seed=5)
    shared = train_step(host, data, "cispo")
    assert len(spy.prefixes) == 1
    assert_same(shared, train_step(hosts[1], data, "cispo"))


def test_bf16_autocast_still_shares(tiny_model_dir, monkeypatch):
    """Under bf16 autocast the probe accepts bf16's rounding; the results stay as close as bf16 allows."""
    host = make_host(tiny_model_dir, share=True, autocast_bf16=True)
    assert host.prefix_sharing
    spy = Spy(monkeypatch)
    data = grpo_batch("importance_sampling", seed=7)
    shared, _, _, _ = train_step(host, data, "importance_sampling")
    plain, _, _, _ = train_step(make_host(tiny_model_dir, share=False, autocast_bf16=True), data,
                                "importance_sampling")
    assert len(spy.prefixes) == 1
    assert shared["metrics"]["loss:sum"] == pytest.approx(plain["metrics"]["loss:sum"], rel=2e-2, abs=2e-2)


def test_prefix_graph_is_freed_when_the_call_returns(hosts, monkeypatch):
    """No reference cycle keeps the prefix pass's tensors (and its autograd graph) alive after a call."""
    import gc
    import weakref

    refs = []
    init = prefix_sharing.SharedPrefix.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        refs.extend(weakref.ref(t) for t in (self.logits, *self._roots))
    monkeypatch.setattr(prefix_sharing.SharedPrefix, "__init__", tracking_init)
    gc.disable()
    try:
        train_step(hosts[0], grpo_batch("cross_entropy", seed=8), "cross_entropy")
        assert refs and all(r() is None for r in refs)
    finally:
        gc.enable()


def test_sharing_off_when_disabled(tiny_model_dir, monkeypatch):
    spy = Spy(monkeypatch)
    host = make_host(tiny_model_dir, share=False)  # no probe either
    train_step(host, grpo_batch("cross_entropy"), "cross_entropy")
    assert not host.prefix_sharing and spy.prefixes == []


# --- model families ----------------------------------------------------------------------------------------------

# Which path each family takes: every cache kind the worker serves can share (full attention, sliding window
# shorter than the prompt, linear attention + conv states, short conv, experts).
SHARES = {"qwen2": True, "llama": True, "mistral": True, "qwen3": True, "gemma3": True, "qwen3_moe": True,
          "qwen3_5": True, "lfm2": True}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_each_family_takes_its_path_and_matches(family, tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / family, arch=family, seed=1)
    shared_host = make_host(model_dir, share=True)
    assert shared_host.prefix_sharing is SHARES[family]
    spy = Spy(monkeypatch)  # after the load-time probe
    data = grpo_batch("importance_sampling", seed=6)
    shared = train_step(shared_host, data, "importance_sampling")
    assert len(spy.prefixes) == (1 if SHARES[family] else 0)
    assert_same(shared, train_step(make_host(model_dir, share=False), data, "importance_sampling"))


def test_probe_rejects_a_path_that_is_not_exact(tiny_model_dir, monkeypatch, caplog):
    """A shared path whose remainder positions are one too far must be caught at load and not taken."""
    def shifted(self, ids, attention, which):
        rows, length = ids.shape
        cache = prefix_cache.replay_cache(self._config, self._states, self.prefix_len, which)
        mask = torch.cat([attention.new_ones((rows, self.prefix_len)), attention], dim=1)
        positions = (torch.arange(length) + self.prefix_len + 1).expand(rows, length)
        return self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kwarg: cache})
    monkeypatch.setattr(prefix_sharing.SharedPrefix, "remainder_logits", shifted)
    with caplog.at_level("WARNING", logger="server_mock"):
        assert make_host(tiny_model_dir, share=True).prefix_sharing is False
    assert "results differ from the unshared path" in caplog.text
