"""configure(): legacy keywords from published scripts are accepted, unknown ones only warn."""

from __future__ import annotations

import importlib
import warnings

import pytest

import pytrio_compat as trio
from pytrio_compat import config


def test_legacy_keywords_from_the_upstream_demos_do_not_fail(recwarn):
    trio.configure(actor_event_wait_timeout=600, actor_event_request_timeout=600, timeout=600)
    snap = config.snapshot()
    assert snap.request_timeout_seconds == 600
    assert snap.actor_event_submit_timeout_seconds == 600
    assert not [w for w in recwarn if "Unknown" in str(w.message)]
    trio.configure(timeout=30, actor_event_request_timeout=30, actor_event_wait_timeout=30)


def test_unknown_keyword_warns_and_is_ignored():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trio.configure(definitely_not_an_option=1)
    assert any("definitely_not_an_option" in str(w.message) for w in caught)


def test_environment_variables_set_key_and_url(monkeypatch):
    monkeypatch.setenv("PYTRIO_API_KEY", " key-123 ")
    monkeypatch.setenv("PYTRIO_BASE_URL", "http://127.0.0.1:9999/api/")
    saved = config.snapshot()
    try:
        importlib.reload(config)
        snap = config.snapshot()
        assert snap.api_key == "key-123" and snap.base_url == "http://127.0.0.1:9999"
    finally:
        config._CONFIG.api_key, config._CONFIG.base_url = saved.api_key, saved.base_url


def test_invalid_log_level_is_a_configuration_error():
    with pytest.raises(trio.PyTrioError, match="log level"):
        trio.configure(log_level="LOUD")


def test_public_names_match_pytrio():
    for name in ["ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "configure", "PyTrioError",
                 "AdamParams", "Datum", "ImageChunk", "ModelInput", "SamplingParams", "types",
                 "configure_observability", "shutdown_observability"]:
        assert hasattr(trio, name), name
    for name in ["TensorData", "EncodedTextChunk", "APIFuture", "SampleResponse", "SampleSequence",
                 "ForwardBackwardOutput", "OptimStepResponse", "SaveWeightsResponse", "SaveWeightsForSamplerResponse",
                 "GetServerCapabilitiesResponse", "Checkpoint", "TrainingRun"]:
        assert hasattr(trio.types, name), name
