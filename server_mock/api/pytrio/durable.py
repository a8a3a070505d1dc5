"""What the PyTRIO front end records under ``--durability full`` (in the service's database, as protocol records),
so that a worker started again on the same storage takes up the SDK's sessions, runs and events where they were
(``api/pytrio/restart.py``).

- a service session, when created; deleted when it is closed;
- a training run, when created and whenever what a restart needs of it changes (its checkpoint before the first
  event, its init state, its token's expiry); deleted when it is released, with its events;
- a sampling run, when created (the service's sampler behind it); deleted when it is released;
- temporary sampler weights, when saved (their expiry; the weights are the service's snapshot);
- an event whose answer does not come from a service op: a failed one (before the SDK sees the answer), a
  ``trainer.init_run`` (its body, before it is acknowledged), and any event that could not be handed to the
  service before its acknowledgement (its body, so that it runs after a restart).

The events that became service ops are not recorded here: the service journals each op with its event id, index,
body digest and what its answer needs (``OpRow.front``) before the op is acknowledged, and its result when it ends.
A sample request is journaled by the service with its request id and answer flags in the same way.

Actor tokens are recorded as their SHA-256 only (as they are held in memory): a token the SDK holds keeps working
after a restart, but the worker cannot hand it out again, so a renewal then mints a new one.
Heartbeats are not recorded: a restored run or session counts as seen at the restart.
With ``--durability checkpoint-only`` nothing is recorded (every method does nothing).
"""

from __future__ import annotations

import base64
import dataclasses

from server_mock.service.journal import FrontRecords

SESSIONS = "pytrio.session"
TRAINING = "pytrio.training_run"
SAMPLING = "pytrio.sampling_run"
TEMPORARY = "pytrio.temporary"
EVENTS = "pytrio.event"


def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


class PytrioJournal(FrontRecords):
    def session(self, session) -> None:
        self.put(SESSIONS, session.cuid, session.tenant, {"sdk_version": session.sdk_version,
                                                          "created": session.created})

    def session_closed(self, cuid: str) -> None:
        self.delete(SESSIONS, cuid)

    def training_run(self, run, token: tuple[str, float] | None) -> None:
        """``token``: the run's token digest (hex) and expiry."""
        self.put(TRAINING, run.cuid, run.tenant, {
            "session": run.session_cuid, "run_index": run.run_index, "alias": run.alias, "model_id": run.model_id,
            "lora": run.lora.model_dump(), "source_uri": run.source_uri, "restore_optimizer": run.restore_optimizer,
            "created": run.created, "init": run.init, "status": run.status, "token": list(token) if token else None})

    def training_released(self, cuid: str) -> None:
        self.delete(TRAINING, cuid)
        self.delete_prefix(EVENTS, f"{cuid}:")

    def sampling_run(self, run, token: tuple[str, float] | None) -> None:
        self.put(SAMPLING, run.cuid, run.tenant, {
            "session": run.session_cuid, "run_index": run.run_index, "alias": run.alias, "model_id": run.model_id,
            "source_uri": run.source_uri, "sampler_id": run.sampler_id, "created": run.created,
            "token": list(token) if token else None})

    def sampling_released(self, cuid: str) -> None:
        self.delete(SAMPLING, cuid)

    def temporary(self, path: str, weights) -> None:
        self.put(TEMPORARY, path, weights.tenant, dataclasses.asdict(weights))

    def temporary_dropped(self, path: str) -> None:
        self.delete(TEMPORARY, path)

    def event(self, run, event, body: bytes | None = None) -> None:
        """An event as it is now: its answer once it has one, else ``body`` (the submitted bytes) to run it again."""
        if self.on:
            self.put(EVENTS, f"{run.cuid}:{event.event_id}", run.tenant, {
                "index": event.index, "type": event.type, "digest": event.digest.hex(), "answer": b64(event.answer),
                "body": b64(body) if event.answer is None else None})
            event.recorded = True

    def event_forgotten(self, run_cuid: str, event) -> None:
        if event.recorded:
            self.delete(EVENTS, f"{run_cuid}:{event.event_id}")
