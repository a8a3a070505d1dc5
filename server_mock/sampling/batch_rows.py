"""A decode batch's rows and requests, and the state that the decode step (decode_batch.py) advances.

``BatchRows`` keeps each request's sample rows (``Row``) and the batch's cache. A request's rows wait for its prefill
(batch_admission.py), which hands them to ``_begin``: expanded to their live sample rows, they become the batch or,
if one is already decoding, are stacked under it (``cache_rows.stack``: columns right-aligned, the attention mask
hiding the padding, exactly as if all had been prefilled together). A request cancelled before it is admitted (its
``TokenStream``, token_stream.py) ends at once, without a prefill; an admission that fails is withdrawn, leaving none
of its requests behind. ``take_finished`` hands back each request (``Finished``) as soon as its last row ends.

Where a model's cache cannot do something (``SamplingSupport``, found by the load-time probe), the slower
path keeps the results exact: no shared prefill (each row prefills its own copy; rows never leave), no padded
batch (requests decode one after another), no stacking (a request waits until the running batch ends).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from server_mock.sampling import cache_rows
from server_mock.sampling.token_choice import row_seed
from server_mock.sampling.token_stream import CANCELLED, stream_cancelled

__all__ = ["BatchRows", "FULL_SUPPORT", "Finished", "Row", "SamplingSupport"]


@dataclass(frozen=True)
class SamplingSupport:
    """Which decoding paths a model's cache can take (``engine.support.probe_sampling`` finds out).

    ``shared_prefix``: a prompt is prefilled once and its cache expanded to the sample rows, and stopped rows
    are dropped (``Cache.reorder_cache``); otherwise every row prefills its own copy of the prompt and stopped
    rows ride along until the batch ends. ``padded_batch``: several prompts can be prefilled and decoded
    together, left-padded under an attention mask; otherwise coalesced requests run one after another.
    ``join_running``: a request prefilled while a batch decodes can join that batch (``cache_rows.stack``);
    otherwise it waits for the batch to end. ``prefix_reuse``: a prompt's cache is the same whether the prompt was
    prefilled whole or as a stored prefix's copy followed by the rest (full attention only; off unless the probe
    showed it), so ``DecodeBatch`` may use a ``prefix_store``.
    """

    shared_prefix: bool = True
    padded_batch: bool = True
    join_running: bool = True
    prefix_reuse: bool = False


FULL_SUPPORT = SamplingSupport()


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


@dataclass
class Row:
    """One sample row: its request, its generator and what it has produced so far."""

    request: int
    spec: object
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str = "length"
    done: bool = False
    sample: int = 0  # the row's index among its request's samples


@dataclass
class _Request:
    spec: object
    rows: list[int]
    stops: list[str]
    window: int
    prompt_info: tuple = (None, None)
    open_rows: int = 0
    prefill_s: float = 0.0
    decode_started: float = 0.0  # the batch's decode clock when the request's rows started
    tag: str = ""  # the weights its rows decode with, for a model that serves rows of several (``select_rows``)


@dataclass
class Finished:
    """A request whose rows have all ended: its rows (tokens, logprobs, stop reason), prompt logprobs, times."""

    handle: int
    rows: list[Row]
    prompt_logprobs: list | None
    topk_prompt_logprobs: list | None
    prefill_s: float
    decode_s: float


class _Part:
    """A batch's decoding state: cache, next-token logits, mask and next positions (None when unpadded)."""

    def __init__(self, cache, step_logits, mask, positions, columns: int, rows: list[int]):
        self.cache, self.step_logits, self.mask, self.positions = cache, step_logits, mask, positions
        self.columns = columns  # cache columns (the padded length so far)
        self.rows = rows  # the sample row in each cache position


