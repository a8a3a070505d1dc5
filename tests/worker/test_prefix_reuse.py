"""A shared prompt prefix's KV cache reused across sample requests (sampling/prefix_store.py, ``DecodeBatch``):
with reuse, greedy tokens equal those without it and logprobs agree within 1e-4 in float32 (and with an independent
teacher-forced pass), for prompts that share a prefix, that do not, that join a running batch, of mixed adapters;
the byte budget at its bound and one past it; an entry never serves rows of other weights; the load-time probe
turns reuse off where a cache is not full attention only; a bad ``--prefix-cache-bytes`` is refused."""

from __future__ import annotations

import gc
import re

import numpy as np
import pytest
import torch

from pytrio_compat.wire import LoraSpec
from server_mock.cli import build_parser
from server_mock.config import TrainOptions
from server_mock.engine.local_host import LocalModelHost
from server_mock.engine.sampling_session import SamplingSession
from server_mock.engine.support import probe_sampling
from server_mock.engine.tiny_model import build_tiny_model
from server_mock.flags import from_args
from server_mock.sampling import cache_rows
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.sampling.generate import SampleSpec, generate_batch, result_of, teacher_forced_logprobs
from server_mock.sampling.prefix_store import PrefixStore, cache_bytes

TOL = 1e-4
SHARED = list(range(20, 70))  # 50 tokens: a 48-token prefix (3 blocks of 16) once two prompts have been seen
REUSING = ("qwen2", "llama", "qwen3", "qwen3_moe")


def _spec(i: int, prefix=SHARED, n: int = 2, temperature: float = 0.0, max_tokens: int = 8) -> SampleSpec:
    return SampleSpec(prompt_tokens=list(prefix) + [100 + 7 * i + j for j in range(1 + i % 4)], num_samples=n,
                      max_tokens=max_tokens, temperature=temperature, seed=i, stop_token_ids=[])


def _steps(n: int):
    count = [0]

    def stop() -> bool:
        count[0] += 1
        return count[0] >= n
    return stop


def _decode(model, tok, support, waves, store=None, tag=""):
    """Admit each wave of requests after two decode steps of the ones before (so later waves join a running
    batch); every request's result, in order."""
    batch = DecodeBatch(model, tok, support, prefix_store=store)
    handles = []
    for wave in waves:
        handles += batch.admit(wave, tag=tag)
        batch.run(_steps(2))
    batch.run()
    done = {f.handle: result_of(f) for f in batch.take_finished()}
    return [done[h] for h in handles]


def _check(got, want, model=None, specs=None):
    for i, (a, b) in enumerate(zip(got, want)):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences], i
        for x, y in zip(a.sequences, b.sequences):
            assert np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs)).max(initial=0) <= TOL, i
        if model is not None:
            spec = specs[i]
            for seq in a.sequences:
                ref = teacher_forced_logprobs(model, spec.prompt_tokens + seq.tokens)[len(spec.prompt_tokens) - 1:]
                assert np.abs(np.asarray(ref) - np.asarray(seq.logprobs)).max(initial=0) <= TOL, i


# --- the numbers: the same tokens and logprobs as without reuse ------------------------------------------------


@pytest.mark.parametrize("family", REUSING)
def test_shared_unshared_and_joining_prompts_get_the_tokens_they_get_without_reuse(tok, family):
    model = build_tiny_model(len(tok), arch=family, seed=3)
    support = probe_sampling(model, len(tok))
    assert support.prefix_reuse
    other = list(range(200, 240))
    waves = [
        [_spec(0), _spec(1)],  # arrive together: their common prefix is prefilled once and stored
        [_spec(2, temperature=0.8), _spec(3, prefix=other)],  # join a running batch: a stored prefix, and none
        [_spec(4), _spec(5, prefix=other), _spec(6, n=3)],  # the second "other" prompt shares its prefix with the first
        [SampleSpec(prompt_tokens=SHARED[:30], num_samples=1, max_tokens=5, temperature=0)],  # too short to share
    ]
    specs = [s for wave in waves for s in wave]
    want = _decode(model, tok, support, waves)
    store = PrefixStore(1 << 30)
    got = _decode(model, tok, support, waves, store)
    _check(got, want, model, specs)
    stats = store.stats
    assert len(store) == 2 and stats.stored == 2  # SHARED's 48 tokens, "other"'s 32
    assert sorted(len(e.tokens) for e in store.entries()) == [32, 48]
    # 0 and 1 arrive together (one prefill of the prefix for both: 48 tokens saved), 2, 4 and 6 find it stored;
    # 3 has no prompt to share with and is prefilled whole, 5 shares 40 tokens with it (32 stored, none saved yet)
    assert stats.hits == 3 and stats.tokens_reused == 48 * 4


