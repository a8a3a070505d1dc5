"""The PyTRIO protocol's parts, without a worker: the bounded msgpack decoder at its limits, actor tokens on a
clock, the SDK's own encoding of events decoded by ours (the totals counted as the SDK counts them), our answers
parsed by the SDK's own strict models, auto_shift, and what the state releases as time passes."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from server_mock.api.pytrio import event_wire as wire
from server_mock.api.pytrio.actor import decode_event, hold_seconds
from server_mock.api.pytrio.msgpack_codec import MsgpackError, MsgpackLimits, decode, encode
from server_mock.api.pytrio.tokens import ActorTokens, Grant
from server_mock.api.pytrio.training import _unshift, encode_forward, forward_batch
from server_mock.cli import build_parser
from server_mock.config import Limits, PytrioOptions
from server_mock.flags import from_args
from server_mock.errors import WorkerError

pytest.importorskip("pytrio", reason="the official pytrio SDK (the dev extra) is not installed")

# --- bounded msgpack ----------------------------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"\x91" * (depth - 1) + b"\x90"  # depth arrays, the innermost empty


def _code(body: bytes, limits: MsgpackLimits) -> str | None:
    try:
        decode(body, limits)
    except MsgpackError as exc:
        return exc.code
    return None


@pytest.mark.parametrize("limit,at,past,code", [
    ("max_depth", lambda n: b"\x91" * n + b"\xc0", lambda n: b"\x91" * (n + 1) + b"\xc0", "body_too_deep"),
    ("max_items", lambda n: msgpack.packb([0] * (n - 1)), lambda n: msgpack.packb([0] * n), "body_too_complex"),
    ("max_array_len", lambda n: msgpack.packb([0] * n), lambda n: msgpack.packb([0] * (n + 1)), "invalid_msgpack"),
    ("max_map_len", lambda n: msgpack.packb({str(i): 0 for i in range(n)}),
     lambda n: msgpack.packb({str(i): 0 for i in range(n + 1)}), "invalid_msgpack"),
    ("max_str_len", lambda n: msgpack.packb("x" * n), lambda n: msgpack.packb("x" * (n + 1)), "invalid_msgpack"),
    ("max_bin_len", lambda n: msgpack.packb(b"x" * n), lambda n: msgpack.packb(b"x" * (n + 1)), "invalid_msgpack"),
    ("max_body_bytes", lambda n: msgpack.packb(b"x" * (n - 2)), lambda n: msgpack.packb(b"x" * (n - 1)),
     "body_too_large"),  # a bin8: 2 header bytes
])
def test_every_msgpack_bound_holds_at_its_limit_and_refuses_one_past(limit, at, past, code):
    limits = MsgpackLimits(**{limit: 64})
    assert _code(at(64), limits) is None
    assert _code(past(64), limits) == code


def test_hostile_msgpack_is_refused_before_it_is_built():
    limits = MsgpackLimits()
    huge_array = b"\xdd\xff\xff\xff\xff"  # an array32 declaring 4 294 967 295 elements, none sent
    huge_bin = b"\xc6\x7f\xff\xff\xff" + b"x" * 10  # a bin32 declaring 2 GiB
    for body, code in [(huge_array, "invalid_msgpack"), (huge_bin, "invalid_msgpack"),
                       (msgpack.packb({"a": 1}) + b"\x00", "invalid_msgpack"),  # trailing bytes
                       (msgpack.packb(msgpack.ExtType(1, b"x")), "invalid_msgpack"),
                       (b"\xc1", "invalid_msgpack"), (b"", "invalid_msgpack"),
                       (msgpack.packb({1: 2}), "invalid_msgpack"),  # a map key that is not a string
                       (_nested(10_000), "body_too_deep")]:
        assert _code(body, limits) == code, body[:8]


def test_a_submit_body_that_is_no_event_is_a_400_naming_the_field():
    limits = MsgpackLimits()
    with pytest.raises(WorkerError) as caught:
        decode_event(msgpack.packb([1, 2]), limits)
    assert (caught.value.status, caught.value.code) == (400, "invalid_event")
    bad = {"version": 1, "event_id": "event_not-an-id!", "type": "trainer.forward", "payload": {},
           "metadata": {"index": 1, "run_id": "run-x"}}
    with pytest.raises(WorkerError) as caught:
        decode_event(msgpack.packb(bad), limits)
    assert caught.value.field == "event_id" and "event_id" in caught.value.message


# --- actor tokens -------------------------------------------------------------------------------------------------


def test_tokens_expire_renew_and_open_only_their_run():
    now = [1000.0]
    tokens = ActorTokens(ttl=600.0, clock=lambda: now[0])
    token, expires = tokens.mint("tenant-a", "training", "run-1", "ss_1")
    other, _ = tokens.mint("tenant-b", "sampling", "sr_2", "ss_2")
    assert expires == 1600.0 and token != other and len(token) > 40
    grant = tokens.resolve(f"Bearer {token}")
    assert (grant.tenant, grant.kind, grant.run_cuid) == ("tenant-a", "training", "run-1")
    assert tokens.resolve(f"bearer {other}").run_cuid == "sr_2"
    now[0] = 1599.9
    tokens.resolve(f"Bearer {token}")  # just before expiry
    now[0] = 1600.0
    with pytest.raises(WorkerError, match="expired") as caught:
        tokens.resolve(f"Bearer {token}")
    assert (caught.value.status, caught.value.code) == (401, "token_expired")
    renewed, later = tokens.renew("run-1")
    assert renewed == token and later == 2200.0  # the same token, a new expiry: requests in flight keep working
    tokens.resolve(f"Bearer {token}")
    tokens.revoke("run-1")
    for header in (f"Bearer {token}", f"Bearer {token}x", "Bearer ", token, "Basic abc", None, "Bearer " + "a" * 513):
        with pytest.raises(WorkerError) as caught:
            tokens.resolve(header)
        assert caught.value.status == 401
    assert tokens.mint("tenant-a", "training", "run-1", "ss_1")[0] != token  # a new run gets a new secret


def test_a_restored_token_opens_its_run_and_its_renewal_mints_a_new_one():
    now = [1000.0]
    before = ActorTokens(ttl=600.0, clock=lambda: now[0])
    token, _ = before.mint("tenant-a", "training", "run-1", "ss_1")
    digest, expires = before.written("run-1")
    assert token not in digest and len(bytes.fromhex(digest)) == 32  # only the SHA-256 is written down
    after = ActorTokens(ttl=600.0, clock=lambda: now[0])  # a new process
    after.restore(digest, Grant("tenant-a", "training", "run-1", "ss_1", expires))
    assert after.resolve(f"Bearer {token}").run_cuid == "run-1"
    now[0] = 1300.0
    renewed, later = after.renew("run-1")
    assert renewed != token and later == 1900.0 and after.written("run-1")[0] != digest
    assert after.renew("run-1")[0] == renewed  # from then on, renewals keep the new token
    assert after.resolve(f"Bearer {token}").run_cuid == "run-1"  # the old one until its own expiry
    now[0] = 1600.0
    with pytest.raises(WorkerError, match="expired"):
        after.resolve(f"Bearer {token}")
    assert after.resolve(f"Bearer {renewed}").run_cuid == "run-1"
    now[0] = 1000.0
    after.revoke("run-1")  # both die with the run
    for gone in (token, renewed):
        with pytest.raises(WorkerError, match="unknown or revoked"):
            after.resolve(f"Bearer {gone}")


def test_the_ack_wait_is_bounded_below_the_sdks_submit_timeout():
    parser = build_parser()
    assert from_args(PytrioOptions, parser.parse_args(["serve", "--pytrio-ack-wait", "25"])).pytrio_ack_wait == 25
    assert from_args(PytrioOptions, parser.parse_args(["serve", "--pytrio-ack-wait", "0"])).pytrio_ack_wait == 0
    with pytest.raises(ValueError, match="--pytrio-ack-wait must be <= 25"):
        from_args(PytrioOptions, parser.parse_args(["serve", "--pytrio-ack-wait", "25.01"]))
    with pytest.raises(ValueError, match="--pytrio-ack-wait must be >= 0"):
        from_args(PytrioOptions, parser.parse_args(["serve", "--pytrio-ack-wait", "-0.01"]))


# --- the SDK's own encoding, decoded here -------------------------------------------------------------------------


def _sdk_events(loss: str, auto_shift: bool, rng) -> tuple[list[bytes], object]:
    from pytrio.client.builders.training import build_trainer_forward_payload
    from pytrio.client.training_batch import plan_training_batch
    from pytrio.model.limits import TrainingLimits
    from pytrio.protocol.actor.events.codec import payload_to_wire_value
    from pytrio.protocol.actor.events.event import EventMetadata, EventType, build_event_envelope, pack_event_envelope
    from pytrio.types import Datum, ModelInput

    data = []
    for n in (5, 9, 3, 12, 7):
        inputs = {"target_tokens": np.where(rng.uniform(size=n) < 0.2, -100, rng.integers(0, 500, n)).astype(np.int64)}
        if loss == "cross_entropy":
            inputs["weights"] = np.where(rng.uniform(size=n) < 0.3, 0.0, rng.uniform(0.1, 2, n)).astype(np.float32)
        else:
            inputs["logprobs"] = -rng.uniform(0.1, 3, n).astype(np.float32)
            inputs["advantages"] = np.where(rng.uniform(size=n) < 0.3, 0.0, rng.normal(0, 1, n)).astype(np.float32)
        data.append(Datum(model_input=ModelInput.from_ints(rng.integers(0, 500, n).tolist()), loss_fn_inputs=inputs))
    plan = plan_training_batch(data, loss_fn=loss, auto_shift=auto_shift,
                               limits=TrainingLimits(max_batch_size=2, max_tokens_per_request=20, max_seq_len=64),
                               tokenizer_vocab_size=512)
    bodies = []
    for index, chunk in enumerate(plan.chunks, start=2):
        payload = build_trainer_forward_payload(chunk=chunk, loss_fn_config=None, auto_shift=auto_shift,
                                                gradient_accumulation=plan.totals)
        wire_value = payload_to_wire_value(EventType.TRAINER_FORWARD_BACKWARD, payload)
        metadata = EventMetadata(index=index, step=0, timestamp=0, sdk="pytrio", sdk_version="0.2.9", run_id="run-x")
        bodies.append(pack_event_envelope(build_event_envelope(EventType.TRAINER_FORWARD_BACKWARD, wire_value,
                                                               metadata)))
    return bodies, plan.totals


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "dro"])
@pytest.mark.parametrize("auto_shift", [False, True])
def test_the_sdks_events_decode_and_their_counts_add_up_to_the_sdks_totals(loss, auto_shift):
    bodies, totals = _sdk_events(loss, auto_shift, np.random.default_rng(hash((loss, auto_shift)) % 1000))
    assert len(bodies) >= 3  # the limits split the call
    active = advantage = samples = 0
    for body in bodies:
        payload = wire.parse_payload(decode_event(body, MsgpackLimits()))
        counts = payload.counts()
        assert payload.gradient_accumulation.total_active_tokens == totals.total_active_tokens
        active, advantage, samples = active + counts.active_tokens, advantage + counts.advantage_tokens, \
            samples + counts.samples
    assert (samples, active, advantage) == (totals.total_samples, totals.total_active_tokens,
                                            totals.total_advantage_tokens)


def test_totals_that_do_not_describe_the_data_are_refused():
    row = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "target_ids": [2, 3, -100],
           "weights": [1.0, 0.0, 1.0]}
    base = {"data": [row], "loss": {"type": "cross_entropy"}}
    wire.ForwardIn.model_validate({**base, "gradient_accumulation": wire_totals(1, 1)})
    for bad in (wire_totals(1, 2), wire_totals(1, 0), wire_totals(2, 0)):  # whole call mismatch; smaller than data
        with pytest.raises(ValidationError, match="gradient_accumulation"):
            wire.ForwardIn.model_validate({**base, "gradient_accumulation": bad})
    wire.ForwardIn.model_validate({**base, "gradient_accumulation": wire_totals(2, 5)})  # one chunk of a larger call


def wire_totals(samples: int, active: int) -> dict:
    return {"total_samples": samples, "total_active_tokens": active, "total_advantage_tokens": 0}


# --- our answers, parsed by the SDK -------------------------------------------------------------------------------


def test_our_answers_pass_the_sdks_strict_models():
    from pytrio.client.adapters.training import actor_forward_responses_to_sdk, actor_optim_response_to_sdk
    from pytrio.protocol.actor.events.event import unpack_event_response
    from pytrio.protocol.actor.events.trainer.forward import TrainerForwardResult

    counts = wire.ChunkCounts(samples=2, active_tokens=3, advantage_tokens=0, input_tokens=5)
    result = {"loss_fn_outputs": [{"logprobs": np.array([-1.5, -0.25, 0.0], np.float32),
                                   "elementwise_loss": np.array([1.5, 0.25, 0.0], np.float32)},
                                  {"logprobs": np.array([-3.0, -0.5], np.float32),
                                   "elementwise_loss": np.array([3.0, 0.5], np.float32)}],
              "metrics": {"loss_sum": 2.25, "token_count": 4.0, "loss:sum": 2.25}}
    usage = wire.UsageOut(input_tokens=5, train_tokens=5)
    answer = encode_forward("event_0123456789ab", "trainer.forward_backward", counts, False, usage, result)["answer"]
    parsed = unpack_event_response(answer)
    TrainerForwardResult.model_validate(parsed.result)  # extra="forbid" at every level
    out = actor_forward_responses_to_sdk([{"result": parsed.result}], expected_samples=(2,))
    assert out.metrics == {"loss_sum": 2.25, "loss_mean": 0.75, "token_count": 3.0}  # the SDK's count, not the engine's
    assert out.loss_fn_outputs[1]["logprobs"].data == [-3.0, -0.5]
    raw = msgpack.unpackb(answer, raw=False)
    raw["result"]["metrics"]["grad_norm"] = 1.0  # what an extra metric would do to the user
    with pytest.raises(ValidationError):
        TrainerForwardResult.model_validate(raw["result"])
    optim = encode(wire.succeeded("event_0123456789ac", "trainer.optimize_step",
                                  wire.OptimResultOut(metrics={"grad_norm": 0.5}), wire.UsageOut()))
    assert actor_optim_response_to_sdk({"result": unpack_event_response(optim).result}).metrics == {"grad_norm": 0.5}
    failed = unpack_event_response(encode(wire.failed("event_0123456789ad", "trainer.forward", "invalid_payload", "x")))
    pending = unpack_event_response(encode(wire.pending("event_0123456789ae", "trainer.init_run", running=True)))
    assert (failed.status.value, failed.error.code, pending.status.value) == ("failed", "invalid_payload", "running")
    for broken in ({"status": "succeeded", "result": wire.EmptyResultOut()},  # no usage
                   {"status": "failed", "usage": wire.UsageOut()},  # no error
                   {"status": "accepted", "usage": wire.UsageOut()}):
        with pytest.raises(ValidationError):
            wire.EventStatusOut(event_id="event_0123456789af", type="trainer.init_run", **broken)


def test_auto_shift_scores_the_next_label_and_reports_per_position():
    payload = wire.ForwardIn.model_validate({
        "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
                  "target_ids": [5, 6, -100, 8], "weights": [1.0, 0.5, 1.0, 2.0]}],
        "auto_shift": True, "loss": {"type": "cross_entropy"},
        "gradient_accumulation": {"total_samples": 1, "total_active_tokens": 2, "total_advantage_tokens": 0}})
    assert payload.counts().active_tokens == 2  # positions 1 and 3 (position 0 is never scored)
    row = forward_batch(payload, backward=True).data[0]
    np.testing.assert_array_equal(row["target_tokens"], [6, -100, 8, -100])
    np.testing.assert_array_equal(row["weights"], [0.5, 1.0, 2.0, 0.0])
    assert forward_batch(payload, backward=True).loss_scale == 0.5
    assert forward_batch(payload, backward=False).loss_scale == 1.0
    np.testing.assert_array_equal(_unshift(np.array([-1.0, 0.0, -3.0, 0.0])), [0.0, -1.0, 0.0, -3.0])


def test_poll_hold_follows_prefer_wait():
    assert hold_seconds("wait=65") == 50.0 and hold_seconds("respond-async, wait=20") == 15.0
    assert hold_seconds(None) == 0.0 and hold_seconds("wait=3") == 0.0 and hold_seconds("wait=abc") == 0.0


# --- what the state releases as time passes -----------------------------------------------------------------------


class _FakeService:
    """What the state reaches of the service: releasing samplers, snapshots and runs is recorded."""

    journal = None  # --durability checkpoint-only: nothing recorded
    limits = Limits()

    def __init__(self) -> None:
        self.dropped, self.deleted, self.snapshot_paths = [], [], set()
        service = self

        class Snapshots:
            def __contains__(self, path):
                return path in service.snapshot_paths

            def pop(self, path):
                service.snapshot_paths.discard(path)

        class Samplers:
            def drop(self, sampler_id, tenant):
                service.dropped.append(sampler_id)

        class Runs:
            async def delete(self, run_id, tenant):
                service.deleted.append(run_id)

        self.checkpoints = type("C", (), {"snapshots": Snapshots()})()
        self.samplers, self.runs = Samplers(), Runs()


def test_what_expires_is_released_and_nothing_else():
    from server_mock.api.pytrio.state import TEMPORARY_WEIGHTS, PytrioState, SamplingRun, TrainingRun
    from server_mock.config import PytrioOptions
    from pytrio_compat.wire import LoraSpec

    now = [0.0]
    service = _FakeService()
    options = PytrioOptions(pytrio_max_sampling_runs=2, pytrio_sampling_run_ttl=100, pytrio_session_ttl=1000,
                            pytrio_run_idle_ttl=300)
    state = PytrioState(service, options, clock=lambda: now[0])
    session = state.new_session("t", "0.2.9")

    def sampling(cuid: str) -> SamplingRun:
        return state.add_sampling(SamplingRun(cuid, "t", session.cuid, 1, "tiny", "/m", "", f"s-{cuid}", now[0],
                                              now[0]), session)

    sampling("sr_1"), sampling("sr_2")
    state.sampling_run("sr_1", "t")  # used: sr_2 is now the least recently used
    sampling("sr_3")  # one past the per-key count
    assert service.dropped == ["s-sr_2"] and set(state.sampling["t"]) == {"sr_1", "sr_3"}
    assert state.sampling_cuids(session) == ["sr_1", "sr_3"]  # the one let go is no longer the session's
    run = state.add_training(TrainingRun("run-1", "t", session.cuid, 1, "tiny", "/m", LoraSpec(rank=8), "", False,
                                         now[0], now[0], init="ready"), session)
    service.snapshot_paths.add("trio://run-1/sampler/temp")
    state.keep_temporary("trio://run-1/sampler/temp", "t", session.cuid, ttl=50)
    now[0] = 50.0
    asyncio.run(state.sweep())  # the temporary weights' TTL
    assert "trio://run-1/sampler/temp" not in service.snapshot_paths and not state.temporary
    assert not state.sessions.leases(session.cuid, TEMPORARY_WEIGHTS)
    state.sampling_run("sr_3", "t")
    now[0] = 100.5
    asyncio.run(state.sweep())  # sr_1 idle 100.5 s > 100; sr_3 used at 50
    assert service.dropped == ["s-sr_2", "s-sr_1"] and list(state.sampling["t"]) == ["sr_3"]
    with pytest.raises(WorkerError):
        state.sampling_run("sr_1", "t")
    now[0] = 300.0
    asyncio.run(state.sweep())
    assert service.deleted == []  # last seen at 0: exactly at the idle TTL, kept
    now[0] = 300.5
    asyncio.run(state.sweep())
    assert service.deleted == ["run-1"] and "run-1" not in state.training
    with pytest.raises(WorkerError):
        state.tokens.resolve("Bearer " + run.token)  # its token is revoked with it
    now[0] = 1000.5
    asyncio.run(state.sweep())  # the session, idle past its TTL, closes with what is left
    assert session.cuid not in state.sessions and "t" not in state.sampling and service.dropped[-1] == "s-sr_3"


def test_closing_a_session_releases_what_it_leased_and_nothing_of_another():
    from server_mock.api.pytrio.state import TEMPORARY_WEIGHTS, PytrioState, SamplingRun, TrainingRun
    from server_mock.config import PytrioOptions
    from pytrio_compat.wire import LoraSpec

    service = _FakeService()
    state = PytrioState(service, PytrioOptions(), clock=lambda: 0.0)
    one, two = state.new_session("t", "0.2.9"), state.new_session("t", "0.2.9")
    for session, n in ((one, 1), (two, 2)):
        state.add_training(TrainingRun(f"run-{n}", "t", session.cuid, 1, "tiny", "/m", LoraSpec(rank=8), "", False,
                                       0.0, 0.0, init="ready"), session)
        state.add_sampling(SamplingRun(f"sr_{n}", "t", session.cuid, 1, "tiny", "/m", "", f"s-sr_{n}", 0.0, 0.0),
                           session)
        service.snapshot_paths.add(f"trio://run-{n}/sampler/temp")
        state.keep_temporary(f"trio://run-{n}/sampler/temp", "t", session.cuid, ttl=50)
    assert state.training_cuids(one) == ["run-1"] and state.sampling_cuids(two) == ["sr_2"]
    asyncio.run(state.close_session(one, "ENDED"))
    assert service.deleted == ["run-1"] and service.dropped == ["s-sr_1"]
    assert service.snapshot_paths == {"trio://run-2/sampler/temp"} and list(state.temporary) == [
        "trio://run-2/sampler/temp"]
    assert list(state.training) == ["run-2"] and list(state.sampling["t"]) == ["sr_2"]
    assert state.training_cuids(one) == [] and not state.sessions.leases(one.cuid, TEMPORARY_WEIGHTS)
    assert state.training_cuids(two) == ["run-2"] and state.sampling_cuids(two) == ["sr_2"]
    assert list(state.sessions.leases(two.cuid, TEMPORARY_WEIGHTS)) == ["trio://run-2/sampler/temp"]


def test_finished_answers_are_kept_within_count_bytes_and_time():
    from server_mock.api.pytrio.events import Event, EventTable

    async def nothing(event):
        return None

    async def scenario() -> None:
        base = time.monotonic()  # record() also prunes, by the clock
        forgotten = []  # what the table hands its ``forget`` (the run's records of them are deleted)
        table = EventTable(keep=3, ttl=100.0, execute=nothing, keep_bytes=270,
                           forget=lambda e: forgotten.append(e.event_id))
        events = []
        for i in range(5):
            event = Event(f"event_00000000000{i}", "trainer.forward", i + 1, b"")
            event.finish(b"x" * 60)
            event.ended = base + i
            table.record(event)
            events.append(event)
        table.prune(now=base)
        assert list(table.events) == [e.event_id for e in events[2:]]  # at most 3 (180 bytes)
        big = Event("event_0000000000zz", "trainer.forward", 6, b"")
        big.finish(b"y" * 200)
        big.ended = base + 5
        table.record(big)
        table.prune(now=base + 5)
        assert list(table.events) == [events[4].event_id, big.event_id]  # 320 > 270 bytes: the oldest go first
        waiting = Event("event_0000000000zy", "trainer.forward", 7, b"")
        table.record(waiting)  # unfinished: never forgotten
        table.prune(now=base + 104.5)
        assert list(table.events) == [big.event_id, waiting.event_id]  # ended at base + 4: more than 100 s ago
        assert table.next_index == 8
        assert forgotten == [e.event_id for e in events]  # each dropped event once, in the order dropped

    asyncio.run(scenario())
