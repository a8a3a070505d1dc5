"""How requests enter a decode batch and leave it, and the batch's state that the decode step (decode_batch.py)
advances.

``BatchAdmission.admit`` prefills new requests (each distinct prompt once; several prompts together, left-padded)
and, if a batch is already decoding, stacks their rows under it (``cache_rows.stack``: columns right-aligned, the
attention mask hiding the padding, exactly as if all had been prefilled together). A request cancelled before it is
admitted (its ``TokenStream``, token_stream.py) ends at once, without a prefill; an admission that fails leaves none
of its requests behind. ``take_finished`` hands back each request as soon as its last row ends.

With a ``prefix_store`` (prefix_store.py, where ``SamplingSupport.prefix_reuse``), a prompt that continues a stored
prefix of its weights, or shares one with recent prompts (then prefilled once, as one row, and stored), prefills only
its own tokens, against a copy of the prefix's cache: one forward for the requests of one prefix, their tokens
left-padded after the prefix (the padding hidden by the mask, positions explicit), as if each had been prefilled
whole. Prompts with images or asking for prompt logprobs are prefilled whole.

Where a model's cache cannot do something (``SamplingSupport``, found by the load-time probe), the slower
path keeps the results exact: no shared prefill (each row prefills its own copy; rows never leave), no padded
batch (requests decode one after another), no stacking (a request waits until the running batch ends).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from server_mock.sampling import cache_rows, prompt_images
from server_mock.sampling.prefix_store import RECENT_PROMPTS, entry_key
from server_mock.sampling.logprobs import EvalMode, prompt_logprobs
from server_mock.sampling.token_choice import row_seed
from server_mock.sampling.token_stream import CANCELLED, stream_cancelled

__all__ = ["BatchAdmission", "FULL_SUPPORT", "Finished", "Row", "SamplingSupport", "forward"]


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


def forward(model, input_ids: torch.Tensor, cache, logits_to_keep: int = 0, attention_mask=None, position_ids=None,
            **extra):
    """A causal-LM forward with the cache (transformers 5.24 renamed ``past_key_values=``: ``cache=``); ``extra``:
    an image-text model's image inputs."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep,
                attention_mask=attention_mask, position_ids=position_ids, **extra)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:  # pragma: no cover - older output classes
        new_cache = getattr(out, "past_key_values", None)
    return out.logits, new_cache


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


def _left_padded(prompts: list[list[int]], device: torch.device):
    """Token ids, attention mask and position ids of prompts left-padded to one length (mask None if equal)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.long)
    ids = ids.to(device)
    if all(len(p) == longest for p in prompts):
        return ids, None, None
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        mask[b, longest - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


class _Part:
    """A batch's decoding state: cache, next-token logits, mask and next positions (None when unpadded)."""

    def __init__(self, cache, step_logits, mask, positions, columns: int, rows: list[int]):
        self.cache, self.step_logits, self.mask, self.positions = cache, step_logits, mask, positions
        self.columns = columns  # cache columns (the padded length so far)
        self.rows = rows  # the sample row in each cache position


