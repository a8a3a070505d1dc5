"""One GRPO step through the worker against a from-scratch PyTorch GRPO step written here.

The oracle: a full forward of every sequence (prompt + completion, batch 1, no cache) through the tiny model with
and without its LoRA adapter, advantages normalised by the group's std, PPO's clipped surrogate, the k1/k2/k3 KL
to the model without the adapter, verl's loss aggregations on a padded [B, T] matrix, ``loss.backward()``. The
worker: one ``forward_backward`` with ``kl_coef`` / ``kl_estimator`` and the per-token weights the recipe sends
for each aggregation (recipes/grpo_variants.py), on a host that shares prompt prefixes and on one that does not.
Loss and LoRA gradients must agree to 1e-5 (float32). TRL's GRPOTrainer loss is a second oracle where installed.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from pytrio_compat.wire import LoraSpec
from recipes.grpo_variants import LOSS_AGGS, aggregation_weights
from server_mock.config import TrainOptions
from server_mock.engine.local_host import LocalModelHost
from server_mock.training import forward_backward as fb
from server_mock.training.losses import resolve_loss_config

TOL = 1e-5
PROMPT_LEN = 30
MAX_TOKENS = 16  # L of seq-mean-token-sum-norm
LO, HI = 0.8, 1.28  # DAPO's clip-higher


def make_host(model_dir, share: bool) -> LocalModelHost:
    return LocalModelHost("tiny", str(model_dir), "cpu", torch.float32, 1024,
                          TrainOptions(prefix_share_min_tokens=16 if share else 0))


@pytest.fixture(scope="module")
def hosts(tiny_model_dir):
    return {"shared": make_host(tiny_model_dir, True), "plain": make_host(tiny_model_dir, False)}


def make_adapter(host: LocalModelHost, name: str = "run", unembed: bool = True):
    if host.peft is not None and name in host.peft.peft_config:
        host.peft.delete_adapter(name)
    adapter = host.create_adapter(name, LoraSpec(rank=4, seed=3, train_unembed=unembed))
    generator = torch.Generator().manual_seed(0)
    for p in adapter.params.values():  # non-zero B: the policy differs from the reference, every weight trains
        p.data.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return adapter


def std_advantages(rewards: list[float]) -> list[float]:
    """The textbook GRPO advantage: (r - mean) / (std + eps), the group's sample std."""
    mean = statistics.fmean(rewards)
    return [(r - mean) / (statistics.stdev(rewards) + 1e-6) for r in rewards]


def rollouts(seed: int = 0, groups: int = 2, size: int = 4):
    """(prompt, completion) token arrays and rewards: groups of completions of one 30-token prompt each."""
    rng = np.random.default_rng(seed)
    seqs, rewards = [], []
    for _ in range(groups):
        prompt = rng.integers(3, 500, PROMPT_LEN)
        group = [float(x) for x in rng.integers(0, 2, size)]
        group[0], group[1] = 1.0, 0.0  # rewards differ
        rewards += group
        seqs += [(prompt, rng.integers(3, 500, int(rng.integers(2, MAX_TOKENS + 1)))) for _ in range(size)]
    advantages = [a for g in range(groups) for a in std_advantages(rewards[g * size:(g + 1) * size])]
    return seqs, advantages


def completion_logprobs(model, prompt: np.ndarray, completion: np.ndarray) -> torch.Tensor:
    """log p(completion token t | everything before it), from one full forward pass of prompt + completion."""
    ids = torch.from_numpy(np.concatenate([prompt, completion]))[None]
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp[positions, torch.from_numpy(completion)]