def test_a_model_whose_cache_is_not_full_attention_only_prefills_whole(tok):
    for family in ("mistral", "gemma3", "qwen3_5", "lfm2"):
        model = build_tiny_model(len(tok), arch=family, seed=0)
        support = probe_sampling(model, len(tok))
        assert not support.prefix_reuse, family
    store = PrefixStore(1 << 30)
    waves = [[_spec(0), _spec(1)], [_spec(2)]]
    got = _decode(model, tok, support, waves, store)
    _check(got, _decode(model, tok, support, waves))
    assert len(store) == 0 and store.stats.hits == store.stats.misses == 0


def test_the_probe_refuses_a_split_prefill_that_differs(tok, monkeypatch):
    """A model whose copied prefix cache gives other numbers (here: the copy is perturbed) is not offered reuse."""
    model = build_tiny_model(len(tok), arch="qwen2", seed=0)
    plain = cache_rows.repeated

    def off(cache, rows):
        out = plain(cache, rows)
        for layer in out.layers:
            layer.keys.add_(0.5)
        return out

    monkeypatch.setattr(cache_rows, "repeated", off)
    assert not probe_sampling(model, len(tok)).prefix_reuse


# --- the byte budget ----------------------------------------------------------------------------------------------


def test_the_byte_budget_keeps_entries_at_its_bound_and_evicts_one_past_it(tok):
    model = build_tiny_model(len(tok), arch="qwen2", seed=1)
    support = probe_sampling(model, len(tok))
    first, second = SHARED, list(range(300, 350))
    waves = [[_spec(0, first), _spec(1, first)], [_spec(2, second), _spec(3, second)], [_spec(4, first)]]
    want = _decode(model, tok, support, waves)
    sizing = PrefixStore(1 << 30)
    _decode(model, tok, support, waves[:1], sizing)
    size = sizing.bytes
    assert size == cache_bytes(sizing.entries()[0].cache) > 0
    # layers x (keys, values) x heads x 48 tokens x head dim x 4 bytes: the stored prefix's own bytes, no more
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert size == config.num_hidden_layers * 2 * config.num_key_value_heads * 48 * head_dim * 4

    at_bound = PrefixStore(2 * size)
    _check(_decode(model, tok, support, waves, at_bound), want)
    assert len(at_bound) == 2 and at_bound.bytes == 2 * size and at_bound.stats.evicted == 0
    assert at_bound.stats.hits == 1  # the last request found the first prefix still there

    past = PrefixStore(2 * size - 1)
    _check(_decode(model, tok, support, waves, past), want)
    assert past.stats.evicted == 2 and past.stats.hits == 0  # each prefix pushed the other out
    assert len(past) == 1 and past.bytes == size <= past.max_bytes
    assert [e.tokens for e in past.entries()] == [tuple(first[:48])]

    tiny = PrefixStore(size - 1)  # no prefix fits: each is used for the prompts it was prefilled for, not kept
    _check(_decode(model, tok, support, waves, tiny), want)
    assert len(tiny) == 0 and tiny.bytes == 0 and tiny.stats.too_large == 3


