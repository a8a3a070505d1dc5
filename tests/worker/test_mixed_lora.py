"""Rows of different LoRA adapters decoding as one batch (engine/mixed_lora.py) and the adapter pool behind it
(engine/adapter_pool.py): each request gets the tokens it gets alone (greedy and seeded), logprobs within 1e-4 of
decoding it alone in float32, bit-identical ones under ``--batch-invariant``, on every tiny text and image-text
family; requests of other adapters (and ranks) join and leave a running batch; no adapter weight is copied per
decode step; the pool's byte budget."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
import torch

from pytrio_compat.wire import LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine.adapter_pool import AdapterPool, prepare, rank_bucket
from server_mock.engine.local_host import LocalModelHost
from server_mock.engine.mixed_lora import MixedLoraDecoder
from server_mock.engine.jobs import Job
from server_mock.engine.queue import ModelQueue
from server_mock.engine.tiny_model import TINY_FAMILIES, make_tiny_model
from server_mock.engine.tiny_vlm import TINY_VLM_FAMILIES
from server_mock.errors import WorkerError
from server_mock.lora import LORA_ALPHA, Snapshot, model_layout
from server_mock.sampling.generate import SampleSpec, generate_batch
from server_mock.service.samplers import SamplePayload, _SampleDecoding, _sample_together

TOL = 1e-4
RANKS = (4, 8, 16)


def _host(model_dir, **options) -> LocalModelHost:
    return LocalModelHost("tiny", str(model_dir), "cpu", torch.float32, options=TrainOptions(**options))


def _snapshots(host: LocalModelHost, ranks=RANKS, **spec):
    """A trained-looking snapshot per rank (lora_B random: a fresh LoRA's B is zero)."""
    out = []
    for i, rank in enumerate(ranks):
        adapter = host.create_adapter(f"run-{len(host.adapters)}", LoraSpec(rank=rank, seed=i, **spec))
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in adapter.params.items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        out.append(host.snapshot(adapter))
    return out


def _spec(i: int, temperature: float = 0.0, max_tokens: int = 10, n: int = 3) -> SampleSpec:
    return SampleSpec(prompt_tokens=list(range(5, 9 + 2 * i)), num_samples=n, max_tokens=max_tokens, seed=i,
                      temperature=temperature, stop_token_ids=[])


def _solo(host, snapshot, spec):
    """The request alone, as the worker decodes it today (its snapshot's own batch: merged in float32)."""
    return generate_batch(host.decode_model(snapshot), [spec], host.tokenizer)[0]


def _drain(session, out: dict, stop=lambda: False):
    while session.active:
        for handle, result, _ in session.run(stop):
            out[handle] = result


def _check(got, solo, exact: bool = False):
    assert [s.tokens for s in got.sequences] == [s.tokens for s in solo.sequences]
    for x, y in zip(got.sequences, solo.sequences):
        diff = max((abs(a - b) for a, b in zip(x.logprobs, y.logprobs)), default=0.0)
        assert diff == 0.0 if exact else diff <= TOL, diff


@pytest.fixture(scope="module")
def host(tiny_model_dir):
    return _host(tiny_model_dir)


@pytest.fixture(scope="module")
def snaps(host):
    return _snapshots(host)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_different_adapters_and_ranks_get_their_solo_tokens(host, snaps, temperature):
    """Three adapters of ranks 4, 8 and 16 and the base model in one batch: greedy and seeded tokens equal to
    each request alone, logprobs within 1e-4; the batch went mixed (one slot per adapter, ranks padded)."""
    weights = [*snaps, None]
    specs = [_spec(i, temperature) for i in range(len(weights))]
    solo = [_solo(host, w, s) for w, s in zip(weights, specs)]
    session = host.sampling_session(weights[0])
    handles = [session.add(specs[0])] + [session.add(s, w) for w, s in zip(weights[1:], specs[1:])]
    out: dict = {}
    _drain(session, out)
    assert session.mixed is not None and session.mixed.slots.copies == 4
    assert session.mixed.slots.rank == rank_bucket(max(RANKS)) == 16
    for handle, ref in zip(handles, solo):
        _check(out[handle], ref)
    # the adapters matter: the base model's tokens or logprobs differ from each adapter's
    assert all(out[h].sequences[0].logprobs != out[handles[-1]].sequences[0].logprobs for h in handles[:-1])


def test_a_request_of_another_adapter_joins_mid_batch_and_one_leaves_early(host, snaps):
    """A decodes; B (another adapter, a longer prompt) joins after 3 steps; A ends first and leaves; C (a third
    adapter) joins after A left, into A's freed slot. Each gets its solo tokens."""
    a, b, c = (_spec(0, max_tokens=6), snaps[0]), (_spec(1, max_tokens=14), snaps[1]), (_spec(2, 1.0), snaps[2])
    solo = [_solo(host, w, s) for s, w in (a, b, c)]
    session = host.sampling_session(a[1])
    out: dict = {}
    steps = [0]

    def after(n):
        steps[0] = 0

        def stop():
            steps[0] += 1
            return steps[0] >= n
        return stop

    ha = session.add(a[0])
    for handle, result, _ in session.run(after(3)):
        out[handle] = result
    assert session.mixed is None  # one adapter so far: its merged weights
    hb = session.add(b[0], b[1])
    assert session.mixed is not None and session.mixed.slots.used == 2
    while ha not in out:
        for handle, result, _ in session.run(lambda: False):
            out[handle] = result
    assert session.active and session.mixed.slots.used == 1  # A left; B still decodes
    hc = session.add(c[0], c[1])
    assert session.mixed.slots.capacity == 4 and session.mixed.slots.used == 2
    _drain(session, out)
    for handle, ref in zip((ha, hb, hc), solo):
        _check(out[handle], ref)


def test_no_adapter_weight_is_copied_per_decode_step(host, snaps):
    """Slots are filled once per adapter when its request joins: over the decode steps the copy count, the pool's
    loads and the stacked tensors (their storage) stay as they were."""
    session = host.sampling_session(snaps[0])
    session.add(_spec(0, max_tokens=20))
    session.add(_spec(1, max_tokens=20), snaps[1])
    session.add(_spec(2, max_tokens=20), None)
    slots = session.mixed.slots
    copies, loads = slots.copies, host.adapter_pool.stats.loads
    storage = {name: (slots.A[name].data_ptr(), slots.B[name].data_ptr()) for name in slots.A}
    count = [0]

    def stop():
        count[0] += 1
        return count[0] >= 15
    session.run(stop)
    assert count[0] == 15  # fifteen decode steps ran
    assert slots.copies == copies == 3 and host.adapter_pool.stats.loads == loads
    assert {name: (slots.A[name].data_ptr(), slots.B[name].data_ptr()) for name in slots.A} == storage


def test_the_stacked_product_equals_an_independent_lora_per_row(host, snaps):
    """One adapted layer with rows of three adapters: the batched matmuls against base + (alpha/r) B A x per row,
    computed here from the snapshot's own tensors."""
    decoder = host.mixed_decoder()
    for i, snap in enumerate(snaps):
        decoder.join(f"s{i}", snap)
    name = "model.layers.0.self_attn.q_proj"
    base = host.model.get_submodule(name)
    base = getattr(base, "base_layer", base)
    rows = ["s2", "s0", "s0", "s1", "s2", "s0"]
    decoder.select_rows(rows, list(range(len(rows))))
    x = torch.randn(len(rows), 1, base.in_features, generator=torch.Generator().manual_seed(0))
    layer = next(mixed for parent, attr, mixed in decoder._swaps if mixed.name == name)
    with torch.no_grad():
        got = layer(x)
        for r, key in enumerate(rows):
            snap = snaps[int(key[1])]
            a = snap.tensors[f"base_model.model.{name}.lora_A.weight"].double()
            b = snap.tensors[f"base_model.model.{name}.lora_B.weight"].double()
            want = (base(x[r]).double() + (LORA_ALPHA / snap.spec.rank) * (x[r].double() @ a.t() @ b.t()))
            assert torch.allclose(got[r].double(), want, atol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        layer(x[:5])
    # rows already slot after slot, as many each: the in-place layout (no gather), the same numbers
    rows = ["s0", "s0", "s1", "s1", "s2", "s2"]
    decoder.select_rows(rows, list(range(len(rows))))
    assert decoder.plan.in_place
    with torch.no_grad():
        got = layer(x)
        for r, key in enumerate(rows):
            snap = snaps[int(key[1])]
            a = snap.tensors[f"base_model.model.{name}.lora_A.weight"].double()
            b = snap.tensors[f"base_model.model.{name}.lora_B.weight"].double()
            want = (base(x[r]).double() + (LORA_ALPHA / snap.spec.rank) * (x[r].double() @ a.t() @ b.t()))
            assert torch.allclose(got[r].double(), want, atol=1e-5)


def test_batch_invariant_mode_is_bit_identical_to_solo(tiny_model_dir):
    """--batch-invariant: every matmul has its request's own shape, so each request's tokens and logprobs are
    the same bits as when it decodes alone (on that path), here for three adapters joining at once."""
    inv = _host(tiny_model_dir, batch_invariant=True)
    snaps = _snapshots(inv)
    specs = [_spec(i, temperature=1.0 if i == 1 else 0.0) for i in range(3)]
    solo = []
    for snap, spec in zip(snaps, specs):
        session = inv.sampling_session(snap)
        handle, out = session.add(spec), {}
        _drain(session, out)
        assert session.mixed is not None  # the invariant path from the first request
        solo.append(out[handle])
    session = inv.sampling_session(snaps[0])
    handles = [session.add(s, w) for s, w in zip(specs, snaps)]
    out = {}
    _drain(session, out)
    for handle, ref in zip(handles, solo):
        _check(out[handle], ref, exact=True)


@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_every_tiny_text_family_mixes_adapters_of_different_ranks(tmp_path, arch):
    """Each tiny text family: adapters of ranks 4 and 16 and the base model in one batch, each request with its
    solo tokens and logprobs within 1e-4, the slots padded to the larger rank's bucket."""
    family = _host(make_tiny_model(tmp_path / arch, arch=arch, seed=3))
    snaps = _snapshots(family, ranks=(4, 16))
    weights = [*snaps, None]
    specs = [_spec(i, max_tokens=8) for i in range(len(weights))]
    solo = [_solo(family, w, s) for w, s in zip(weights, specs)]
    session = family.sampling_session(weights[0])
    handles = [session.add(specs[0])] + [session.add(s, w) for w, s in zip(weights[1:], specs[1:])]
    out: dict = {}
    _drain(session, out)
    assert session.mixed is not None and session.mixed.slots.rank == rank_bucket(16)
    for handle, ref in zip(handles, solo):
        _check(out[handle], ref)
    assert out[handles[0]].sequences[0].logprobs != out[handles[-1]].sequences[0].logprobs


@pytest.mark.parametrize("arch", [a if a == "qwen3_5" else pytest.param(a, marks=pytest.mark.slow)
                                  for a in TINY_VLM_FAMILIES])  # the default job keeps qwen3_5's
def test_every_tiny_image_text_family_mixes_adapters_on_text_prompts(tiny_vlm_dir, arch):
    """An image-text family batches adapters on its text decoder: adapters of ranks 4 and 8 and the base model in
    one batch of text prompts, each with its solo tokens."""
    vlm = LocalModelHost("vlm", str(tiny_vlm_dir(arch)), "cpu", torch.float32,
                         options=TrainOptions(micro_batch_tokens=4096))
    snaps = _snapshots(vlm, ranks=(4, 8))
    weights = [*snaps, None]
    specs = [SampleSpec(prompt_tokens=[10 + i, 40, 77, 90 + i], num_samples=2, max_tokens=6, seed=i,
                        stop_token_ids=[]) for i in range(3)]
    solo = [_solo(vlm, w, s) for w, s in zip(weights, specs)]
    session = vlm.sampling_session(weights[0])
    handles = [session.add(specs[0])] + [session.add(s, w) for w, s in zip(weights[1:], specs[1:])]
    out: dict = {}
    _drain(session, out)
    assert session.mixed is not None
    for handle, ref in zip(handles, solo):
        _check(out[handle], ref)


BF16_TOL = 0.05  # measured 0.028 on this model (4 adapters, ranks 4-32, 16 tokens x 4 rows each); float32: 3e-6


def test_bfloat16_mixed_batch_keeps_greedy_tokens_within_the_stated_tolerance(tiny_model_dir):
    """bfloat16: the mixed batch's products round differently from each adapter's own batch (PEFT, unmerged), so
    the contract is a tolerance: the same greedy tokens here and logprobs within BF16_TOL."""
    bf16 = LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.bfloat16, options=TrainOptions())
    snaps = _snapshots(bf16, ranks=(4, 8, 16, 32))
    specs = [_spec(i, max_tokens=16, n=4) for i in range(4)]
    solo = [_solo(bf16, w, s) for w, s in zip(snaps, specs)]
    session = bf16.sampling_session(snaps[0])
    handles = [session.add(specs[0])] + [session.add(s, w) for w, s in zip(snaps[1:], specs[1:])]
    out: dict = {}
    _drain(session, out)
    worst = 0.0
    for handle, ref in zip(handles, solo):
        assert [s.tokens for s in out[handle].sequences] == [s.tokens for s in ref.sequences]
        worst = max(worst, max(abs(a - b) for x, y in zip(out[handle].sequences, ref.sequences)
                               for a, b in zip(x.logprobs, y.logprobs)))
    assert 0.0 < worst <= BF16_TOL


# --- the pool ------------------------------------------------------------------------------------------------


def test_the_pool_keeps_adapters_within_its_bytes_and_reloads_an_evicted_one(host, snaps):
    """Two rank-4 entries fit a budget of exactly their bytes (none evicted); one byte less evicts the least
    recently used; an evicted adapter loads back on demand (counted, its load timed) with the same weights; an
    entry larger than the budget is refused naming the option; a batch keeps decoding an evicted adapter."""
    small = _snapshots(host, ranks=(4, 4, 4))
    size = prepare(small[0], torch.float32, "cpu").nbytes
    exact = AdapterPool(2 * size, torch.float32, "cpu")
    exact.get(small[0])
    exact.get(small[1])
    assert exact.keys() == [small[0].snapshot_id, small[1].snapshot_id] and exact.stats.evictions == 0
    assert exact.nbytes == 2 * size
    tight = AdapterPool(2 * size - 1, torch.float32, "cpu")
    tight.get(small[0])
    tight.get(small[1])
    assert tight.keys() == [small[1].snapshot_id] and tight.stats.evictions == 1
    exact.get(small[0])  # a hit moves it to most recently used
    exact.get(small[2])  # evicts small[1]
    assert exact.keys() == [small[0].snapshot_id, small[2].snapshot_id]
    before = exact.stats.loads
    again = exact.get(small[1])
    assert exact.stats.loads == before + 1 and len(exact.stats.load_seconds) == exact.stats.loads
    fresh = prepare(small[1], torch.float32, "cpu")
    assert all(torch.equal(again.layers[n][0], fresh.layers[n][0]) and torch.equal(again.layers[n][1],
               fresh.layers[n][1]) for n in fresh.layers)
    with pytest.raises(ValueError, match="adapter-pool-bytes"):
        AdapterPool(size - 1, torch.float32, "cpu").get(small[0])
    with pytest.raises(ValueError, match="adapter-pool-bytes"):
        AdapterPool(0, torch.float32, "cpu")


def test_a_batch_decodes_on_while_the_pool_evicts_its_adapters(tiny_model_dir):
    """A pool with room for one adapter: three adapters still decode together (each copied into its batch slot
    when it joined), with their solo tokens; the pool evicted and reloads on the next request."""
    probe = _host(tiny_model_dir)
    size = prepare(_snapshots(probe, ranks=(8,))[0], torch.float32, "cpu").nbytes
    small = _host(tiny_model_dir, adapter_pool_bytes=size)
    snaps = _snapshots(small, ranks=(8, 8, 8))
    specs = [_spec(i) for i in range(3)]
    solo = [_solo(small, w, s) for w, s in zip(snaps, specs)]
    session = small.sampling_session(snaps[0])
    handles = [session.add(specs[0])] + [session.add(s, w) for w, s in zip(snaps[1:], specs[1:])]
    assert len(small.adapter_pool) == 1 and small.adapter_pool.stats.evictions == 2
    out: dict = {}
    _drain(session, out)
    for handle, ref in zip(handles, solo):
        _check(out[handle], ref)


def _random_snapshot(host: LocalModelHost, index: int, rank: int = 4) -> Snapshot:
    """A snapshot built here from random tensors in PEFT's layout (no training run)."""
    spec = LoraSpec(rank=rank)
    targets = host.lora_targets(spec)
    layout = model_layout(host.model, host._linear_groups)
    gen = torch.Generator().manual_seed(5000 + index)
    tensors = {}
    for name in targets:
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, layout[name].in_features,
                                                                        generator=gen) * 0.3
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(layout[name].out_features, rank,
                                                                        generator=gen) * 0.05
    return Snapshot(f"random-{index}", spec, targets, tensors)