class BatchRows:
    """A decode batch's rows, requests and cache: how rows start, stack under the batch and end (see the module
    docstring). ``BatchAdmission`` (batch_admission.py) prefills into it, ``DecodeBatch`` (decode_batch.py)
    decodes it. Not thread-safe: one thread drives it."""

    def __init__(self, model, tokenizer=None, support: SamplingSupport = FULL_SUPPORT,
                 profile: dict[str, float] | None = None, static=None, vision=None) -> None:
        self.model, self.tokenizer, self.support = model, tokenizer, support
        # an image-text model's image processing (engine.vision.ImageProcessing): prompts with images are prefilled
        # with their pixels (prompt_images.py); once one has joined, every step passes explicit positions (M-RoPE)
        self.vision = vision
        self._images = False
        # fixed-shape steps (static_steps.StaticSteps: CUDA graphs on a GPU), or None for the dynamic path
        self.static = static
        self._in_static = False
        self.device = _model_device(model)
        self.rows: list[Row] = []
        self.requests: dict[int, _Request] = {}
        self._waiting: list[int] = []  # admitted, not yet prefilled (the batch cannot take them yet)
        self._finished: list[Finished] = []
        self._part: _Part | None = None
        self._live: list[int] = []  # rows still generating, in cache order
        self._clock = 0.0  # decode seconds so far
        self.profile = profile  # where the time goes (seconds per phase), if given
        self.prefill_s = 0.0
        self._step_started = 0.0

    # --- what is in the batch ------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Rows are decoding or requests wait to be prefilled."""
        return bool(self._live or self._waiting)

    @property
    def live_rows(self) -> int:
        return len(self._live)

    def can_join(self) -> bool:
        """Whether a request admitted now starts at the next step (rather than waiting for the batch to end)."""
        if self._part is None and not self._waiting:
            return True
        return self.support.padded_batch and self.support.join_running and not self._waiting

    @property
    def has_finished(self) -> bool:
        """Some request ended since the last ``take_finished``."""
        return bool(self._finished)

    def take_finished(self) -> list[Finished]:
        out, self._finished = self._finished, []
        return out

    # --- rows entering and leaving the batch ------------------------------------------------------------------

    def _add_requests(self, specs: list, tag: str, tags: list[str] | None) -> list[int]:
        """The requests' rows, each request waiting for its prefill (one cancelled while it was queued ends now);
        their handles (``admit``'s arguments)."""
        handles = []
        for i, spec in enumerate(specs):
            handle = len(self.requests)
            seed = spec.seed if spec.seed is not None else random.SystemRandom().getrandbits(63)
            stops = [s for s in spec.stop_strings if s]
            # a newly completed stop string lies in the last (its byte length) tokens, each token >= 1 byte; a
            # few extra tokens cover decoders that strip a leading space
            window = max((len(s.encode("utf-8")) for s in stops), default=0) + 4
            request = _Request(spec, [], stops, window, tag=tag if tags is None else tags[i])
            for r in range(spec.num_samples):
                gen = None
                if spec.temperature != 0:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed(row_seed(seed, r))
                request.rows.append(len(self.rows))
                self.rows.append(Row(handle, spec, gen, sample=r))
            self.requests[handle] = request
            handles.append(handle)
            if stream_cancelled(spec):  # its client went away while it was queued: it ends here, never prefilled
                for r in request.rows:
                    self.rows[r].reason, self.rows[r].done = CANCELLED, True
                self._finish(handle)
            else:
                self._waiting.append(handle)
        return handles

    def _withdraw(self, handles: list[int]) -> None:
        """A failed admission leaves none of its requests behind: none waits, decodes or is reported finished (rows
        already stacked under the batch ride along unread until the next compaction, as stopped rows do)."""
        gone = set(handles)
        rows = {r for h in handles for r in self.requests[h].rows}
        for r in rows:
            self.rows[r].done = True
        self._waiting = [h for h in self._waiting if h not in gone]
        self._live = [r for r in self._live if r not in rows]
        self._finished = [f for f in self._finished if f.handle not in gone]

    def _begin(self, handles: list[int], prefill_of_row: dict[int, int], prefilled: int, cache, step_logits,
               mask, lengths, explicit: bool, columns: int, started: float) -> None:
        """The requests' rows start decoding from their prefill (``prefilled`` cache rows, ``prefill_of_row``: each
        sample row's): expanded to their live sample rows, made the batch or stacked under it."""
        new_rows = [r for h in handles for r in self.requests[h].rows]
        live = [r for r in new_rows if self.rows[r].spec.max_tokens > 0]
        for r in new_rows:
            self.rows[r].done = self.rows[r].spec.max_tokens <= 0
        if self.support.shared_prefix:  # one cache row per request so far: expand to its live sample rows
            index = [prefill_of_row[r] for r in live]
            rows = list(live)
        else:  # every row has its own cache row; rows with nothing to generate ride along
            index, rows = list(range(len(new_rows))), list(new_rows)
        part = None
        if live:
            if index != list(range(prefilled)):
                idx = torch.tensor(index, dtype=torch.long, device=self.device)
                cache_rows.keep_rows(cache, idx)
                step_logits = step_logits[idx]
                if mask is not None:
                    mask = mask[idx]
                lengths = lengths[idx]
            part = _Part(cache, step_logits, mask, lengths if explicit else None, columns, rows)
        elapsed = time.perf_counter() - started
        self.prefill_s += elapsed
        for h in handles:
            request = self.requests[h]
            request.prefill_s, request.decode_started = elapsed, self._clock
            request.open_rows = sum(1 for r in request.rows if not self.rows[r].done)
            if request.open_rows == 0:
                self._finish(h)
        if part is not None:
            self._join(part, live)

    def _join(self, part: _Part, live: list[int]) -> None:
        """Make ``part`` the batch, or stack it under the running one."""
        run = self._part
        if run is None:
            self._part = part
        else:
            self._leave_static()
            columns = max(run.columns, part.columns)
            if (run.mask is None and part.mask is None and run.columns == part.columns
                    and run.positions is None and part.positions is None):
                mask = positions = None
            else:
                n_run = len(run.rows)
                mask = torch.zeros((n_run + len(part.rows), columns), dtype=torch.long, device=self.device)
                mask[:n_run, columns - run.columns:] = 1 if run.mask is None else run.mask
                mask[n_run:, columns - part.columns:] = 1 if part.mask is None else part.mask
                positions = torch.cat([self._positions(run), self._positions(part)])
            started = time.perf_counter()
            cache_rows.stack(run.cache, part.cache, columns, 0)
            self._count("stack", started)
            run.step_logits = torch.cat([run.step_logits, part.step_logits])
            run.mask, run.positions, run.columns = mask, positions, columns
            run.rows = run.rows + part.rows
        self._live.extend(live)
        cache_rows.give_room(self._part.cache, self._room())
        self._enter_static()

    def _enter_static(self) -> None:
        part = self._part
        if self.static is None or self._in_static or self._images or not self.static.supports(part.cache):
            return  # a batch that took an image decodes on the dynamic path (its explicit M-RoPE positions)
        self.static.load(part.cache, part.mask, part.positions, part.columns, self._room())
        self._in_static = True

    def _leave_static(self) -> None:
        if self._in_static:
            part = self._part
            part.mask, part.positions, part.columns = self.static.unload(part.cache, self._room())
            self._in_static = False

    def _positions(self, part: _Part) -> torch.Tensor:
        """Each cache row's next position (an unpadded part's rows are at its column count)."""
        if part.positions is not None:
            return part.positions
        return torch.full((len(part.rows),), part.columns, dtype=torch.long, device=self.device)

    def _room(self) -> int:
        return max((self.rows[r].spec.max_tokens - len(self.rows[r].tokens) for r in self._live), default=0)

    # --- shared by admission and the decode step -----------------------------------------------------------------

    def _count(self, phase: str, started: float) -> None:
        if self.profile is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.profile[phase] = self.profile.get(phase, 0.0) + time.perf_counter() - started

    def _select_rows(self, handles: list[int], live: list[bool] | None = None) -> None:
        """Tell a model that serves rows of several weights (``select_rows``) each row's tag and request (-1 for a
        row whose output is unread)."""
        select = getattr(self.model, "select_rows", None)
        if select is not None:
            live = live or [True] * len(handles)
            select([self.requests[h].tag for h in handles], [h if ok else -1 for h, ok in zip(handles, live)])

    def _finish(self, handle: int) -> None:
        request = self.requests[handle]
        in_step = time.perf_counter() - self._step_started if self._step_started else 0.0
        self._finished.append(Finished(handle, [self.rows[r] for r in request.rows], request.prompt_info[0],
                                       request.prompt_info[1], request.prefill_s,
                                       self._clock + in_step - request.decode_started))