def test_the_longest_stored_prefix_is_found_and_lru_order_is_kept():
    store = PrefixStore(1 << 20)
    key = ("m", "base")
    prompt = list(range(100))
    assert store.shared_length(key, prompt) == 0
    store.remember(key, prompt[:40] + [999])
    assert store.shared_length(key, prompt) == 32  # 40 common tokens, rounded down to a block
    store.remember(key, prompt[:31] + [999])
    assert store.shared_length(key, prompt[:31] + [5]) == 0  # 31 common tokens: under the minimum
    assert store.shared_length(key, prompt[:48]) == 32  # at most one block under the prompt's own length
    fake = _OneRow()
    store.put(key, prompt[:32], fake)
    store.put(key, prompt[:64], fake)
    store.put(("m", "snapshot:x"), prompt[:80], fake)
    assert len(store.lookup(key, prompt).tokens) == 64
    assert len(store.lookup(key, prompt[:64]).tokens) == 32  # a prefix is shorter than the prompt it serves
    assert store.lookup(key, prompt[:32]) is None
    assert [len(e.tokens) for e in store.entries()] == [80, 64, 32]  # least recently used first


class _OneRow:
    """A stand-in cache of 1 KiB."""

    class _Layer:
        keys = values = torch.zeros(128)

    layers = [_Layer()]


def test_a_bad_prefix_cache_budget_is_refused_with_the_flag_named(tiny_model_dir):
    parser = build_parser()
    assert from_args(TrainOptions, parser.parse_args(["serve"])).prefix_cache_bytes == 256 * 1024 ** 2
    assert from_args(TrainOptions, parser.parse_args(["serve", "--prefix-cache-bytes", "0"])).prefix_cache_bytes == 0
    with pytest.raises(ValueError, match=re.escape("--prefix-cache-bytes must be >= 0")):
        from_args(TrainOptions, parser.parse_args(["serve", "--prefix-cache-bytes", "-1"]))
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        PrefixStore(0)
    host = LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.float32,
                          options=TrainOptions(prefix_cache_bytes=0))
    assert host.sampling_support.prefix_reuse and host.prefix_store is None
    invariant = LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.float32,
                               options=TrainOptions(batch_invariant=True))
    assert invariant.prefix_store is None  # its results must not depend on what earlier requests left


def test_entries_of_a_model_that_is_gone_are_dropped(tok):
    store = PrefixStore(1 << 30)
    model = build_tiny_model(len(tok), arch="qwen2", seed=4)
    support = probe_sampling(model, len(tok))
    _decode(model, tok, support, [[_spec(0), _spec(1)]], store)
    assert len(store) == 1 and store.bytes > 0
    del model
    gc.collect()
    assert len(store) == 0 and store.bytes == 0


# --- weights: an entry serves only rows of the weights that computed it ------------------------------------------


def _host(model_dir, **options) -> LocalModelHost:
    return LocalModelHost("tiny", str(model_dir), "cpu", torch.float32, options=TrainOptions(**options))


def _snapshots(host, count=2):
    """Trained-looking snapshots of one LoRA layout (lora_B random: a fresh LoRA's B is zero)."""
    out = []
    for i in range(count):
        adapter = host.create_adapter(f"run-{len(host.adapters)}", LoraSpec(rank=8, seed=i))
        gen = torch.Generator().manual_seed(50 + i)
        with torch.no_grad():
            for name, p in adapter.params.items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        out.append(host.snapshot(adapter))
    return out


def _drain(session, out: dict, stop=lambda: False):
    while session.active:
        for handle, result, _ in session.run(stop):
            out[handle] = result


