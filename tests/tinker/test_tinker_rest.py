"""Tinker's REST API through the official SDK's ``RestClient`` against a real worker: training runs with the
``user_metadata`` given at creation, checkpoint listings, deletion, TTLs (expiry: 404 at once, gone from disk
after the sweep), sessions, the hosted-only refusals, and tenancy (another key's objects do not exist)."""

from __future__ import annotations

import time
import warnings
from datetime import UTC, datetime, timedelta

import pytest
import tinker
from tinker import types

KEY_A, KEY_B = "tml-rest-a", "tml-rest-b"


@pytest.fixture(scope="module")
def worker(worker_factory):
    return worker_factory("--checkpoint-sweep-seconds", "0.2", api_keys=[KEY_A, KEY_B])


def clients(worker, key: str, **kwargs):
    warnings.simplefilter("ignore", FutureWarning)
    sc = tinker.ServiceClient(base_url=worker.base_url, api_key=key, **kwargs)
    return sc, tinker.RestClient(base_url=worker.base_url, api_key=key)


def folder(worker, tinker_path: str):
    run, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return worker.storage / "checkpoints" / run / {"weights": "state", "sampler_weights": "sampler"}[kind] / name


def test_training_runs_keep_the_metadata_given_at_creation(worker):
    sc, rest = clients(worker, KEY_A)
    tc = sc.create_lora_training_client("tiny", rank=4, seed=1,
                                        user_metadata={"renderer_name": "role_colon", "step": 3}).result(60)
    state = tc.save_state("first", user_metadata={"loop": "7"}).result(60).path
    sampler = tc.save_weights_for_sampler("first-s").result(60).path
    run = rest.get_training_run_by_tinker_path(state).result(30)
    assert run.user_metadata == {"renderer_name": "role_colon", "step": "3"}  # values as text, the SDK's type
    assert run.base_model == "tiny" and run.lora_rank == 4 and run.is_lora and not run.corrupted
    assert run.last_checkpoint.tinker_path == state and run.last_checkpoint.user_metadata == {"loop": "7"}
    assert run.last_sampler_checkpoint.tinker_path == sampler
    assert abs(run.last_request_time - datetime.now(UTC)) < timedelta(minutes=1)
    assert "rest-a" not in run.model_owner  # a label, never the key
    assert rest.get_training_run(tc.model_id).result(30).training_run_id == run.training_run_id  # model ids too
    listed = rest.list_checkpoints(run.training_run_id).result(30)
    assert {(c.checkpoint_id, c.checkpoint_type) for c in listed.checkpoints} == \
        {("weights/first", "training"), ("sampler_weights/first-s", "sampler")}
    assert all(c.size_bytes > 0 and c.expires_at is None and not c.public for c in listed.checkpoints)
    # the session ends: the run is still known, from its checkpoints' metadata
    sc.close("success").result(30)
    again = rest.get_training_run(run.training_run_id).result(30)
    assert again.user_metadata == run.user_metadata and again.last_checkpoint.tinker_path == state
    runs = rest.list_training_runs(limit=1000).result(30)
    assert run.training_run_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count == len(runs.training_runs)
    checkpoint_utils = pytest.importorskip("tinker_cookbook.checkpoint_utils")  # its reader of the renderer name
    fresh, _ = clients(worker, KEY_A)
    assert checkpoint_utils.get_renderer_name_from_checkpoint(fresh, sampler) == "role_colon"
    fresh.close("success").result(30)


def test_user_checkpoints_pages_and_deletion(worker):
    sc, rest = clients(worker, KEY_A)
    tc = sc.create_lora_training_client("tiny", rank=4, seed=2).result(60)
    paths = [tc.save_state(f"page-{i}").result(60).path for i in range(3)]
    everything = rest.list_user_checkpoints(limit=1000).result(30)
    ordered = [c.tinker_path for c in everything.checkpoints]
    assert ordered.index(paths[2]) < ordered.index(paths[1]) < ordered.index(paths[0])  # newest first
    assert everything.cursor.total_count == len(ordered)
    first = rest.list_user_checkpoints(limit=1, offset=1).result(30)
    assert [c.tinker_path for c in first.checkpoints] == ordered[1:2] and first.cursor.offset == 1
    with pytest.raises(tinker.BadRequestError, match="limit"):
        rest.list_user_checkpoints(limit=1001).result(30)
    rest.delete_checkpoint_from_tinker_path(paths[0]).result(30)
    assert not folder(worker, paths[0]).exists()
    assert paths[0] not in [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result(30).checkpoints]
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(paths[0]).result(30)
    run_id = paths[1].split("/")[2]
    rest.delete_checkpoint(run_id, "weights/page-1").result(30)  # by run and checkpoint id
    assert not folder(worker, paths[1]).exists()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        sc.create_training_client_from_state(paths[1]).result(60)
    sc.close("success").result(30)