def kl_k(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return (lp - ref) ** 2 / 2
    return torch.exp(ref - lp) - (ref - lp) - 1


def aggregate(matrix: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's loss_agg_mode on a padded [B, T] matrix (seq-mean-token-sum-norm: mean over sequences of the
    token sums over a constant L, Dr. GRPO's normaliser, as TRL's dr_grpo divides by B * L)."""
    masked = matrix * mask
    if mode == "token-sum":
        return masked.sum()
    if mode == "token-mean":
        return masked.sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1)).mean()
    assert mode == "seq-mean-token-sum-norm"
    return masked.sum() / (matrix.shape[0] * MAX_TOKENS)


def sampler_logprobs(host, adapter, seqs, seed: int) -> list[np.ndarray]:
    """The "sampler's" logprobs: the policy's own, moved by noise so the ratio leaves the clip range often."""
    host._activate(adapter)
    rng = np.random.default_rng(seed + 100)
    with torch.no_grad():
        return [(completion_logprobs(host.peft, p, c).numpy() + rng.normal(0, 0.3, len(c))).astype(np.float32)
                for p, c in seqs]


def oracle_step(host, adapter, seqs, advantages, q, mode: str, beta: float, estimator: str):
    """The textbook GRPO loss of the batch and its LoRA gradients, from scratch."""
    host._activate(adapter)
    for p in adapter.params.values():
        p.grad = None
    with torch.no_grad(), host.peft.disable_adapter():
        ref = [completion_logprobs(host.peft, p, c) for p, c in seqs]
    lp = [completion_logprobs(host.peft, p, c) for p, c in seqs]
    longest = max(len(c) for _, c in seqs)
    matrix = torch.zeros(len(seqs), longest)
    mask = torch.zeros(len(seqs), longest)
    kl_sum = 0.0
    rows = []
    for i, (lp_i, ref_i) in enumerate(zip(lp, ref)):
        n = len(lp_i)
        ratio = torch.exp(lp_i - torch.from_numpy(q[i]))
        a = advantages[i]
        surrogate = -torch.minimum(ratio * a, torch.clamp(ratio, LO, HI) * a)
        kl = kl_k(lp_i, ref_i, estimator)
        kl_sum += float(kl.detach().sum())
        rows.append(torch.nn.functional.pad(surrogate + beta * kl, (0, longest - n)))
        mask[i, :n] = 1
    matrix = torch.stack(rows)
    loss = aggregate(matrix, mask, mode)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in adapter.params.items()}
    for p in adapter.params.values():
        p.grad = None
    return float(loss.detach()), grads, kl_sum, [r.numpy() for r in ref]


def worker_datums(seqs, advantages, q, weights):
    """Datums as the recipe builds them: position t predicts token t+1, prompt positions with weight 0."""
    data = []
    for (prompt, completion), a, q_i, w in zip(seqs, advantages, q, weights):
        pad = len(prompt) - 1
        n = len(completion)
        data.append({
            "tokens": np.concatenate([prompt, completion[:-1]]).astype(np.int64),
            "target_tokens": np.concatenate([np.zeros(pad), completion]).astype(np.int64),
            "logprobs": np.concatenate([np.zeros(pad), q_i]).astype(np.float32),
            "advantages": np.concatenate([np.zeros(pad), np.full(n, a)]).astype(np.float32),
            "weights": np.concatenate([np.zeros(pad), np.full(n, w)]).astype(np.float32),
        })
    return data


def worker_step(host, adapter, data, config, loss_fn="ppo", backward=True):
    for p in adapter.params.values():
        p.grad = None
    out = host.forward_backward(adapter, data, loss_fn, resolve_loss_config(loss_fn, config), backward)
    grads = {n: p.grad.clone() for n, p in adapter.params.items() if p.grad is not None}
    for p in adapter.params.values():
        p.grad = None
    return out, grads


def assert_grads_close(got: dict, want: dict) -> None:
    assert set(got) == set(want) and want
    for name in want:
        scale = max(float(want[name].abs().max()), 1.0)
        assert float((got[name] - want[name]).abs().max()) <= TOL * scale, name


# every aggregation x every estimator with shared prompts; every aggregation (k3) on the unshared path
CASES = [("shared", mode, estimator) for mode in LOSS_AGGS for estimator in ("k1", "k2", "k3")] + \
    [("plain", mode, "k3") for mode in LOSS_AGGS]


