"""An abandoned Tinker session (its client gone: no heartbeat, no request) is finished by the clock, after
--tinker-session-ttl, with no other client's activity: its training models are deleted and the --max-adapters
slots they held are free again. The clock is a fake one, moved by the test."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from starlette.testclient import TestClient
from support import FakeClock

from pytrio_compat.wire import CreateTrainingRun, LoraSpec
from server_mock.api.auth import Auth
from server_mock.api.tinker.router import TinkerProtocol
from server_mock.app import create_app
from server_mock.config import Limits, StorageOptions, TinkerOptions
from server_mock.errors import WorkerError
from server_mock.service.worker import WorkerService

TTL = 60.0


def one_adapter_service(model_dir, storage) -> WorkerService:
    return WorkerService({"tiny": str(model_dir)}, storage, "cpu", torch.float32, limits=Limits(max_adapters=1),
                         storage_options=StorageOptions(durability="checkpoint-only"))


def spec() -> CreateTrainingRun:
    return CreateTrainingRun(base_model="tiny", lora=LoraSpec(rank=4, seed=1))


@pytest.mark.timeout(120)
def test_an_idle_session_expires_at_its_ttl_and_frees_its_adapter_slot(tiny_model_dir, tmp_path):
    service = one_adapter_service(tiny_model_dir, tmp_path / "storage")
    clock = FakeClock(1_000_000.0)
    tinker = TinkerProtocol(service, Auth([]), options=TinkerOptions(tinker_session_ttl=TTL), clock=clock)
    state = tinker.state

    async def scenario():
        session = state.new_session("sess-abandoned", "A")
        run = await service.runs.create(spec(), "A")
        await state.register(session, "sess-abandoned:train:0", run.run_id, "tiny")
        with pytest.raises(WorkerError) as full:  # the worker's one adapter slot is the abandoned session's
            await service.runs.create(spec(), "B")
        assert full.value.code == "too_many_adapters"

        clock.now += TTL  # idle exactly the TTL: kept
        await tinker.sweep()
        assert list(state.sessions) == ["sess-abandoned"] and service.runs.owned("A")
        clock.now += 0.001  # one past it: finished by the sweep, nobody else called anything
        await tinker.sweep()
        assert len(state.sessions) == 0 and state.models == {} and service.runs.owned("A") == []
        other = await service.runs.create(spec(), "B")  # the slot is free
        assert service.runs.owned("B") == [other]

    try:
        asyncio.run(scenario())
    finally:
        service.stop()


@pytest.mark.timeout(120)
def test_a_seen_session_is_kept_and_the_app_sweeps_by_itself(tiny_model_dir, tmp_path, monkeypatch):
    service = one_adapter_service(tiny_model_dir, tmp_path / "storage")
    app = create_app(service, tinker_options=TinkerOptions(tinker_session_ttl=TTL))
    monkeypatch.setattr(app.state.fronts["tinker"], "sweep_seconds", 0.01)
    clock = FakeClock(1_000_000.0)
    state = app.state.tinker.state
    state.clock = clock
    with TestClient(app, base_url="http://127.0.0.1") as http:  # the app's lifespan runs the sweeps
        kept = http.post("/api/v1/create_session", json={"tags": [], "type": "create_session"}).json()["session_id"]
        idle = http.post("/api/v1/create_session", json={"tags": [], "type": "create_session"}).json()["session_id"]
        clock.now += TTL - 1
        beat = http.post("/api/v1/session_heartbeat", json={"session_id": kept, "type": "session_heartbeat"})
        assert beat.status_code == 200, beat.text
        clock.now += 2  # idle: TTL + 1 s without anything; kept: 2 s since its heartbeat
        deadline = time.monotonic() + 30
        while idle in state.sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(state.sessions) == [kept]
        gone = http.post("/api/v1/session_heartbeat", json={"session_id": idle, "type": "session_heartbeat"})
        assert gone.status_code == 410, gone.text  # the SDK stops beating