def test_ttl_bounds_visible_expiry_and_removal(worker):
    sc, rest = clients(worker, KEY_A)
    tc = sc.create_lora_training_client("tiny", rank=4, seed=3).result(60)
    path = tc.save_state("ttl").result(60).path
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 3599).result(30)
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 10 * 365 * 86400 + 1).result(30)
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result(30)
    (entry,) = [c for c in rest.list_checkpoints(path.split("/")[2]).result(30).checkpoints if c.tinker_path == path]
    assert abs(entry.expires_at - (datetime.now(UTC) + timedelta(seconds=3600))) < timedelta(seconds=60)
    rest.set_checkpoint_ttl_from_tinker_path(path, 10 * 365 * 86400).result(30)  # the upper bound itself
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result(30)
    (entry,) = [c for c in rest.list_checkpoints(path.split("/")[2]).result(30).checkpoints if c.tinker_path == path]
    assert entry.expires_at is None
    sc.close("success").result(30)


def test_an_expired_checkpoint_is_gone_at_once_and_from_disk_after_the_sweep(worker):
    sc, rest = clients(worker, KEY_A)
    tc = sc.create_lora_training_client("tiny", rank=4, seed=4).result(60)
    short = tc.save_state("short", ttl_seconds=2).result(60).path
    weights = tc.save_weights_for_sampler("short-s", ttl_seconds=2).result(60).path
    sampler = sc.create_sampling_client(model_path=weights)
    prompt = types.ModelInput.from_ints([1, 2, 3])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result(60)  # the weights are now in memory
    (entry,) = [c for c in rest.list_checkpoints(short.split("/")[2]).result(30).checkpoints if c.tinker_path == short]
    assert entry.expires_at is not None
    deadline = time.monotonic() + 30
    while folder(worker, short).exists() or folder(worker, weights).exists():  # the sweeper runs every 0.2 s
        assert time.monotonic() < deadline
        time.sleep(0.1)
    listed = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result(30).checkpoints]
    assert short not in listed and weights not in listed
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(short).result(30)
    with pytest.raises(tinker.RequestFailedError, match="gone|no checkpoint"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result(60)
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(short).result(30)
    sc.close("success").result(30)


def test_expiry_answers_404_before_the_sweep(tiny_model_dir, tmp_path):
    """With the sweeper's default minute, an expired checkpoint is already absent while its folder remains."""
    from support import running_worker

    with running_worker(tiny_model_dir, tmp_path, api_keys=[KEY_A], in_process=True) as worker:
        sc, rest = clients(worker, KEY_A)
        tc = sc.create_lora_training_client("tiny", rank=4, seed=5).result(60)
        path = tc.save_state("soon", ttl_seconds=1).result(60).path
        time.sleep(1.2)
        assert folder(worker, path).exists()
        with pytest.raises(tinker.NotFoundError):
            rest.get_weights_info_by_tinker_path(path).result(30)
        assert path not in [c.tinker_path for c in rest.list_user_checkpoints().result(30).checkpoints]
        with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
            sc.create_training_client_from_state(path).result(60)
        assert tc.save_state("soon").result(60).path == path  # the name is free again
        sc.close("success").result(30)


def test_another_keys_runs_and_checkpoints_do_not_exist(worker):
    sc_a, rest_a = clients(worker, KEY_A)
    tc = sc_a.create_lora_training_client("tiny", rank=4, seed=6, user_metadata={"owner": "a"}).result(60)
    path = tc.save_state("private").result(60).path
    run_id = path.split("/")[2]
    sc_b, rest_b = clients(worker, KEY_B)
    for call in (lambda: rest_b.get_training_run(run_id), lambda: rest_b.get_training_run(tc.model_id),
                 lambda: rest_b.list_checkpoints(run_id), lambda: rest_b.delete_checkpoint_from_tinker_path(path),
                 lambda: rest_b.set_checkpoint_ttl_from_tinker_path(path, 7200),
                 lambda: rest_b.get_session(sc_a.holder._session_id)):
        with pytest.raises(tinker.NotFoundError):
            call().result(30)
    assert run_id not in [r.training_run_id for r in rest_b.list_training_runs(limit=1000).result(30).training_runs]
    assert path not in [c.tinker_path for c in rest_b.list_user_checkpoints(limit=1000).result(30).checkpoints]
    assert sc_a.holder._session_id not in rest_b.list_sessions(limit=1000).result(30).sessions
    assert folder(worker, path).exists() and rest_a.get_training_run(run_id).result(30).user_metadata == {"owner": "a"}
    sc_a.close("success").result(30)
    sc_b.close("success").result(30)


def test_sessions(worker):
    sc, rest = clients(worker, KEY_A, user_metadata={"recipe": "rest-test"})
    tc = sc.create_lora_training_client("tiny", rank=4, seed=7).result(60)
    sampler = tc.save_weights_and_get_sampling_client().result(60)
    session_id = sc.holder._session_id
    info = rest.get_session(session_id).result(30)
    assert info.user_metadata == {"recipe": "rest-test"}
    assert info.training_run_ids == [rest.get_training_run(tc.model_id).result(30).training_run_id]
    assert sampler._sampling_session_id in info.sampler_ids
    assert session_id in rest.list_sessions(limit=1000).result(30).sessions
    found = rest.search_sessions(types.SessionSearchRequest(user_metadata={"recipe": "rest-test"})).result(30)
    assert [s.session_id for s in found.sessions] == [session_id] and found.sessions[0].status.type == "active"
    none = rest.search_sessions(types.SessionSearchRequest(user_metadata={"recipe": "other"})).result(30)
    assert none.sessions == []
    sc.close("success").result(30)
    with pytest.raises(tinker.NotFoundError):
        rest.get_session(session_id).result(30)


def test_hosted_only_features_are_refused_with_their_reason(worker, monkeypatch):
    sc, rest = clients(worker, KEY_A)
    session_id = sc.holder._session_id
    tc = sc.create_lora_training_client("tiny", rank=4, seed=8).result(60)
    path = tc.save_state("hosted").result(60).path
    with pytest.raises(tinker.BadRequestError, match="projects"):
        rest.assign_session_project(session_id, "proj").result(30)
    with pytest.raises(RuntimeError, match="trace export"):
        rest.export_session_trace(session_id).result(30)
    monkeypatch.setenv("TINKER_PROJECT_ID", "proj")
    with pytest.raises(tinker.BadRequestError, match="copies between projects"):
        rest.copy_weights(path).result(30)
    with pytest.raises(tinker.BadRequestError, match="audit log"):
        rest.get_audit_log().result(30)
    with pytest.raises(tinker.BadRequestError, match="billing"):
        rest.get_billing_usage("2026-01-01", "2026-02-01").result(30)
    with pytest.raises(tinker.BadRequestError, match="billing"):
        rest.get_current_checkpoint_storage_usage().result(30)
    with pytest.raises(tinker.BadRequestError, match="publishing is not supported"):
        rest.publish_checkpoint_from_tinker_path(path).result(30)
    with pytest.raises(tinker.BadRequestError, match="publishing is not supported"):
        rest.unpublish_checkpoint_from_tinker_path(path).result(30)
    with pytest.raises(tinker.BadRequestError, match="projects"):
        rest.list_training_runs(project_id="proj").result(30)
    with pytest.raises(RuntimeError, match="JWT"):
        rest.whoami().result(30)
    sc.close("success").result(30)


@pytest.mark.slow
def test_the_tinker_cli_lists_describes_and_deletes(worker):
    """The SDK's own CLI (``tinker run list``, ``checkpoint list/info/set-ttl/delete``) on the REST routes (slow:
    each command is a process that imports the SDK)."""
    import json
    import os
    import subprocess
    import sys

    sc, rest = clients(worker, KEY_A)
    tc = sc.create_lora_training_client("tiny", rank=4, seed=9, user_metadata={"renderer_name": "qwen3"}).result(60)
    path = tc.save_state("cli").result(60).path
    run_id = path.split("/")[2]
    env = {**os.environ, "TINKER_BASE_URL": worker.base_url, "TINKER_API_KEY": KEY_A, "TINKER_TELEMETRY": "0"}

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tinker.cli", "--format", "json", *args], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert run_id in [r["training_run_id"] for r in json.loads(cli("run", "list", "--limit", "0"))["runs"]]
    info = json.loads(cli("run", "info", run_id))
    assert info["training_run_id"] == run_id and info["user_metadata"] == {"renderer_name": "qwen3"}
    listed = json.loads(cli("checkpoint", "list", "--run-id", run_id))["checkpoints"]
    assert [c["tinker_path"] for c in listed] == [path]
    assert json.loads(cli("checkpoint", "info", path))["tinker_path"] == path
    cli("checkpoint", "set-ttl", path, "--ttl", "7200")
    assert json.loads(cli("checkpoint", "info", path))["expires_at"] is not None
    cli("checkpoint", "delete", path, "--yes")
    assert not folder(worker, path).exists()
    sc.close("success").result(30)