@pytest.mark.parametrize("path, mode, estimator", CASES)
def test_worker_step_equals_the_textbook_step(hosts, path, mode, estimator, monkeypatch):
    host = hosts[path]
    adapter = make_adapter(host)
    seqs, advantages = rollouts(seed=LOSS_AGGS.index(mode))
    q = sampler_logprobs(host, adapter, seqs, seed=LOSS_AGGS.index(mode))
    beta = 0.3  # large, so a wrong KL term would show in the gradient
    want_loss, want_grads, want_kl, want_ref = oracle_step(host, adapter, seqs, advantages, q, mode, beta, estimator)

    prefix_passes, prefix_runs = [], []
    monkeypatch.setattr(fb.prefix_sharing.SharedPrefix, "backward",
                        _counting(fb.prefix_sharing.SharedPrefix.backward, prefix_passes))
    monkeypatch.setattr(fb.prefix_sharing.SharedPrefix, "__init__",
                        _counting(fb.prefix_sharing.SharedPrefix.__init__, prefix_runs))
    weights = aggregation_weights(mode, [len(c) for _, c in seqs], MAX_TOKENS) or [1.0] * len(seqs)
    config = {"clip_low_threshold": LO, "clip_high_threshold": HI, "kl_coef": beta, "kl_estimator": estimator}
    out, grads = worker_step(host, adapter, worker_datums(seqs, advantages, q, weights), config)
    # the two prompts run once in the reference pass and once in the training pass (one backward)
    assert (len(prefix_runs), len(prefix_passes)) == ((2, 1) if path == "shared" else (0, 0))

    metrics = out["metrics"]
    assert metrics["loss_sum"] == pytest.approx(want_loss, rel=TOL, abs=TOL)
    assert_grads_close(grads, want_grads)
    n_tokens = sum(len(c) for _, c in seqs)
    assert metrics["token_count"] == n_tokens
    assert metrics["kl_sum"] == pytest.approx(want_kl, rel=TOL, abs=TOL)
    assert metrics["kl_mean"] == pytest.approx(want_kl / n_tokens, rel=TOL, abs=TOL)
    assert metrics["kl:sum"] == metrics["kl_sum"] and metrics["kl:mean"] == metrics["kl_mean"]
    for output, ref in zip(out["outputs"], want_ref):
        np.testing.assert_allclose(output["ref_logprobs"][PROMPT_LEN - 1:], ref, atol=TOL)
    host.drop_adapter(adapter.adapter_id)


def _counting(method, calls):
    def wrapped(self, *args, **kwargs):
        calls.append(1)
        return method(self, *args, **kwargs)
    return wrapped


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "cispo"])
def test_kl_term_on_the_other_policy_losses(hosts, loss_fn):
    """importance_sampling and cispo take the same KL term and weights (token-mean, k3, beta 0.1)."""
    host = hosts["shared"]
    adapter = make_adapter(host)
    seqs, advantages = rollouts(seed=7)
    q = sampler_logprobs(host, adapter, seqs, seed=7)
    n_tokens = sum(len(c) for _, c in seqs)
    host._activate(adapter)
    with torch.no_grad(), host.peft.disable_adapter():
        ref = [completion_logprobs(host.peft, p, c) for p, c in seqs]
    total = 0.0
    for (p, c), a, q_i, r_i in zip(seqs, advantages, q, ref):
        lp = completion_logprobs(host.peft, p, c)
        ratio = torch.exp(lp - torch.from_numpy(q_i))
        surrogate = -ratio * a if loss_fn == "importance_sampling" else \
            -torch.clamp(ratio, 0.0, 4.0).detach() * lp * a
        total = total + (surrogate + 0.1 * kl_k(lp, r_i, "k3")).sum() / n_tokens
    total.backward()
    want = {n: p.grad.clone() for n, p in adapter.params.items()}
    out, grads = worker_step(host, adapter, worker_datums(seqs, advantages, q, [1 / n_tokens] * len(seqs)),
                             {"kl_coef": 0.1}, loss_fn=loss_fn)
    assert out["metrics"]["loss_sum"] == pytest.approx(float(total), rel=TOL, abs=TOL)
    assert_grads_close(grads, want)
    host.drop_adapter(adapter.adapter_id)