def test_two_snapshots_on_one_sampler_slot_never_share_an_entry(tiny_model_dir):
    """Unmerged snapshots of one layout decode on the same model object (the sampler slot); only the row's tag
    tells their prefixes apart. Were the key to ignore it, the second snapshot's rows would continue the first's
    prefix cache and their logprobs would move by far more than 1e-4."""
    host = _host(tiny_model_dir, merge_lora_bytes=0)
    assert host.prefix_store is not None
    a, b = _snapshots(host)
    assert host.sampling_model(a) is host.sampling_model(b)
    specs = [_spec(i) for i in range(3)]
    results = {}
    for snapshot in (a, b, a):
        session = SamplingSession(host, snapshot)
        handles = [session.add(s) for s in specs]
        out = {}
        _drain(session, out)
        solo = [generate_batch(host.sampling_model(snapshot), [s], host.tokenizer)[0] for s in specs]
        _check([out[h] for h in handles], solo)
        results.setdefault(snapshot.snapshot_id, []).append([out[h] for h in handles])
    store = host.prefix_store
    assert sorted(e.key[1] for e in store.entries()) == sorted([f"snapshot:{a.snapshot_id}",
                                                                f"snapshot:{b.snapshot_id}"])
    # in each of the first two sessions request 1 stores the prefix it shares with 0 and 2 finds it; in the third,
    # every request finds its snapshot's entry again
    assert store.stats.hits == 1 + 1 + 3
    first, again = results[a.snapshot_id]
    _check(again, first)
    # the two adapters really differ: one's prefix cache would not do for the other's rows
    gap = max(abs(x - y) for ra, rb in zip(first, results[b.snapshot_id][0])
              for sa, sb in zip(ra.sequences, rb.sequences) for x, y in zip(sa.logprobs, sb.logprobs))
    assert gap > 100 * TOL


def test_mixed_adapter_rows_reuse_only_their_own_prefixes(tiny_model_dir):
    """A batch of one adapter, joined by rows of another (the batch goes mixed, ``use_model``) and of the base
    model, all on one prompt prefix: each request gets its solo tokens; the merged model's entries are not used
    once the batch decodes on the mixed model."""
    host = _host(tiny_model_dir)
    a, b = _snapshots(host)
    session = SamplingSession(host, a)
    out, handles = {}, []
    first = [_spec(0), _spec(1)]
    handles += [session.add(s) for s in first]
    session.run(_steps(2))
    merged_entries = host.prefix_store.entries()
    assert len(merged_entries) == 1
    later = [(b, _spec(2)), (b, _spec(5)), (b, _spec(6)), (a, _spec(3)), (None, _spec(4)), (a, _spec(7))]
    for snapshot, spec in later:
        handles.append(session.add(spec, snapshot))
        for handle, result, _ in session.run(_steps(1)):
            out[handle] = result
    _drain(session, out)
    assert session.mixed is not None
    for handle, (snapshot, spec) in zip(handles, [(a, s) for s in first] + later):
        solo = generate_batch(host.decode_model(snapshot), [spec], host.tokenizer)[0]
        _check([out[handle]], [solo])
    keys = [e.key for e in host.prefix_store.entries()]
    # the merged model's entry of a; on the mixed model, b's (stored by 5, found by 6) and a's (stored by 7: the
    # merged model's entry is not the mixed model's)
    assert len(set(keys)) == 3 and keys[0] == merged_entries[0].key
    assert sorted(tag for _, tag in keys) == sorted([f"snapshot:{a.snapshot_id}"] * 2 + [f"snapshot:{b.snapshot_id}"])
    assert host.prefix_store.stats.hits == 1


# --- through the worker: the SDK's in-flight requests, with and without reuse ------------------------------------


def test_the_sdks_concurrent_requests_get_the_same_answers_with_and_without_reuse(worker_factory):
    import pytrio_compat as trio

    answers, stores = [], []
    for flags in ((), ("--prefix-cache-bytes", "0")):
        worker = worker_factory(*flags)
        service = trio.ServiceClient(base_url=worker.base_url)
        try:
            training = service.create_lora_training_client("tiny", rank=4, seed=7)
            sampler = training.save_weights_and_get_sampling_client()
            params = trio.SamplingParams(max_tokens=6, temperature=0.0)
            futures = [sampler.sample(prompt=trio.ModelInput.from_ints(_spec(i).prompt_tokens), num_samples=1,
                                      sampling_params=params) for i in range(10)]
            answers.append([f.result().sequences[0] for f in futures])
        finally:
            service.close()
        stores.append(worker.service.models.loaded("tiny").prefix_store)
    with_reuse, without = answers
    assert [s.tokens for s in with_reuse] == [s.tokens for s in without]
    for x, y in zip(with_reuse, without):
        assert np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs)).max() <= TOL
    assert stores[1] is None and stores[0].stats.hits + stores[0].stats.tokens_reused > 0


