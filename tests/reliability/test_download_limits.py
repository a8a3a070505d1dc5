"""The bounds of downloads, each at the limit and one past it: a signed URL's lifetime (valid through its
expiry second, refused after), the flag's minimum, and the number of archives built at once; archives of
one checkpoint are built once however many clients ask at the same time."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import server_mock.api.downloads as downloads_module
from server_mock.api.auth import Auth
from server_mock.api.downloads import MAX_TTL_SECONDS, Downloads, Served
from server_mock.cli import build_parser
from server_mock.config import Limits
from server_mock.flags import from_args
from server_mock.errors import WorkerError
from server_mock.storage import archive as archive_module
from server_mock.storage.archive import Archives
from server_mock.storage.checkpoints import CheckpointRef, CheckpointStore


def app_with(downloads: Downloads, tmp_path) -> TestClient:
    (tmp_path / "file.bin").write_bytes(b"0123456789")
    downloads.register("files", lambda ref, tenant: Served(tmp_path / ref, ref, "v1") if tenant == "t"
                       else (_ for _ in ()).throw(WorkerError(404, "not_found", "no")))

    async def issue(request: Request):
        ttl = float(request.query_params["ttl"])
        url, expires = await downloads.url_for(request, "files", "file.bin", "t", ttl=ttl)
        return JSONResponse({"url": url, "expires": expires.timestamp()})

    app = Starlette(routes=[Route("/issue", issue), *downloads.routes()])
    app.state.auth = Auth([])
    return TestClient(app)


def test_a_url_is_valid_through_its_expiry_second_and_refused_after(tmp_path, monkeypatch):
    client = app_with(Downloads(), tmp_path)
    now = 1_800_000_000.0
    monkeypatch.setattr(downloads_module.time, "time", lambda: now)
    issued = client.get("/issue", params={"ttl": 60}).json()
    assert issued["expires"] == now + 60
    for offset, status in ((0, 200), (60, 200), (61, 403)):
        monkeypatch.setattr(downloads_module.time, "time", lambda o=offset: now + o)
        answer = client.get(issued["url"])
        assert answer.status_code == status, offset
    assert answer.json()["error"]["code"] == "download_url_expired"


def test_url_lifetimes_are_bounded(tmp_path):
    client = app_with(Downloads(), tmp_path)
    assert client.get("/issue", params={"ttl": MAX_TTL_SECONDS}).status_code == 200
    with pytest.raises(WorkerError, match="a download URL lives"):
        client.get("/issue", params={"ttl": MAX_TTL_SECONDS + 1})
    parser = build_parser()
    assert from_args(Limits, parser.parse_args(["serve", "--download-url-seconds", "60"])).download_url_seconds == 60
    with pytest.raises(ValueError, match="--download-url-seconds must be >= 60"):
        from_args(Limits, parser.parse_args(["serve", "--download-url-seconds", "59"]))
    from server_mock.cli import check_limits
    week = from_args(Limits, parser.parse_args(["serve", "--download-url-seconds", "604800"]))
    assert check_limits(week) is None
    longer = from_args(Limits, parser.parse_args(["serve", "--download-url-seconds", "604801"]))
    assert "--download-url-seconds must be at most 604800" in check_limits(longer)
    assert from_args(Limits, parser.parse_args(["serve", "--max-archive-builds", "1"])).max_archive_builds == 1
    with pytest.raises(ValueError, match="--max-archive-builds must be >= 1"):
        from_args(Limits, parser.parse_args(["serve", "--max-archive-builds", "0"]))


def test_a_url_signed_by_another_worker_process_is_refused(tmp_path):
    url = app_with(Downloads(), tmp_path).get("/issue", params={"ttl": 60}).json()["url"]
    answer = app_with(Downloads(), tmp_path).get(url)  # a new process draws a new key
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "invalid_download_url"


def saved(store: CheckpointStore, name: str) -> CheckpointRef:
    ref = CheckpointRef("run-1", "sampler", name)
    store.write(ref, {"tenant": "t"}, {"adapter_model.safetensors": {"w": torch.ones(4)}},
                {"adapter_config.json": "{}"})
    return ref


@pytest.mark.parametrize("limit", [1, 2])
def test_archive_builds_at_the_limit_and_one_past_it(tmp_path, monkeypatch, limit):
    store = CheckpointStore(tmp_path)
    archives = Archives(store, max_builds=limit)
    refs = [saved(store, f"c{i}") for i in range(limit + 1)]
    release, started = threading.Event(), threading.Semaphore(0)
    real_build = Archives._build

    def slow_build(self, ref):
        started.release()
        release.wait(10)
        real_build(self, ref)

    monkeypatch.setattr(Archives, "_build", slow_build)
    threads = [threading.Thread(target=archives.ensure, args=(ref,)) for ref in refs[:limit]]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert started.acquire(timeout=10)
    with pytest.raises(WorkerError) as busy:  # one past the limit, while `limit` builds run
        archives.ensure(refs[limit])
    assert busy.value.status == 429 and "max_archive_builds" in busy.value.message
    release.set()
    for thread in threads:
        thread.join(10)
    assert all(archives.path(ref).is_file() for ref in refs[:limit])
    assert archives.ensure(refs[limit]).is_file()  # a slot is free again


def test_concurrent_requests_for_one_checkpoint_build_it_once(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    archives = Archives(store, max_builds=1)
    ref = saved(store, "shared")
    builds = []
    real_build = Archives._build

    def counted(self, r):
        builds.append(r)
        time.sleep(0.2)
        real_build(self, r)

    monkeypatch.setattr(Archives, "_build", counted)
    results, errors = [], []

    def fetch():
        try:
            results.append(archives.ensure(ref))
        except WorkerError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not errors and len(builds) == 1 and len(set(results)) == 1  # the others waited, none got 429


def test_an_archive_built_while_its_checkpoint_is_replaced_is_not_served(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    archives = Archives(store, max_builds=1)
    ref = saved(store, "racing")
    real_info = archive_module._info
    replaced = []

    def replace_midway(name, size, mtime):
        if name == archive_module.MARKER and not replaced:
            replaced.append(True)
            store.write(ref, {"tenant": "t"}, {"adapter_model.safetensors": {"w": torch.zeros(4)}},
                        {"adapter_config.json": "{}"}, overwrite=True)
        return real_info(name, size, mtime)

    monkeypatch.setattr(archive_module, "_info", replace_midway)
    with pytest.raises(WorkerError) as gone:
        archives.ensure(ref)
    assert gone.value.status == 404 and "overwritten" in gone.value.message
    assert not archives.path(ref).exists()  # the new version has no archive of the old one


def test_the_url_lifetime_flag_is_at_most_seven_days(monkeypatch):
    import server_mock.service.worker as worker_module
    from server_mock.cli import serve

    class Reached(Exception):
        pass

    def stop(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(worker_module, "WorkerService", stop)  # past every flag check: nothing is loaded
    parser = build_parser()
    with pytest.raises(Reached):
        serve(parser.parse_args(["serve", "--model", "m=/nowhere", "--download-url-seconds", "604800"]))
    with pytest.raises(SystemExit, match="at most 604800"):
        serve(parser.parse_args(["serve", "--model", "m=/nowhere", "--download-url-seconds", "604801"]))