def test_sixty_four_adapters_stay_resident_and_eight_share_one_batch(host):
    """64 adapters resident in a pool of exactly their bytes (none evicted), 8 of them in one batch (one slot
    each), each request with its solo tokens."""
    snaps = [_random_snapshot(host, i) for i in range(64)]
    size = prepare(snaps[0], torch.float32, "cpu").nbytes
    host.adapter_pool = pool = AdapterPool(64 * size, torch.float32, "cpu")
    try:
        for snap in snaps:
            pool.get(snap)
        assert len(pool) == 64 and pool.stats.evictions == 0 and pool.nbytes == 64 * size
        chosen = snaps[::8]
        specs = [_spec(i, max_tokens=6, n=2) for i in range(len(chosen))]
        solo = [_solo(host, w, s) for w, s in zip(chosen, specs)]
        session = host.sampling_session(chosen[0])
        handles = [session.add(specs[0])] + [session.add(s, w) for w, s in zip(chosen[1:], specs[1:])]
        assert session.mixed.slots.used == 8 and pool.stats.loads == 64  # all were resident: no load
        out: dict = {}
        _drain(session, out)
        for handle, ref in zip(handles, solo):
            _check(out[handle], ref)
    finally:
        host.adapter_pool = AdapterPool(TrainOptions().adapter_pool_bytes, torch.float32, "cpu")


