"""The decode step of a batch: one token per row, stop handling, and compaction of the rows that ended.

``DecodeBatch`` decodes a ``BatchAdmission`` (batch_admission.py: how requests' prompts are prefilled into the
batch; batch_rows.py: its rows, stacked under the running batch as they join, and its finished requests).
``run`` advances every row one token per step until told to stop, so a caller can decode in slices and let other
work run in between; requests admitted meanwhile start between steps, and those that waited for the batch to end
are prefilled when it does. ``generate_batch`` is admit-then-run.

Rows that stop stay in the cache, fed their last token, until a quarter of the cache's rows are dead; then the
cache keeps only the live rows (one copy for several rows, instead of one per row). Their outputs are never
read, so nothing a live row computes depends on them. The cache's full-attention layers append in place
(``cache_rows.give_room``), sized for the longest remaining row. Where the cache cannot drop rows
(``SamplingSupport.shared_prefix``), they ride along until the batch ends.

A request's ``TokenStream`` (``SampleSpec.stream``, token_stream.py) is told each of its tokens as the step that
sampled it ends, and a cancelled one's rows end before the next step samples them.
"""

from __future__ import annotations

import logging
import time

import torch

from server_mock.sampling import cache_rows
from server_mock.sampling.batch_admission import BatchAdmission, forward
from server_mock.sampling.batch_rows import Row
from server_mock.sampling.logprobs import EvalMode
from server_mock.sampling.token_choice import next_tokens, stop_string_hit
from server_mock.sampling.token_stream import CANCELLED, stream_cancelled

logger = logging.getLogger("server_mock")

__all__ = ["DecodeBatch"]

# compact the cache when at most this fraction of its rows is live (dead rows cost compute until then)
_COMPACT_AT = 0.75


class DecodeBatch(BatchAdmission):
    """Requests decoding as one batch (see the module docstring). Not thread-safe: one thread drives it."""

    @property
    def decode_s(self) -> float:
        """Seconds spent in decode steps so far."""
        return self._clock

    def use_model(self, model) -> None:
        """Decode on ``model`` from the next step on (the cache and every row stay); fixed-shape steps end."""
        self._leave_static()
        self.static, self.model = None, model

    def run(self, stop=None) -> None:
        """Decode steps until no row is left or ``stop()`` (asked after every step, so a call makes at least one
        step) says to yield."""
        with torch.no_grad(), EvalMode(self.model):
            while self.active:
                if not self._live:
                    self._prefill_waiting()
                else:
                    self._step_started = time.perf_counter()
                    self._step()
                    self._clock += time.perf_counter() - self._step_started
                    self._step_started = 0.0
                if stop is not None and stop():
                    return

    def _step(self) -> None:
        if not self._drop_cancelled():
            self._batch_ended()
            return
        part = self._part
        started = time.perf_counter()
        if len(self._live) == len(part.rows):
            logits = part.step_logits
        else:
            where = {r: b for b, r in enumerate(part.rows)}
            logits = part.step_logits[[where[r] for r in self._live]]
        tokens, logprobs = next_tokens([self.rows[r] for r in self._live], logits)
        self._count("sample", started)
        started = time.perf_counter()
        going = []
        for r, t, lp in zip(self._live, tokens, logprobs):
            if self._record(r, t, lp):
                going.append(r)
        self._live = going
        self._count("record", started)
        if not going:
            self._batch_ended()
            return
        if self.support.shared_prefix and len(going) <= _COMPACT_AT * len(part.rows):
            started = time.perf_counter()
            self._leave_static()
            where = {r: b for b, r in enumerate(part.rows)}
            idx = torch.tensor([where[r] for r in going], dtype=torch.long, device=self.device)
            cache_rows.keep_rows(part.cache, idx)
            if part.mask is not None:
                part.mask = part.mask[idx]
            if part.positions is not None:
                part.positions = part.positions[idx]
            part.rows = list(going)
            cache_rows.give_room(part.cache, self._room())
            self._enter_static()
            self._count("compact", started)
        started = time.perf_counter()
        # rows that stopped ride along until the next compaction, fed their last token; their outputs are unread
        feed = torch.tensor([self.rows[r].tokens[-1] if self.rows[r].tokens else 0 for r in part.rows],
                            dtype=torch.long).to(self.device)
        if self._in_static:
            part.step_logits = self.static.step(feed)
            part.columns += 1
            self._count("forward", started)
            return
        if part.mask is not None:
            part.mask = torch.cat([part.mask, part.mask.new_ones((part.mask.shape[0], 1))], dim=1)
        positions = None if part.positions is None else part.positions[:, None]
        if self._images and positions is not None and self.vision.family.mrope:
            positions = positions[None].expand(3, -1, -1)  # text continues on all three M-RoPE axes
        self._select_rows([self.rows[r].request for r in part.rows], [not self.rows[r].done for r in part.rows])
        logits, part.cache = forward(self.model, feed[:, None], part.cache, 1, part.mask, positions)
        part.step_logits = logits[:, -1, :].float()
        part.columns += 1
        if part.positions is not None:
            part.positions = part.positions + 1
        self._count("forward", started)

    def _batch_ended(self) -> None:
        """No row is left decoding: drop the batch's state and prefill any requests that waited for it."""
        if self._in_static:
            self.static.active, self._in_static = None, False
        self._part = None
        self._prefill_waiting()

    def _record(self, r: int, token: int, logprob: float) -> bool:
        """Append a row's token; whether the row goes on generating."""
        row = self.rows[r]
        request = self.requests[row.request]
        row.tokens.append(token)
        row.logprobs.append(logprob)
        spec = row.spec
        if token in spec.stop_token_ids or (request.stops and stop_string_hit(self.tokenizer, row.tokens,
                                                                               request.stops, request.window)):
            row.reason = "stop"
        elif len(row.tokens) < spec.max_tokens:
            _tell(row, token, logprob, None)
            return True
        _tell(row, token, logprob, row.reason)
        self._end_row(row)
        return False

    def _end_row(self, row: Row) -> None:
        row.done = True
        request = self.requests[row.request]
        request.open_rows -= 1
        if request.open_rows == 0:
            self._finish(row.request)

    def _drop_cancelled(self) -> bool:
        """End the rows of requests whose stream was cancelled (before this step samples them); whether any row
        is left decoding."""
        ended = [r for r in self._live if stream_cancelled(self.rows[r].spec)]  # read once: another thread sets it
        if ended:
            for r in ended:
                self.rows[r].reason = CANCELLED
                self._end_row(self.rows[r])
            gone = set(ended)
            self._live = [r for r in self._live if r not in gone]
        return bool(self._live)


# --- a request's token stream (token_stream.py) -----------------------------------------------------------------


def _tell(row: Row, token: int, logprob: float, finished: str | None) -> None:
    stream = getattr(row.spec, "stream", None)
    if stream is None:
        return
    try:
        stream.token(row.sample, len(row.tokens) - 1, token, logprob, finished)
    except Exception:  # noqa: BLE001 - a listener's failure is its own; the batch decodes on
        logger.exception("a sample request's token stream failed")
