"""PyTRIO event bodies: an envelope holds only the keys the SDK sends (any other is refused, naming it, before
anything is recorded), a large body is decoded within the worker's parse budget (``--max-parsing-bytes``: large
events of all runs wait for it in turn, as large JSON bodies do), and the journal's records of events are written
off the event loop."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest

from server_mock.api.pytrio import actor
from server_mock.api.pytrio.durable import PytrioJournal
from server_mock.config import Limits

from .reliability_helpers import KEY_A, on_event_loop
from .tenant_worker import worker

sys.path.insert(0, str(Path(__file__).parents[1] / "pytrio"))  # the raw PyTRIO client of tests/pytrio
import pytrio_raw  # noqa: E402

PAD = 2 << 20  # a body above bodies.BIG_BODY_BYTES: decoded in a worker thread


def body(run, **extra) -> bytes:
    envelope = pytrio_raw.envelope("trainer.forward", {"data": []}, run.index, run.cuid)
    for key, value in extra.items():
        where, _, name = key.rpartition("__")
        (envelope[where] if where else envelope)[name] = value
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with worker(tiny_model_dir, tmp_path_factory.mktemp("events")) as (base, app):
        yield base, app


def test_unknown_envelope_and_metadata_keys_are_refused_naming_the_key(served, tiny_model_dir, monkeypatch):
    base, _app = served
    recorded = []
    monkeypatch.setattr(PytrioJournal, "put", lambda self, *args: recorded.append(args))
    raw = pytrio_raw.RawClient(base, KEY_A)
    run = raw.training_run(raw.session())
    recorded.clear()
    for key, field in (("pad1", "pad1"), ("metadata__pad2", "metadata.pad2")):
        response = run.submit_bytes(body(run, **{key: b"\0" * 1024}))
        assert response.status_code == 400, response.text
        assert field in response.json()["message"] and "unknown key" in response.json()["message"]
        assert response.json()["field"] == field
    assert recorded == []  # refused before anything was recorded
    # the same envelope with only the SDK's keys (every one of them: pytrio_raw.envelope sends all) is taken
    answer = run.run("trainer.init_run", {"base_model": str(tiny_model_dir.resolve()), "lora_config": {
        "rank": 2, "train_mlp": True, "train_attn": True, "train_unembed": True}})
    assert answer["status"] == "succeeded", answer
    raw.close()


def test_event_records_are_written_off_the_event_loop(served, tiny_model_dir, monkeypatch):
    base, _app = served
    where: list[bool] = []
    real = PytrioJournal.event

    def watched(self, *args, **kwargs):
        where.append(on_event_loop())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PytrioJournal, "event", watched)
    raw = pytrio_raw.RawClient(base, KEY_A)
    run = raw.training_run(raw.session())
    assert run.run("trainer.optimize_step", {"adam_params": {}})["status"] == "failed"  # refused: recorded
    init = run.run("trainer.init_run", {"base_model": str(tiny_model_dir.resolve()), "lora_config": {
        "rank": 2, "train_mlp": True, "train_attn": True, "train_unembed": True}})  # its body: recorded
    assert init["status"] == "succeeded"
    assert where and not any(where), where
    raw.close()


@pytest.mark.parametrize("both_fit", [True, False])
def test_large_events_are_decoded_within_the_parse_budget(tiny_model_dir, tmp_path, monkeypatch, both_fit):
    lock, inside, peak, peer = threading.Lock(), [0], [0], threading.Event()
    real = actor.decode_event

    def watched(raw: bytes, limits):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            if inside[0] == 2:
                peer.set()
        peer.wait(5 if both_fit else 1.5)  # the other one decodes meanwhile if the budget lets it
        with lock:
            inside[0] -= 1
        return real(raw, limits)

    monkeypatch.setattr(actor, "decode_event", watched)
    with worker(tiny_model_dir, tmp_path / "storage", limits=Limits()) as (base, app):
        raw = pytrio_raw.RawClient(base, KEY_A)
        session = raw.session()
        runs = [raw.training_run(session), raw.training_run(session)]
        bodies = [body(run, payload__pad=b"\0" * PAD) for run in runs]
        sizes = sum(len(b) for b in bodies)
        app.state.parse_budget.limit = sizes if both_fit else sizes - 1  # at the bound, and one byte under it
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda pair: pair[0].submit_bytes(pair[1]), zip(runs, bodies)))
        raw.close()
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]  # (a forward with no datums)
    assert peak[0] == (2 if both_fit else 1)
