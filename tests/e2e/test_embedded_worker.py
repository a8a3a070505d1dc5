"""ServiceClient() with no base URL starts a worker for the process and stops it on close()."""

from __future__ import annotations

import pytrio_compat as trio
from pytrio_compat import config


def test_service_client_without_base_url_starts_and_stops_a_local_worker(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTRIO_BASE_URL", raising=False)
    monkeypatch.setattr(config._CONFIG, "base_url", "")
    monkeypatch.setenv("PYTRIO_COMPAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTRIO_EMBEDDED_STORAGE", str(tmp_path / "storage"))
    client = trio.ServiceClient()
    embedded = client._embedded
    try:
        assert embedded is not None and embedded.process.poll() is None
        assert client.base_url.startswith("http://127.0.0.1:")
        tc = client.create_lora_training_client(str(tiny_model_dir), rank=4, seed=0)  # loaded on first use
        assert str(tiny_model_dir) in client.get_supported_models()
        ids = tc.get_tokenizer().encode("2 + 2 = 4")
        out = tc.forward_backward([trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                                              loss_fn_inputs={"target_tokens": ids[1:]})]).result()
        assert out.metrics["token_count"] == len(ids) - 1
        # the embedded worker requires the key the SDK generated for it
        import httpx

        assert httpx.get(client.base_url + "/v1/capabilities").status_code == 401
    finally:
        client.close()
    assert embedded.process.poll() is not None
