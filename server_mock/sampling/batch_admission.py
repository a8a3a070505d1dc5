"""How requests enter a decode batch: their prompts are prefilled, and their rows handed to the batch's
bookkeeping (batch_rows.py), which makes them the batch or stacks them under the running one.

``BatchAdmission.admit`` prefills new requests (each distinct prompt once; several prompts together, left-padded;
a prompt with images with its pixels, prompt_images.py); an admission that fails leaves none of its requests behind.

With a ``prefix_store`` (prefix_store.py, where ``SamplingSupport.prefix_reuse``), a prompt that continues a stored
prefix of its weights, or shares one with recent prompts (then prefilled once, as one row, and stored), prefills only
its own tokens, against a copy of the prefix's cache: one forward for the requests of one prefix, their tokens
left-padded after the prefix (the padding hidden by the mask, positions explicit), as if each had been prefilled
whole. Prompts with images or asking for prompt logprobs are prefilled whole.
"""

from __future__ import annotations

import time

import torch

from server_mock.sampling import cache_rows, prompt_images
from server_mock.sampling.batch_rows import FULL_SUPPORT, BatchRows, SamplingSupport
from server_mock.sampling.prefix_store import RECENT_PROMPTS, entry_key
from server_mock.sampling.logprobs import EvalMode, prompt_logprobs

__all__ = ["BatchAdmission", "forward"]


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


class BatchAdmission(BatchRows):
    """A decode batch that requests enter (see the module docstring): their prompts prefilled, their rows handed
    to ``BatchRows``; ``DecodeBatch`` (decode_batch.py) decodes it. Not thread-safe: one thread drives it."""

    def __init__(self, model, tokenizer=None, support: SamplingSupport = FULL_SUPPORT,
                 profile: dict[str, float] | None = None, static=None, vision=None, prefix_store=None) -> None:
        super().__init__(model, tokenizer, support, profile, static, vision)
        # prompt prefixes' caches kept across requests (prefix_store.PrefixStore), used where ``support.prefix_reuse``
        self.prefix_store = prefix_store

    # --- admitting requests ------------------------------------------------------------------------------------

    def admit(self, specs: list, tag: str = "", tags: list[str] | None = None) -> list[int]:
        """Queue requests into the batch; they are prefilled now where the batch can take them. Their handles.
        ``tag``: which weights their rows use where the model decodes rows of several (``select_rows``); ``tags``:
        each request's, where they differ."""
        handles = self._add_requests(specs, tag, tags)
        try:
            with torch.no_grad(), EvalMode(self.model):
                self._prefill_waiting()
        except BaseException:
            self._withdraw(handles)
            raise
        return handles

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
