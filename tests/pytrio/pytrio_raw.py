"""A raw client of the PyTRIO protocol for tests that must send what the SDK never sends (hostile bodies, one
call as one event, a connection cut mid-poll): Control calls with an API key, Actor calls with a run's token,
event bodies packed here with msgpack."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import msgpack

ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
MSGPACK = "application/msgpack"


def event_id() -> str:
    return "event_" + "".join(secrets.choice(ALPHABET) for _ in range(12))


def envelope(kind: str, payload: dict, index: int, run_id: str, eid: str | None = None) -> dict:
    return {"version": 1, "event_id": eid or event_id(), "type": kind, "payload": payload,
            "metadata": {"index": index, "step": 0, "timestamp": 0, "sdk": "raw", "sdk_version": "0", "run_id": run_id}}


def datum(tokens: list[int], targets: list[int], **inputs: list[float]) -> dict:
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}, "target_ids": targets, **inputs}


def totals(samples: int, active: int, advantage: int = 0) -> dict:
    return {"total_samples": samples, "total_active_tokens": active, "total_advantage_tokens": advantage}


class Run:
    """One training run of the raw client: its token and the next event index."""

    def __init__(self, client: RawClient, created: dict) -> None:
        self.client, self.created = client, created
        self.cuid = created["training_run_cuid"]
        self.token = created["actor_jwt"]["token"]
        self.index = 1

    def headers(self, content_type: str | None = MSGPACK) -> dict:
        out = {"Authorization": f"Bearer {self.token}", "Accept": MSGPACK}
        if content_type:
            out["Content-Type"] = content_type
        return out

    def submit_bytes(self, body: bytes, content_type: str | None = MSGPACK) -> httpx.Response:
        return self.client.http.post("/pytrio-actor/v1/events", content=body, headers=self.headers(content_type))

    def submit(self, kind: str, payload: dict, eid: str | None = None, index: int | None = None) -> dict:
        """Submit one event (the next index unless told) and return the decoded answer; the index moves on as the
        SDK's does, once the submit is answered."""
        body = msgpack.packb(envelope(kind, payload, self.index if index is None else index, self.cuid, eid),
                             use_bin_type=True)
        response = self.submit_bytes(body)
        assert response.status_code == 200, response.text
        if index is None:
            self.index += 1
        return msgpack.unpackb(response.content, raw=False)

    def poll(self, eid: str, wait: int = 30) -> dict:
        response = self.client.http.get(f"/pytrio-actor/v1/events/{eid}", headers={**self.headers(None),
                                                                                     "Prefer": f"wait={wait}"})
        assert response.status_code == 200, response.text
        return msgpack.unpackb(response.content, raw=False)

    def run(self, kind: str, payload: dict, eid: str | None = None) -> dict:
        """Submit and poll until the event ends; its final answer."""
        answer = self.submit(kind, payload, eid)
        while answer["status"] in ("accepted", "running"):
            answer = self.poll(answer["event_id"])
        return answer

    def init(self, model_id: str, rank: int = 8, seed: int = 7, **extra: Any) -> dict:
        lora = {"rank": rank, "seed": seed, "train_mlp": True, "train_attn": True, "train_unembed": True}
        return self.run("trainer.init_run", {"base_model": model_id, "lora_config": lora, **extra})


class RawClient:
    def __init__(self, base_url: str, key: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=60,
                                 headers={"X-API-Key": key, "Authorization": f"Bearer {key}"})

    def close(self) -> None:
        self.http.close()

    def control(self, method: str, path: str, **kwargs) -> httpx.Response:
        return self.http.request(method, "/api/openapi/v1" + path, **kwargs)

    def session(self) -> str:
        response = self.control("POST", "/service-sessions", json={"sdk_version": "raw"})
        assert response.status_code == 200, response.text
        return response.json()["service_session_cuid"]

    def training_run(self, session: str, model: str = "tiny", rank: int = 8, seed: int = 7, **body: Any) -> Run:
        response = self.control("POST", f"/service-sessions/{session}/training-runs",
                                json={"base_model": model, "lora_rank": rank, "train_mlp": True, "train_attn": True,
                                      "train_unembed": True, "source_checkpoint_uri": "", "restore_optimizer": False,
                                      "seed": seed, **body})
        assert response.status_code == 200, response.text
        return Run(self, response.json())

    def sampling_run(self, session: str, model: str = "tiny", uri: str = "") -> dict:
        response = self.control("POST", f"/service-sessions/{session}/sampling-runs",
                                json={"base_model": model, "source_checkpoint_uri": uri})
        assert response.status_code == 200, response.text
        return response.json()


class Session:
    """A service session of the raw client, closed (its runs released) when the block ends."""

    def __init__(self, client: RawClient) -> None:
        self.client = client
        self.cuid = client.session()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.client.control("POST", f"/service-sessions/{self.cuid}/close", json={"status": "ENDED"})

    def training_run(self, **kwargs: Any) -> Run:
        return self.client.training_run(self.cuid, **kwargs)

    def sampling_run(self, **kwargs: Any) -> dict:
        return self.client.sampling_run(self.cuid, **kwargs)