class BatchAdmission:
    """A decode batch's state and how requests enter and leave it (see the module docstring); ``DecodeBatch``
    (decode_batch.py) decodes it. Not thread-safe: one thread drives it."""

    def __init__(self, model, tokenizer=None, support: SamplingSupport = FULL_SUPPORT,
                 profile: dict[str, float] | None = None, static=None, vision=None, prefix_store=None) -> None:
        self.model, self.tokenizer, self.support = model, tokenizer, support
        # prompt prefixes' caches kept across requests (prefix_store.PrefixStore), used where ``support.prefix_reuse``
        self.prefix_store = prefix_store
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

    # --- admitting requests ------------------------------------------------------------------------------------

    def admit(self, specs: list, tag: str = "", tags: list[str] | None = None) -> list[int]:
        """Queue requests into the batch; they are prefilled now where the batch can take them. Their handles.
        ``tag``: which weights their rows use where the model decodes rows of several (``select_rows``); ``tags``:
        each request's, where they differ."""
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
        try:
            with torch.no_grad(), EvalMode(self.model):
                self._prefill_waiting()
        except BaseException:
            self._withdraw(handles)
            raise
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

    def _prefill_waiting(self) -> None:
        if not self._waiting:
            return
        if self._part is not None and not (self.support.padded_batch and self.support.join_running):
            return  # they start when the running batch ends
        take = self._waiting if self.support.padded_batch else self._waiting[:1]
        self._waiting = self._waiting[len(take):]
        self._prefill(take)

    def _prefill(self, handles: list[int]) -> None:
        if self._reuses_prefixes():
            handles = self._prefill_on_prefixes(handles)
        if handles:
            self._prefill_full(handles)

    def _prefill_full(self, handles: list[int]) -> None:
        """Prefill the requests' whole prompts, together (left-padded), and start their rows."""
        started = time.perf_counter()
        specs = [self.requests[h].spec for h in handles]
        new_rows = [r for h in handles for r in self.requests[h].rows]
        # rows of the prefill batch: one per request, or one per sample row where the cache cannot be expanded
        if self.support.shared_prefix:
            prefill_of_row = {r: i for i, h in enumerate(handles) for r in self.requests[h].rows}
            prompts = [s.prompt_tokens for s in specs]
        else:
            prefill_of_row = {r: i for i, r in enumerate(new_rows)}
            prompts = [self.rows[r].spec.prompt_tokens for r in new_rows]
        ids, mask, positions = _left_padded(prompts, self.device)
        want_prompt = any(s.include_prompt_logprobs or s.topk_prompt_logprobs > 0 for s in specs)
        prefill_specs = specs if self.support.shared_prefix else [self.rows[r].spec for r in new_rows]
        images = None
        if any(getattr(s, "images", ()) for s in prefill_specs):
            if self.vision is None:
                raise ValueError("a prompt with images needs the model's image processing")
            images = prompt_images.prefill(self.vision, prefill_specs, ids, mask, positions,
                                           [len(p) for p in prompts])
        self._select_rows(list(handles) if self.support.shared_prefix else [self.rows[r].request for r in new_rows])
        if images is None:
            logits, cache = forward(self.model, ids, None, 0 if want_prompt else 1, mask, positions)
            self._count("prefill", started)
        else:
            self._images = True
            self._leave_static()
            logits, cache = forward(self.model, ids, None, 0 if want_prompt else 1, mask, **images.prefill_inputs)
        for h, spec in zip(handles, specs):
            request = self.requests[h]
            if spec.include_prompt_logprobs or spec.topk_prompt_logprobs > 0:
                b = prefill_of_row[request.rows[0]]
                offset = ids.shape[1] - len(prompts[b])
                request.prompt_info = prompt_logprobs(logits[b, offset:], ids[b, offset:],
                                                      spec.include_prompt_logprobs, spec.topk_prompt_logprobs)
        step_logits = logits[:, -1, :].float()
        del logits
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        explicit = mask is not None
        if images is not None and images.next_positions is not None:  # the text after an image (M-RoPE: + delta)
            lengths, explicit = images.next_positions, True
        self._begin(handles, prefill_of_row, len(prompts), cache, step_logits, mask, lengths, explicit,
                    ids.shape[1], started)

    # --- prompts that continue a stored prefix (prefix_store.py) ----------------------------------------------

    def _reuses_prefixes(self) -> bool:
        support = self.support
        return (self.prefix_store is not None and support.prefix_reuse and support.shared_prefix
                and support.padded_batch and support.join_running and self.vision is None and not self._images)

    @staticmethod
    def _may_reuse(spec) -> bool:
        """A request whose prompt may continue a stored prefix: text only, no prompt logprobs, tokens to make."""
        return (spec.max_tokens > 0 and not getattr(spec, "images", ()) and not spec.include_prompt_logprobs
                and spec.topk_prompt_logprobs <= 0)

    def _prefill_on_prefixes(self, handles: list[int]) -> list[int]:
        """Prefill the requests whose prompts continue a stored prefix, or share one with recent prompts of their
        weights (then prefilled once and stored), in one group per prefix; the handles left for a full prefill."""
        store = self.prefix_store
        groups: dict[tuple, list] = {}  # (weights key, prefix tokens) -> [entry or None, length, weights key, handles]
        taken: set[int] = set()
        eligible = [h for h in handles if self._may_reuse(self.requests[h].spec)]
        for h in eligible:
            request = self.requests[h]
            prompt = request.spec.prompt_tokens
            key = store.weights_key(self.model, request.tag)
            entry = store.lookup(key, prompt)
            if entry is not None:
                group = groups.setdefault(entry_key(entry), [entry, len(entry.tokens), key, []])
            else:
                group = next((g for (k, tokens), g in groups.items() if k == key and g[0] is None
                              and len(tokens) < len(prompt) and tuple(prompt[:len(tokens)]) == tokens), None)
                if group is None:
                    arriving = [self.requests[o].spec.prompt_tokens for o in eligible
                                if o != h and self.requests[o].tag == request.tag][:RECENT_PROMPTS]
                    n = store.shared_length(key, prompt, arriving)
                    if n:
                        group = groups.setdefault((key, tuple(prompt[:n])), [None, n, key, []])
            store.remember(key, prompt)
            if group is not None:
                group[3].append(h)
                taken.add(h)
        for entry, n, key, members in groups.values():
            if not self._prefill_suffixes(entry, n, key, members):
                taken.difference_update(members)
        return [h for h in handles if h not in taken]

    def _prefill_suffixes(self, entry, n: int, key: tuple, handles: list[int]) -> bool:
        """Prefill the prompts' tokens after their shared ``n``-token prefix against copies of its cache (``entry``,
        or prefilled now as one row and stored), and start their rows; False if the prefix's cache cannot be
        copied (then nothing was started)."""
        started = time.perf_counter()
        store = self.prefix_store
        specs = [self.requests[h].spec for h in handles]
        if entry is None:
            prefix = specs[0].prompt_tokens[:n]
            self._select_rows(handles[:1])
            _, cache = forward(self.model, torch.tensor([prefix], dtype=torch.long, device=self.device), None, 1)
            self._count("prefix_prefill", started)
            if not cache_rows.full_attention_only(cache):
                return False
            entry = store.put(key, prefix, cache)
            store.stats.tokens_reused += n * (len(handles) - 1)
        copied = time.perf_counter()
        cache = cache_rows.repeated(entry.cache, len(handles))
        self._count("prefix_copy", copied)
        suffixed = time.perf_counter()
        ids, suffix_mask, suffix_positions = _left_padded([s.prompt_tokens[n:] for s in specs], self.device)
        mask = positions = None
        if suffix_mask is not None:  # the prefix, then the padding of the shorter suffixes (hidden), then each suffix
            mask = torch.cat([suffix_mask.new_ones((len(handles), n)), suffix_mask], dim=1)
            positions = suffix_positions + n
        self._select_rows(list(handles))
        logits, cache = forward(self.model, ids, cache, 1, mask, positions)
        step_logits = logits[:, -1, :].float()
        del logits
        self._count("suffix_prefill", suffixed)
        lengths = torch.tensor([len(s.prompt_tokens) for s in specs], device=self.device)
        prefill_of_row = {r: i for i, h in enumerate(handles) for r in self.requests[h].rows}
        self._begin(handles, prefill_of_row, len(handles), cache, step_logits, mask, lengths, mask is not None,
                    n + ids.shape[1], started)
        return True

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