def test_rank_buckets_at_their_edges():
    assert [rank_bucket(r) for r in (1, 8, 9, 16, 17, 256)] == [8, 8, 16, 16, 32, 256]
    with pytest.raises(ValueError, match="257"):
        rank_bucket(257)


# --- the queue: which jobs join a running batch ----------------------------------------------------------


class _MixingDecoding:
    """A stand-in decode batch that can hold any weights (``mixes``): it records what it was given."""

    mixes = True

    def __init__(self, log: list) -> None:
        self.log, self.left = log, {}

    @property
    def active(self) -> bool:
        return bool(self.left)

    def can_add(self) -> bool:
        return True

    def add(self, payload) -> int:
        self.log.append(("add", payload))
        self.left[len(self.log)] = payload
        return len(self.log)

    def run(self, stop):
        done = [(h, {"tag": p}) for h, p in self.left.items()]
        self.left.clear()
        return done


def _run_all(queue, jobs, timeout: float = 20.0) -> None:
    """Put the jobs on the queue and wait until every one has succeeded."""
    for j in jobs:
        queue.put(j)
    until = time.monotonic() + timeout
    while not all(j.status == "succeeded" for j in jobs):
        assert time.monotonic() < until
        time.sleep(0.01)


def test_the_queue_joins_other_weights_by_mix_key_only():
    """Jobs of the session's mix key join it whatever their batch key; a job of another mix key (another
    tenant's, without --batch-across-tenants) opens its own batch."""
    loop = asyncio.new_event_loop()
    queue = ModelQueue("unit", loop, batch_window=0.05)
    opened: list = []
    log: list = []

    def job(tag, owner, weights, mix):
        j = Job(request_id=tag, kind="sample", fn=lambda: {}, owner=owner, batch_key=f"{owner}|{weights}",
                mix_key=mix, payload=tag, batch_cost=1)

        def open_decode():
            opened.append(tag)
            return _MixingDecoding(log)
        j.open_decode = open_decode
        return j

    try:
        jobs = [job("a1", "A", "w1", "A|m"), job("a2", "A", "w2", "A|m"), job("b1", "B", "w1", "B|m")]
        _run_all(queue, jobs)
        assert opened == ["a1", "b1"]  # a2 (other weights, A's mix key) joined a1's batch
        assert [j.result for j in jobs] == [{"tag": "a1"}, {"tag": "a2"}, {"tag": "b1"}]
    finally:
        queue.stop()
        loop.close()