def _counting_forward(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Count the decode batch's model calls by the tokens each feeds (``fail_at``: that call raises instead)."""
    from server_mock.sampling import batch_admission, decode_batch

    calls: list[int] = []
    real = batch_admission.forward

    def counted(model, input_ids, *args, **kwargs):
        calls.append(int(input_ids.shape[1]))
        if fail_at is not None and len(calls) == fail_at:
            raise RuntimeError("out of memory (injected)")
        return real(model, input_ids, *args, **kwargs)
    for module in (batch_admission, decode_batch):  # the prefills' calls and the decode steps'
        monkeypatch.setattr(module, "forward", counted)
    return calls


def test_requests_admitted_together_prefill_once_and_get_their_solo_answers(tiny_model_dir, monkeypatch):
    """Six requests sharing a prefix, admitted together (``add_many``): the prefix is prefilled once and the six
    suffixes in one more model call, where added one by one each request is one call at least; every request's
    tokens are its solo tokens and its logprobs agree within 1e-4."""
    host = _host(tiny_model_dir)
    snapshot = _snapshots(host, 1)[0]
    specs = [_spec(i) for i in range(6)]
    solo = [generate_batch(host.sampling_model(snapshot), [s], host.tokenizer)[0] for s in specs]
    results = {}
    for together in (True, False):  # together first, on an empty prefix store
        session = SamplingSession(host, snapshot)
        calls = _counting_forward(monkeypatch)
        handles = session.add_many([(s, snapshot) for s in specs]) if together else [session.add(s) for s in specs]
        prefill_calls = list(calls)
        out: dict = {}
        _drain(session, out)
        monkeypatch.undo()
        results[together] = ([out[h] for h in handles], prefill_calls)
    got, prefill = results[True]
    _check(got, solo)
    _check(results[False][0], solo)
    assert len(prefill) <= 2 and sum(prefill) < sum(len(s.prompt_tokens) for s in specs), prefill
    assert len(results[False][1]) >= len(specs), results[False][1]


def test_a_group_whose_prefill_fails_leaves_the_running_batch_as_it_was(tiny_model_dir, monkeypatch):
    """A running request, then a group of two prefixes whose second prefill fails after the first's rows were
    stacked: the group admits none of its requests (no handle finishes, none decodes), the running request gets
    its solo answer, and a later group is served as usual."""
    host = _host(tiny_model_dir)
    snapshot = _snapshots(host, 1)[0]
    other = list(range(200, 250))
    first, later = _spec(0, max_tokens=12), [_spec(i) for i in range(4, 6)]
    # two prefixes: the first group's rows start decoding, then the second's prefill fails
    group = [_spec(1), _spec(2), _spec(3, prefix=other), _spec(7, prefix=other)]
    model = host.sampling_model(snapshot)
    solo = [generate_batch(model, [s], host.tokenizer)[0] for s in (first, *later)]
    session = SamplingSession(host, snapshot)
    kept = session.add(first)
    session.run(_steps(2))
    calls = _counting_forward(monkeypatch, fail_at=3)
    with pytest.raises(RuntimeError, match="injected"):
        session.add_many([(s, snapshot) for s in group])
    assert len(calls) == 3  # prefix, suffixes, then the other prefix's prefill fails
    monkeypatch.undo()
    assert session.batch.live_rows == first.num_samples and not session.batch._waiting
    added = session.add_many([(s, snapshot) for s in later])
    out: dict = {}
    _drain(session, out)
    assert set(out) == {kept, *added}
    _check([out[kept], *[out[h] for h in added]], solo)