def test_entropy_matches_a_direct_computation(hosts):
    """return_entropy: -sum p log p of every position's full distribution, shared prompts and plain datums alike,
    in float64 from a full forward pass here; its mean is over the counted positions."""
    for path in ("shared", "plain"):
        host = hosts[path]
        adapter = make_adapter(host)
        seqs, advantages = rollouts(seed=11)
        q = [np.zeros(len(c), dtype=np.float32) for _, c in seqs]
        data = worker_datums(seqs, advantages, q, [1.0] * len(seqs))
        data[0]["target_tokens"][3] = -100  # an ignored position: entropy 0 there, as for the logprobs
        out, _ = worker_step(host, adapter, data, {"return_entropy": True}, loss_fn="importance_sampling",
                             backward=False)
        host._activate(adapter)
        counted_sum = 0.0
        with torch.no_grad():
            for datum, output in zip(data, out["outputs"]):
                logits = host.peft(input_ids=torch.from_numpy(datum["tokens"])[None]).logits[0].double()
                logp = torch.log_softmax(logits, -1)
                want = -(logp.exp() * logp).sum(-1).numpy()
                want[datum["target_tokens"] == -100] = 0
                np.testing.assert_allclose(output["entropy"], want, atol=TOL, rtol=TOL)
                counted = (datum["target_tokens"] != -100) & (datum["advantages"] != 0) & (datum["weights"] != 0)
                counted_sum += float(want[counted].sum())
        metrics = out["metrics"]
        assert metrics["entropy_sum"] == pytest.approx(counted_sum, rel=TOL)
        assert metrics["entropy_mean"] == pytest.approx(counted_sum / metrics["token_count"], rel=TOL)
        assert "ref_logprobs" not in out["outputs"][0] and "kl_sum" not in metrics
        host.drop_adapter(adapter.adapter_id)


def test_entropy_blocks_hold_no_second_full_tensor():
    """The entropy of a [B, T, V] tensor equals the one-shot formula whatever the block size (blocks of 256
    positions, with a block boundary inside a row here)."""
    from server_mock.training import policy_terms

    logits = torch.randn(3, 300, 50, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits.double(), -1)
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(policy_terms.entropy(logits).double(), want, atol=1e-6, rtol=1e-6)
    rows = torch.tensor([2, 0, 2])
    torch.testing.assert_close(policy_terms.entropy(logits, rows).double(), want[rows], atol=1e-6, rtol=1e-6)
    masked = logits.clone()
    masked[0, 0, :10] = float("-inf")  # a distribution with zero-probability tokens stays finite
    assert torch.isfinite(policy_terms.entropy(masked)).all()


# --- without beta nothing changes -----------------------------------------------------------------------------

def _grpo_data(seed: int = 5, weights: bool = False):
    seqs, advantages = rollouts(seed=seed)
    rng = np.random.default_rng(seed)
    q = [rng.uniform(-7, -5, len(c)).astype(np.float32) for _, c in seqs]
    data = worker_datums(seqs, advantages, q, [1.0] * len(seqs))
    if not weights:
        for d in data:
            del d["weights"]
    return data


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_without_kl_keys_no_reference_pass_and_the_same_bits(hosts, loss_fn, monkeypatch):
    host = hosts["shared"]
    reference_calls = []
    original = fb._reference_logprobs
    monkeypatch.setattr(fb, "_reference_logprobs", lambda *a: reference_calls.append(1) or original(*a))

    def run(data, extra):
        adapter = make_adapter(host)
        out, grads = worker_step(host, adapter, data, extra, loss_fn=loss_fn)
        host.drop_adapter(adapter.adapter_id)
        return out, grads

    plain, plain_grads = run(_grpo_data(), {})
    assert reference_calls == []
    assert set(plain["outputs"][0]) == {"logprobs", "elementwise_loss"}
    assert set(plain["metrics"]) == {"loss_sum", "loss_mean", "token_count", "loss:sum"}
    # beta = 0 given: the reference pass runs and the KL is reported, the loss and its gradient keep every bit
    measured, measured_grads = run(_grpo_data(), {"kl_coef": 0.0})
    assert reference_calls == [1]
    # weights of 1 on every token: the same bits too
    weighted, weighted_grads = run(_grpo_data(weights=True), {})
    for other, other_grads in ((measured, measured_grads), (weighted, weighted_grads)):
        assert other["metrics"]["loss_sum"] == plain["metrics"]["loss_sum"]
        for a, b in zip(other["outputs"], plain["outputs"]):
            assert np.array_equal(a["logprobs"], b["logprobs"])
            assert np.array_equal(a["elementwise_loss"], b["elementwise_loss"])
        assert set(other_grads) == set(plain_grads)
        assert all(torch.equal(other_grads[n], plain_grads[n]) for n in plain_grads)
    assert measured["metrics"]["kl_sum"] > 0  # the adapter moved the policy off the reference