def test_requests_of_several_adapters_added_together_start_mixed_with_one_prefill(host, snaps):
    """A deferred session given requests of several adapters at once (the queue's ``add_many``) starts on the
    mixed decoder (no merged copy of the first adapter is built) and prefills them in one forward; each request
    still gets its solo tokens, logprobs within 1e-4; each reports the weight loading done for it, not the
    session's total."""
    weights = [*snaps, None]
    specs = [_spec(i) for i in range(len(weights))]
    solo = [_solo(host, w, s) for w, s in zip(weights, specs)]
    built = []
    decode_model = host.decode_model
    host.decode_model = lambda snapshot: built.append(snapshot) or decode_model(snapshot)
    profile: dict = {}
    host.decode_profile = profile
    try:
        session = host.sampling_session(weights[0], defer=True)
        assert session.model is None
        handles = session.add_many(list(zip(specs, weights)))
        out, timings = {}, {}
        while session.active:
            for handle, result, timing in session.run(lambda: False):
                out[handle], timings[handle] = result, timing
    finally:
        host.decode_model = decode_model
        host.decode_profile = None
    assert built == [] and isinstance(session.model, MixedLoraDecoder)
    assert session.batch.prefill_s > 0 and profile.get("prefill", 0) > 0
    for handle, ref in zip(handles, solo):
        _check(out[handle], ref)
    assert len({timings[h]["prefill"] for h in handles}) == 1  # one prefill for them all
    loads = [timings[h]["load_weights"] for h in handles]
    assert sum(loads) == pytest.approx(session.load_weights_s, rel=1e-6, abs=1e-9)


