"""Every option configure() accepts takes effect, checked on the requests the SDK sends to a real worker;
PyTRIO options without a counterpart here, and bad values, are refused before anything changes."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import httpx
import pytest

import pytrio_compat as trio
from pytrio_compat import config
from pytrio_compat.errors import APIError, ConfigurationError, ConnectionFailedError


class Recorder(httpx.AsyncBaseTransport):
    """Passes requests to the worker; records their timeouts and how many sample / training requests were
    submitted and not yet finished at once. Can fail the tokenizer download and slow down polls."""

    def __init__(self, fail_tokenizer: int = 0, poll_delay: float = 0.0, fail_suffix: str | None = None,
                 unreachable_tokenizer: int = 0) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.fail_tokenizer, self.poll_delay, self.fail_suffix = fail_tokenizer, poll_delay, fail_suffix
        self.unreachable_tokenizer = unreachable_tokenizer  # tokenizer requests refused a connection first
        self.failed_at: list[float] = []  # when each request ending in fail_suffix was answered 503
        self.requests: list[tuple[str, str, float | None, dict]] = []
        self.tokenizer_attempts = 0
        self.active: dict[str, set[str]] = {"sample": set(), "op": set()}
        self.most: dict[str, int] = {"sample": 0, "op": 0}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append((request.method, path, request.extensions["timeout"]["read"],
                              dict(request.url.params)))
        if self.fail_suffix and path.endswith(self.fail_suffix):
            self.failed_at.append(time.monotonic())
            return httpx.Response(503, json={"error": {"code": "unavailable", "message": "injected"}})
        if path == "/v1/tokenizer" and self.unreachable_tokenizer:
            self.unreachable_tokenizer -= 1
            raise httpx.ConnectError("All connection attempts failed", request=request)
        if path == "/v1/tokenizer":
            self.tokenizer_attempts += 1
            if self.tokenizer_attempts <= self.fail_tokenizer:
                return httpx.Response(503, json={"error": {"code": "unavailable", "message": "injected"}})
        if path.startswith("/v1/requests/") and self.poll_delay:
            await asyncio.sleep(self.poll_delay)
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        kind = "sample" if path.endswith("/sample") else "op" if path.endswith("/ops") else None
        if kind and response.status_code == 200:
            self.active[kind].add(json.loads(body)["request_id"])
            self.most[kind] = max(self.most[kind], len(self.active[kind]))
        if path.startswith("/v1/requests/") and json.loads(body).get("status") in ("succeeded", "failed"):
            for ids in self.active.values():
                ids.discard(path.rsplit("/", 1)[1])
        headers = [(k, v) for k, v in response.headers.items() if k.lower() not in ("content-length",
                                                                                    "content-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=body)


@pytest.fixture(autouse=True)
def restore_config(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTRIO_COMPAT_CACHE", str(tmp_path / "cache"))
    saved = config.snapshot()
    yield
    config._CONFIG.__dict__.update(saved.__dict__)


def _datum() -> trio.Datum:
    return trio.Datum(model_input=trio.ModelInput.from_ints([5, 6, 7, 8]),
                      loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})


def test_timeouts_reach_the_requests_they_govern(worker):
    trio.configure(request_timeout_seconds=7, actor_event_submit_timeout_seconds=3,
                   actor_event_polling_timeout_seconds=2)
    rec = Recorder()
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        trainer = service.create_lora_training_client(base_model="tiny", rank=4)
        trainer.forward([_datum()]).result()
        service.create_sampling_client(base_model="tiny").sample(
            trio.ModelInput.from_ints([5, 6]), sampling_params=trio.SamplingParams(max_tokens=2)).result()
    by_path = {(method, path.rsplit("/", 1)[1]): timeout for method, path, timeout, _ in rec.requests}
    assert by_path[("GET", "health")] == 7
    assert by_path[("POST", "ops")] == 3 and by_path[("POST", "sample")] == 3
    polls = [(timeout, params) for method, path, timeout, params in rec.requests if "/v1/requests/" in path]
    assert polls and all(params["wait"] in ("2", "2.0") and timeout == 32 for timeout, params in polls)


def test_retry_max_attempts_bounds_the_tokenizer_download(worker):
    trio.configure(retry_max_attempts=2, retry_initial_delay_seconds=0.01)
    rec = Recorder(fail_tokenizer=5)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        with pytest.raises(APIError) as info:
            service.create_sampling_client(base_model="tiny").get_tokenizer()
    assert info.value.status_code == 503 and rec.tokenizer_attempts == 2
    trio.configure(retry_max_attempts=3)
    rec = Recorder(fail_tokenizer=2)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        tokenizer = service.create_sampling_client(base_model="tiny").get_tokenizer()
    assert rec.tokenizer_attempts == 3 and len(tokenizer) > 0


def test_retry_max_attempts_leaves_out_a_worker_that_cannot_be_reached(worker):
    # a worker that is restarting refuses connections: those are no attempts of the download, so the tokenizer
    # comes once it is back (five refusals, then 503 and an answer: attempts 2 of 2) ...
    trio.configure(retry_max_attempts=2, retry_initial_delay_seconds=0.01, retry_max_delay_seconds=0.02)
    rec = Recorder(unreachable_tokenizer=5, fail_tokenizer=1)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        tokenizer = service.create_sampling_client(base_model="tiny").get_tokenizer()
    assert rec.unreachable_tokenizer == 0 and rec.tokenizer_attempts == 2 and len(tokenizer) > 0
    # ... within the control retry window, which still ends the wait for one that never comes back
    trio.configure(control_retry_timeout_seconds=0.3)
    rec = Recorder(unreachable_tokenizer=10**6)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        sampler = service.create_sampling_client(base_model="tiny")
        started = time.monotonic()
        with pytest.raises(ConnectionFailedError, match="get_tokenizer"):
            sampler.get_tokenizer()
    assert rec.tokenizer_attempts == 0 and time.monotonic() - started >= 0.3


def test_backoff_options_shape_the_retries_and_each_window_ends_them(worker, caplog):
    trio.configure(retry_initial_delay_seconds=0.05, retry_multiplier=3, retry_max_delay_seconds=0.3,
                   retry_jitter_ratio=0, control_retry_timeout_seconds=1.0)
    rec = Recorder(fail_suffix="/capabilities")
    sdk_logger = logging.getLogger("pytrio_compat")  # the SDK's own logger does not propagate to the root
    level = sdk_logger.level
    sdk_logger.addHandler(caplog.handler)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        sdk_logger.setLevel(logging.DEBUG)
        started = time.monotonic()
        with pytest.raises(APIError) as info:
            service.get_server_capabilities()
        elapsed = time.monotonic() - started
    sdk_logger.removeHandler(caplog.handler)
    sdk_logger.setLevel(level)
    assert info.value.status_code == 503 and 0.9 < elapsed < 1.6
    # the delays the client asked for, as it logged them (not wall-clock gaps, which load stretches)
    asked = [float(m.group(1)) for r in caplog.records
             if (m := re.match(r"retrying .* in ([0-9.]+)s after", r.getMessage()))]
    expected = [0.05, 0.15, 0.3, 0.3]  # x3 each time, capped at 0.3, no jitter
    assert asked[:4] == expected, asked
    assert len(rec.failed_at) == len(asked) + 1  # one more attempt than waits: the last one ends the window
    for window, suffix, call in [
        ("sampling_retry_timeout_seconds", "/sample",
         lambda s: s.create_sampling_client(base_model="tiny").sample(
             trio.ModelInput.from_ints([5]), sampling_params=trio.SamplingParams(max_tokens=1)).result()),
        ("training_retry_timeout_seconds", "/ops",
         lambda s: s.create_lora_training_client(base_model="tiny", rank=4).forward([_datum()]).result()),
    ]:
        trio.configure(**{window: 0.4})
        rec = Recorder(fail_suffix=suffix)
        with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
            with pytest.raises(APIError):
                call(service)
        assert 0.3 < rec.failed_at[-1] - rec.failed_at[0] < 0.7, (window, rec.failed_at)


def test_log_level_sets_the_sdk_logger():
    import logging

    logger = logging.getLogger("pytrio_compat")
    before = logger.level
    try:
        trio.configure(log_level="debug")
        assert logger.level == logging.DEBUG
        trio.configure(log_level="WARNING")
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("limit, expected", [(2, 2), (16, 6)])
def test_sampling_request_max_in_flight(worker, limit, expected):
    trio.configure(sampling_request_max_in_flight=limit)
    rec = Recorder(poll_delay=0.3)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        sampler = service.create_sampling_client(base_model="tiny")

        async def main():
            params = trio.SamplingParams(max_tokens=2, seed=1)
            return await asyncio.gather(*(sampler.sample_async(trio.ModelInput.from_ints([5, 6 + i]),
                                                               sampling_params=params) for i in range(6)))

        assert len(asyncio.run(main())) == 6
    assert rec.most["sample"] == expected


@pytest.mark.parametrize("limit, expected", [(1, 1), (16, 4)])
def test_training_event_max_in_flight(worker, limit, expected):
    trio.configure(training_event_max_in_flight=limit)
    rec = Recorder(poll_delay=0.3)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        trainer = service.create_lora_training_client(base_model="tiny", rank=4)
        futures = [trainer.forward([_datum()]) for _ in range(4)]
        assert all(f.result().metrics["loss_sum"] > 0 for f in futures)
    assert rec.most["op"] == expected


def test_sampling_timeout_legacy_keyword_bounds_a_sample_call(worker):
    trio.configure(sampling_timeout=0.5)  # PyTRIO 0.2.8's name for sampling_timeout_seconds
    assert config.snapshot().sampling_timeout_seconds == 0.5
    rec = Recorder(poll_delay=3.0)
    with trio.ServiceClient(base_url=worker.base_url, _transport=rec) as service:
        sampler = service.create_sampling_client(base_model="tiny")
        started = time.monotonic()
        with pytest.raises(APIError) as info:
            sampler.sample(trio.ModelInput.from_ints([5, 6]),
                           sampling_params=trio.SamplingParams(max_tokens=2)).result()
    assert time.monotonic() - started < 2.5
    assert info.value.code == "actor.sampling.total_timeout" and info.value.retryable is False


@pytest.mark.parametrize("option", sorted(config._UNSUPPORTED))
def test_pytrio_options_without_a_counterpart_are_refused(option):
    before = config.snapshot()
    with pytest.raises(ConfigurationError) as info:
        trio.configure(retry_max_attempts=9, **{option: 1})
    assert info.value.code == "configuration.unsupported_option" and option in info.value.message
    assert config.snapshot() == before  # nothing changed, not even the valid option beside it


def test_options_that_ask_for_nothing_are_accepted():
    trio.configure(actor_heartbeat_enabled=False)
    with pytest.raises(ConfigurationError):
        trio.configure(actor_heartbeat_enabled=True)


@pytest.mark.parametrize("option, value", [
    ("retry_max_attempts", 0), ("training_event_max_in_flight", 2.5), ("sampling_request_max_in_flight", True),
    ("sampling_timeout_seconds", -1), ("request_timeout_seconds", "30"), ("retry_multiplier", 0.5),
    ("actor_event_polling_timeout_seconds", float("inf")), ("log_level", "LOUD"),
])
def test_bad_values_are_refused(option, value):
    before = config.snapshot()
    with pytest.raises(ConfigurationError) as info:
        trio.configure(**{option: value})
    assert info.value.code == "configuration.invalid_value"
    assert option in info.value.message or "log level" in info.value.message
    assert config.snapshot() == before
