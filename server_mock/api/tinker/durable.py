"""What the Tinker front end records under ``--durability full`` (in the service's database, as protocol records),
so that a worker started again on the same storage takes up the SDK's sessions where they were
(``api/tinker/restart.py``).

- a session, when created (its labels); deleted when it finishes;
- a training model, once its run exists: the run, its session, its ``model_seq_id`` and the id and answer of the
  future that created it (so a re-sent ``create_model`` gets that future back);
- a sampling session, when created: the sampler behind it.

The ops of a model are not recorded here: each is journaled by the service with its Tinker seq_id, future id and
``answers.Answer`` (``OpRow.front``), and each ``asample`` with what its answer needs, before the client gets the
future's id. Heartbeats are not recorded (a restored session counts as seen at the restart).
With ``--durability checkpoint-only`` nothing is recorded (every method does nothing).
"""

from __future__ import annotations

import time

from server_mock.service.journal import FrontRecords

SESSIONS = "tinker.session"
MODELS = "tinker.model"
SAMPLING = "tinker.sampling_session"


class TinkerJournal(FrontRecords):
    def session_created(self, session) -> None:
        self.put(SESSIONS, session.session_id, session.tenant, {
            "created": session.created, "user_metadata": session.user_metadata, "display_name": session.display_name})

    def session_finished(self, session_id: str) -> None:
        self.delete(SESSIONS, session_id)
        self.delete_prefix(MODELS, f"{session_id}:")  # model ids are <session_id>:train:<n>
        self.delete_prefix(SAMPLING, f"{session_id}:")

    def model_registered(self, model, model_seq_id: int, request_id: str, answer: dict) -> None:
        self.put(MODELS, model.model_id, model.tenant, {
            "run_id": model.run_id, "session_id": model.session_id, "base_model": model.base_model,
            "user_metadata": model.user_metadata, "model_seq_id": model_seq_id, "request_id": request_id,
            "answer": answer, "created": time.time()})

    def sampling_session(self, session, seq_id: int, sampler_id: str) -> None:
        self.put(SAMPLING, f"{session.session_id}:{seq_id}", session.tenant, {"sampler_id": sampler_id})