def test_a_deferred_session_of_one_adapter_decodes_merged(host, snaps):
    session = host.sampling_session(snaps[0], defer=True)
    handle = session.add(_spec(0))
    out: dict = {}
    _drain(session, out)
    assert session.mixed is None and session.merged
    _check(out[handle], _solo(host, snaps[0], _spec(0)), exact=True)


class _ManyDecoding(_MixingDecoding):
    """``_MixingDecoding`` that also takes several jobs at once (``add_many``), failing where told to."""

    def __init__(self, log: list, fail: bool = False) -> None:
        super().__init__(log)
        self.fail = fail

    def add_many(self, payloads) -> list[int]:
        self.log.append(("add_many", list(payloads)))
        if self.fail:
            raise RuntimeError("one of them cannot be prefilled")
        return [self.add(p) for p in payloads]


@pytest.mark.parametrize("fail", [False, True])
def test_the_queue_opens_a_batch_with_every_queued_job_of_its_mix_key(fail):
    """Jobs of several weights of one mix key queued together open one batch and are added in one ``add_many``
    (one prefill); if that fails, each is added alone."""
    loop = asyncio.new_event_loop()
    queue = ModelQueue("unit", loop, batch_window=0.05)
    log: list = []
    opened: list = []

    def job(tag, weights):
        j = Job(request_id=tag, kind="sample", fn=lambda: {}, owner="A", batch_key=f"A|{weights}",
                mix_key="A|m", payload=tag, batch_cost=1)

        def open_decode():
            opened.append(tag)
            return _ManyDecoding(log, fail)
        j.open_decode = open_decode
        return j

    try:
        jobs = [job(f"r{i}", f"w{i}") for i in range(4)]
        _run_all(queue, jobs)
        assert opened == ["r0"]
        assert log[0] == ("add_many", ["r0", "r1", "r2", "r3"])
        assert [entry[1] for entry in log[1:]] == ["r0", "r1", "r2", "r3"]  # added (alone, after a failure)
        assert [j.result for j in jobs] == [{"tag": f"r{i}"} for i in range(4)]
    finally:
        queue.stop()
        loop.close()