def test_zero_weight_tokens_train_nothing(hosts):
    """A weight of 0 removes a token from the surrogate and the KL term alike (here: a whole datum)."""
    host = hosts["plain"]
    data = _grpo_data(seed=9, weights=True)
    adapter = make_adapter(host)
    full, _ = worker_step(host, adapter, data, {"kl_coef": 0.5})
    data[2]["weights"][:] = 0
    cut, cut_grads = worker_step(host, adapter, data, {"kl_coef": 0.5})
    _, without_grads = worker_step(host, adapter, data[:2] + data[3:], {"kl_coef": 0.5})
    n2 = int((data[2]["target_tokens"] != -100).sum()) - (PROMPT_LEN - 1)
    assert cut["metrics"]["token_count"] == full["metrics"]["token_count"] - n2
    assert np.all(cut["outputs"][2]["elementwise_loss"] == 0)
    assert_grads_close(cut_grads, without_grads)
    host.drop_adapter(adapter.adapter_id)


# --- TRL's GRPOTrainer as a second oracle -----------------------------------------------------------------------

TRL_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                  "dr_grpo": "seq-mean-token-sum-norm"}


@pytest.fixture(scope="module")
def trl_trainers(tiny_model_dir, tmp_path_factory, hosts):
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl): its oracle is skipped")
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainers = {}
    for loss_type in TRL_LOSS_TYPES:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        # TRL refuses a LoRA on lm_head (it reads lm_head.weight directly): attention and MLP only here
        config, _ = hosts["plain"]._lora_config(LoraSpec(rank=4, seed=3, train_unembed=False))
        peft = get_peft_model(model, config)  # TRL wants PEFT's "default" adapter
        args = trl.GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False,
                              loss_type=loss_type, beta=0.2, epsilon=1 - LO, epsilon_high=HI - 1,
                              max_completion_length=MAX_TOKENS, num_generations=4, per_device_train_batch_size=8,
                              gradient_checkpointing=False, report_to=[], temperature=1.0,
                              use_bias_correction_kl=False)  # TRL 1.16's default multiplies the KL by the ratio
        trainer = trl.GRPOTrainer(model=peft, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                  args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * 8),
                                  processing_class=tokenizer)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop; one micro-batch here
        trainers[loss_type] = trainer
    return trainers


@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
def test_worker_step_equals_trl_grpo_trainer(hosts, trl_trainers, loss_type):
    trainer = trl_trainers[loss_type]
    host = hosts["shared"]
    adapter = make_adapter(host, unembed=False)
    trl_params = dict(trainer.model.named_parameters())
    with torch.no_grad():  # the same LoRA weights in TRL's copy of the model
        for name, param in adapter.params.items():
            trl_params[name.replace(".run.", ".default.")].copy_(param)
    seqs, advantages = rollouts(seed=21)
    q = sampler_logprobs(host, adapter, seqs, seed=21)
    with torch.no_grad(), host.peft.disable_adapter():
        ref = [completion_logprobs(host.peft, p, c).numpy() for p, c in seqs]
    longest = max(len(c) for _, c in seqs)

    def padded(rows, value=0.0, dtype=torch.float32):
        out = torch.full((len(rows), longest), value, dtype=dtype)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
        return out

    completion_mask = padded([np.ones(len(c)) for _, c in seqs], dtype=torch.long)
    inputs = {"prompt_ids": torch.from_numpy(np.stack([p for p, _ in seqs])),
              "prompt_mask": torch.ones(len(seqs), PROMPT_LEN, dtype=torch.long),
              "completion_ids": padded([c for _, c in seqs], 3, torch.long), "completion_mask": completion_mask,
              "advantages": torch.tensor(advantages, dtype=torch.float32), "old_per_token_logps": padded(q),
              "ref_per_token_logps": padded(ref), "num_items_in_batch": completion_mask.sum().float()}
    trainer.model.train()
    for p in trainer.model.parameters():
        p.grad = None
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = {n: trl_params[n.replace(".run.", ".default.")].grad for n in adapter.params}

    weights = aggregation_weights(TRL_LOSS_TYPES[loss_type], [len(c) for _, c in seqs], MAX_TOKENS)
    config = {"clip_low_threshold": LO, "clip_high_threshold": HI, "kl_coef": 0.2}
    out, grads = worker_step(host, adapter, worker_datums(seqs, advantages, q, weights), config)
    assert out["metrics"]["loss_sum"] == pytest.approx(float(trl_loss), rel=TOL, abs=TOL)
    assert_grads_close(grads, trl_grads)
    host.drop_adapter(adapter.adapter_id)