def _counting_loader(loads: collections.Counter, key: str, snapshot, fail: bool = False):
    """A sampler's weights loader (what fingerprints a local adapter folder) that counts its calls."""

    def load():
        loads[key] += 1
        if fail:
            raise WorkerError(404, "sampler_weights_expired", f"model_path: {key} is gone", "model_path")
        return snapshot

    return load


def _folder_payloads(snaps, folders: int, loads: collections.Counter, failing: str | None = None):
    """Six greedy requests on ``folders`` adapter folders, interleaved: each folder's weights and payloads."""
    weights = {f"folder-{i}": snaps[i] for i in range(folders)}
    keys = [f"folder-{i % folders}" for i in range(6)]
    loaders = {key: _counting_loader(loads, key, snap, fail=key == failing) for key, snap in weights.items()}
    return weights, [SamplePayload(_spec(i, max_tokens=4, n=1), False, loaders[key], key)
                     for i, key in enumerate(keys)]


@pytest.mark.parametrize("path", ["decode_session", "one_call"])
@pytest.mark.parametrize("folders", [1, 2])
def test_requests_of_one_adapter_folder_admitted_together_load_it_once(host, snaps, folders, path):
    """Six requests of one local adapter folder admitted together (``_SampleDecoding.add_many``, or one
    ``sample_mixed`` call) call the folder's loader, which reads the folder, once; of two folders, once each; each
    request still gets its solo tokens."""
    loads: collections.Counter = collections.Counter()
    weights, payloads = _folder_payloads(snaps, folders, loads)
    if path == "decode_session":
        decoding = _SampleDecoding.open(host, snaps[0])
        handles = decoding.add_many(payloads)
        out: dict = {}
        while decoding.active:
            out.update(decoding.run(lambda: False))
        results = [out[h] for h in handles]
    else:
        results = _sample_together(host, payloads)
    assert loads == {key: 1 for key in weights}
    for payload, result in zip(payloads, results):
        solo = _solo(host, weights[payload.weights_key], payload.spec)
        assert [s["tokens"] for s in result["sequences"]] == [s.tokens for s in solo.sequences]


def _sample_job(host, tag: str, payload: SamplePayload) -> Job:
    """A sample job as ``Samplers.submit`` queues it (one tenant, one base model)."""
    key = payload.weights_key
    job = Job(request_id=tag, kind="sample", fn=lambda: _sample_together(host, [payload])[0], owner="A",
              batch_key=f"A|{key}", mix_key="A|tiny", payload=payload, batch_cost=1, weights_key=key)
    job.batch_fn = lambda payloads: _sample_together(host, payloads)
    job.open_decode = lambda: _SampleDecoding.open(host, payload.load(), key)
    return job


@pytest.mark.parametrize("failing", [None, "folder-1"])
def test_the_queue_loads_each_folder_of_a_batch_once_and_a_failing_one_fails_its_own_requests(host, snaps, failing):
    """Requests of two adapter folders queued together open one batch: each folder is loaded once, the batch's
    opening included. A folder whose loader fails fails its own requests only (the batch is then admitted one
    request at a time, as when any request of it fails); the other folder's requests get their solo tokens."""
    loop = asyncio.new_event_loop()
    queue = ModelQueue("unit", loop, batch_window=0.05)
    loads: collections.Counter = collections.Counter()
    weights, payloads = _folder_payloads(snaps, 2, loads, failing)
    jobs = [_sample_job(host, f"r{i}", payload) for i, payload in enumerate(payloads)]
    try:
        for job in jobs:
            queue.put(job)
        until = time.monotonic() + 60
        while not all(job.status in ("succeeded", "failed") for job in jobs):
            assert time.monotonic() < until
            time.sleep(0.01)
    finally:
        queue.stop()
        loop.close()
    if failing is None:
        assert loads == {"folder-0": 1, "folder-1": 1}
    for job, payload in zip(jobs, payloads):
        if payload.weights_key == failing:
            assert job.status == "failed" and job.error.code == "sampler_weights_expired"
            continue
        assert job.status == "succeeded", job.error
        solo = _solo(host, weights[payload.weights_key], payload.spec)
        assert [s["tokens"] for s in job.result["sequences"]] == [s.tokens for s in solo.sequences]


def test_mixed_decoding_is_off_without_a_pool(tiny_model_dir):
    off = _host(tiny_model_dir, adapter_pool_bytes=0)
    snaps = _snapshots(off, ranks=(4, 4))
    session = off.sampling_session(snaps[0])
    session.add(_spec(0))
    assert not session.can_mix
    with pytest.raises(ValueError, match="its own weights"):
        session.add(_spec(1), snaps[1])
    assert not isinstance(session.model, MixedLoraDecoder)


def test_sample_mixed_runs_several_adapters_as_one_batch_and_one_adapter_as_sample_batch(host, snaps):
    """``sample_mixed`` (what a Ray sampler replica runs for one call): requests of three adapters and the base
    model, interleaved, decode as one mixed batch (no ``sample_batch`` call; the adapters come from the pool), each
    with its solo tokens and logprobs within 1e-4, in request order; requests of one adapter take ``sample_batch``
    (its merged copy), the pool untouched."""
    weights = [*snaps, None]
    requests = [(weights[i % len(weights)], _spec(i, n=2)) for i in range(2 * len(weights))]
    solo = [_solo(host, w, s) for w, s in requests]
    calls = []
    sample_batch = host.sample_batch
    host.sample_batch = lambda *args: calls.append(args[0]) or sample_batch(*args)
    stats = host.adapter_pool.stats
    try:
        used = stats.loads + stats.hits
        timings: dict = {}
        got = host.sample_mixed(requests, timings)
        assert calls == [] and stats.loads + stats.hits > used
        assert timings["prefill"] > 0 and timings["decode"] > 0
        for result, ref in zip(got, solo):
            _check(result, ref)
        used = stats.loads + stats.hits
        alone = host.sample_mixed([(snaps[1], spec) for _, spec in requests[:3]], {})
        assert calls == [snaps[1]] and stats.loads + stats.hits == used
        for result, (_, spec) in zip(alone, requests[:3]):
            _check(result, _solo(host, snaps[1], spec))
    finally:
        host.sample_batch = sample_batch


def test_sample_mixed_without_a_pool_runs_each_adapter_in_a_batch_of_its_own(tiny_model_dir):
    off = _host(tiny_model_dir, adapter_pool_bytes=0)
    snaps = _snapshots(off, ranks=(4, 8))
    requests = [(snaps[i % 2], _spec(i)) for i in range(4)]
    got = off.sample_mixed(requests, {})
    for result, (snap, spec) in zip(got, requests):
        _check(result, _solo(off, snap, spec))
