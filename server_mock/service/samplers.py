"""Samplers: which weights a sampling client reads, and its sample requests.

A sampler reads an immutable snapshot: the base model, an in-memory snapshot of a run, a saved sampler
checkpoint, or a local PEFT adapter folder. Snapshots and samplers are cached per tenant (quotas.py).
Weights on disk are read on the model's thread when the request runs, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from pytrio_compat.wire import CreateSampler, LoraSpec, SampleRequest
from server_mock.config import Limits
from server_mock.engine.host import ModelHost
from server_mock.engine.jobs import Job
from server_mock.engine.requests import RequestStore, run_id
from server_mock.errors import WorkerError, bad_request, not_found, storage_error
from server_mock.lora import Layer, Snapshot, adapter_keys, align_adapter_keys
from server_mock.sampling.generate import SampleSpec
from server_mock.sampling.token_stream import TokenStream
from server_mock.service.checkpoints import Checkpoints
from server_mock.service.journal import Journal
from server_mock.service.models import Models
from server_mock.service.quotas import TenantLRU, check_queued
from server_mock.service.rate_limits import TokenBudgets
from server_mock.service.validation import validate_sample
from server_mock.storage import crash_points, peft_folders
from server_mock.storage.checkpoints import parse_path


class SamplePayload(NamedTuple):
    """A sample job's payload: its checked request, whether to answer with text, the loader of its weights (run on
    the model's thread; a Snapshot, None for the base model) and their key (the job's ``weights_key``): requests of
    a batch with one key share one load."""

    spec: SampleSpec
    return_text: bool
    load: Callable[[], Snapshot | None]
    weights_key: str


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    base_model: str
    model_path: str | None


class Samplers:
    def __init__(self, models: Models, requests: RequestStore, checkpoints: Checkpoints, limits: Limits,
                 allow_adapter_dirs: list[str] | None = None,
                 dropped: Callable[[str], None] | None = None, journal: Journal | None = None,
                 budgets: TokenBudgets | None = None) -> None:
        self.models = models
        self.budgets = budgets or TokenBudgets()  # --tokens-per-minute: prompt + n x max_tokens, the rest given back
        self.journal = journal  # --durability full: samplers and sample requests recorded (service/journal.py)
        self.requests = requests
        self.checkpoints = checkpoints
        self.limits = limits
        # local PEFT adapter folders may be sampled from only inside these (real paths, symlinks resolved)
        self.allow_adapter_dirs = [os.path.realpath(d) for d in (allow_adapter_dirs or [])]
        # per-tenant caches: one tenant's volume only ever evicts its own entries
        self._samplers: TenantLRU[Sampler] = TenantLRU(limits.max_samplers)
        self._local_snapshots: TenantLRU[Snapshot] = TenantLRU(limits.max_snapshots)
        self._layouts: dict[str, dict[str, Layer]] = {}
        self._dropped = dropped  # told the id of each sampler the cache drops (its records go with it)

    async def create(self, body: CreateSampler, tenant: str, new_id: str | None = None) -> Sampler:
        """A sampler on ``body``'s weights (``new_id``: its id, chosen by a front end that derives it from a request of
        its own, so that making it again after a restart gives the same one)."""
        base_model = body.base_model
        if body.model_path and peft_folders.is_local_path(body.model_path):
            return await self._create_local(body, tenant)
        if body.model_path:
            ref = await asyncio.to_thread(self.checkpoints.owned_ref, body.model_path, tenant, "model_path")
            cached = self.checkpoints.snapshots.get(body.model_path)
            if cached is not None:
                ckpt_model = cached[0]
            else:
                ckpt_model = (await asyncio.to_thread(self.checkpoints.store.read_meta, ref))["base_model"]
            if base_model and base_model != ckpt_model:
                raise bad_request("base_model", f"{body.model_path} was trained on {ckpt_model!r}, not {base_model!r}")
            base_model = ckpt_model
        if not base_model:
            raise bad_request("base_model", "required when model_path is not given")
        await self.models.host(base_model)
        return self._add(Sampler(new_id or run_id("sampler"), tenant, base_model, body.model_path))

    def _add(self, sampler: Sampler, record: bool = True) -> Sampler:
        if self.journal is not None and record:
            try:
                self.journal.sampler_created(sampler.sampler_id, sampler.tenant, sampler.base_model,
                                             sampler.model_path)
            except Exception as exc:  # noqa: BLE001 - a full disk: no sampler
                raise storage_error("create_sampler", exc) from exc
        evicted = self._samplers.put(sampler.sampler_id, sampler.tenant, sampler)  # this tenant's least recently used
        for sampler_id in evicted:
            if self._dropped:
                self._dropped(sampler_id)
            if self.journal is not None:
                self.journal.sampler_dropped(sampler_id)
        return sampler

    async def restore(self, sampler_id: str, tenant: str, base_model: str, model_path: str | None) -> None:
        """A sampler recorded before a restart (its weights are found as when it was created)."""
        await self.models.host(base_model)
        if model_path and peft_folders.is_local_path(model_path):
            self._layouts[base_model] = await self.models.lora_layout(base_model, tenant)
        self._add(Sampler(sampler_id, tenant, base_model, model_path), record=False)

    async def _create_local(self, body: CreateSampler, tenant: str) -> Sampler:
        folder = peft_folders.resolve(body.model_path, self.allow_adapter_dirs)
        base_model = body.base_model
        if not base_model:
            hint = peft_folders.base_model_hint(folder)
            if not self.models.is_served(hint):
                raise bad_request("base_model", f"required for a local adapter folder ({folder} names base model "
                                                f"{hint!r}, which this worker does not serve)")
            base_model = hint
        host = await self.models.host(base_model)
        self._layouts[base_model] = await self.models.lora_layout(base_model, tenant)
        sampler = Sampler(run_id("sampler"), tenant, base_model, str(folder))
        await asyncio.to_thread(self._local_snapshot, sampler, host)  # check it now, once
        return self._add(sampler)

    def _local_snapshot(self, sampler: Sampler, host: ModelHost) -> Snapshot:
        folder = peft_folders.resolve(sampler.model_path, self.allow_adapter_dirs)
        key = f"{sampler.tenant}:{sampler.base_model}:{peft_folders.fingerprint(folder)}"
        snap = self._local_snapshots.get(key)
        if snap is None:
            snap = peft_folders.load(folder, host.name, self._layouts[sampler.base_model], self.limits.max_lora_rank)
            self._local_snapshots.put(key, sampler.tenant, snap)
        return snap

    def drop(self, sampler_id: str, tenant: str) -> None:
        """Forget a sampler (a front end whose clients never close theirs releases them); its weights stay."""
        if self._samplers.owner(sampler_id) == tenant:
            self._samplers.pop(sampler_id)
            if self.journal is not None:
                self.journal.sampler_dropped(sampler_id)

    def get(self, sampler_id: str, tenant: str) -> Sampler:
        sampler = self._samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant:
            raise not_found("sampler", sampler_id)
        return sampler

    def _weights_for(self, sampler: Sampler, host: ModelHost):
        """(batch key, loader): the loader returns the sampler's Snapshot (None: the base model) and runs on
        the model's thread. Weights that are gone are a 404 now, not a failed request later. ``submit`` adds the
        tenant to the key (unless ``--batch-across-tenants``): requests of different tenants are then never decoded
        in one batch, so nothing in an answer (its ``batch_requests``, its timings, its logprobs' last bits)
        depends on another tenant's traffic."""
        if sampler.model_path is None:
            return f"{sampler.base_model}:base", lambda: None
        if peft_folders.is_local_path(sampler.model_path):
            key = f"{sampler.base_model}:local:{sampler.tenant}:{sampler.model_path}"
            return key, lambda: self._local_snapshot(sampler, host)
        snapshots = self.checkpoints.snapshots
        self.checkpoints.drop_if_expired(sampler.model_path)
        cached = snapshots.get(sampler.model_path)
        if cached is not None:
            snap = cached[1]
            return f"{sampler.base_model}:{snap.snapshot_id}", lambda: snap
        ref = parse_path(sampler.model_path, "model_path")
        store = self.checkpoints.store
        if not store.exists(ref):
            raise WorkerError(404, "sampler_weights_expired",
                              f"model_path: the weights {sampler.model_path} are gone (in-memory snapshots are kept "
                              f"for each API key's {self.limits.max_snapshots} most recently used, --max-snapshots); "
                              "save them with a name to keep them", "model_path")

        def load() -> Snapshot:
            cached = snapshots.get(sampler.model_path)
            if cached is not None:
                return cached[1]
            meta = store.read_meta(ref)
            spec = LoraSpec.model_validate(meta["lora"])
            tensors = store.read_tensors(ref, "adapter_model.safetensors")
            targets = host.lora_targets(spec)
            tensors = align_adapter_keys(tensors, adapter_keys(targets))  # saved on the other layout of a VLM
            snap = Snapshot(hashlib.sha256(ref.path.encode()).hexdigest()[:16], spec, targets, tensors)
            self.checkpoints.remember_expiry(sampler.model_path, meta)
            self.checkpoints.put_snapshot(sampler.model_path, sampler.tenant, sampler.base_model, snap)
            return snap

        return f"{sampler.base_model}:disk:{sampler.model_path}", load

    async def submit_async(self, sampler_id: str, request: SampleRequest, tenant: str, request_id: str | None = None,
                           front: dict | None = None, stream: TokenStream | None = None) -> Job:
        """``submit`` for a front end on the event loop: a prompt with images is decoded and processed in a worker
        thread (a text prompt is checked inline, as before)."""
        if not request.prompt_images:
            return self.submit(sampler_id, request, tenant, request_id=request_id, front=front, stream=stream)
        sampler = self.get(sampler_id, tenant)
        check_queued(self.requests, tenant, self.limits.max_queued_requests)
        host = self.models.loaded(sampler.base_model)
        spec = await asyncio.to_thread(validate_sample, request, host, self.limits)
        return self.submit(sampler_id, request, tenant, spec, request_id=request_id, front=front, stream=stream)

    def submit(self, sampler_id: str, request: SampleRequest, tenant: str, spec: SampleSpec | None = None,
               request_id: str | None = None, requeued: bool = False, front: dict | None = None,
               stream: TokenStream | None = None) -> Job:
        """Queue one sample request; its job's result is a dict (``sample_result``'s form). ``spec``: the request
        already checked (``validate_sample``); ``request_id``: the id a front end chose for it, or (``requeued``)
        one accepted before a restart, queued again; ``front``: the front end's own fields, journaled with it;
        ``stream``: told each token as it is decoded, and how the front end cancels the request
        (sampling/token_stream.py; where the model decodes in this process)."""
        sampler = self.get(sampler_id, tenant)
        check_queued(self.requests, tenant, self.limits.max_queued_requests)
        host = self.models.loaded(sampler.base_model)
        if spec is None:
            spec = validate_sample(request, host, self.limits)
        if stream is not None:
            spec.stream = stream
        weights_key, load = self._weights_for(sampler, host)
        batch_key = weights_key if self.limits.batch_across_tenants else f"{tenant}|{weights_key}"
        return_text = request.return_text
        cost = 0 if requeued else len(spec.prompt_tokens) + spec.num_samples * spec.max_tokens
        self.budgets.take(tenant, cost)  # 429 + Retry-After past the key's tokens a minute

        payload = SamplePayload(spec, return_text, load, weights_key)

        def run_sample() -> dict:
            return _sample_together(host, [payload])[0]

        job = self.requests.new_job("sample", run_sample, tenant, request_id=request_id)
        job.tokens, job.scope = cost, sampler_id
        if self.journal is not None:
            try:
                if not requeued:
                    self.journal.sample_accepted(job.request_id, tenant, sampler_id, request.model_dump_json(), front)
            except Exception as exc:  # noqa: BLE001 - a full disk: the request is refused, nothing queued
                self.requests.discard(job.request_id)
                self.budgets.give_back(tenant, cost)
                raise storage_error("sample", exc) from exc
            job.on_result = self._record_result
        # other adapters of the base model may share a running batch: the tenant's own, or any tenant's when
        # tenants may share batches (engine/mixed_lora.py; the batch decides whether it can hold them)
        job.mix_key = (f"{sampler.base_model}" if self.limits.batch_across_tenants
                       else f"{tenant}|{sampler.base_model}")
        # a host that decodes each batch in one go and mixes adapters in it takes a mix key's jobs as one batch
        job.batch_key = job.mix_key if host.mixed_batches else batch_key
        job.weights_key = weights_key
        job.payload = payload
        job.batch_fn = lambda payloads: _sample_together(host, payloads)
        job.batch_cost = spec.num_samples * (len(spec.prompt_tokens) + spec.max_tokens)
        job.rows = spec.num_samples
        job.open_decode = lambda: _SampleDecoding.open(host, load(), weights_key)
        self.models.sampling_queue(sampler.base_model).put(job)
        return job

    def _record_result(self, job: Job, result: dict | None, error) -> None:
        self.journal.request_finished(job, result, error)


class ReusedSamplers:
    """The samplers a front end reuses for requests that name none (Tinker's asample by base model or weights path,
    OpenAI's by model name): one per (API key, weights), the ``per_tenant`` most recently used of each key, so one
    key's traffic never evicts another's. A sampler the service dropped meanwhile is made again."""

    def __init__(self, samplers: Samplers, per_tenant: int) -> None:
        self.samplers = samplers
        self._ids: TenantLRU[str] = TenantLRU(per_tenant)

    async def get(self, create: CreateSampler, tenant: str) -> Sampler:
        key = f"{tenant}\x00{create.base_model}\x00{create.model_path}"
        sampler_id = self._ids.get(key)
        if sampler_id is not None:
            try:
                return self.samplers.get(sampler_id, tenant)
            except WorkerError:
                self._ids.pop(key)
        sampler = await self.samplers.create(create, tenant)
        self._ids.put(key, tenant, sampler.sampler_id)
        return sampler

    def count(self, tenant: str) -> int:
        return self._ids.count(tenant)


class _SampleDecoding:
    """Sample requests for one set of weights decoding in slices (the queue's ``Decoding``): the host's
    ``sampling_session`` with each finished request in its result form."""

    def __init__(self, host: ModelHost, session, opened: dict[str, Snapshot | None] | None = None) -> None:
        self.host, self.session, self.payloads = host, session, {}
        self._opened = opened or {}  # the weights the batch was opened with, by key, for its first admission

    @classmethod
    def open(cls, host: ModelHost, snapshot: Snapshot | None, weights_key: str | None = None):
        """A batch on ``snapshot`` (the weights of ``weights_key``: the requests admitted with it are not loaded
        again)."""
        session = host.sampling_session(snapshot, defer=True)
        opened = {} if weights_key is None else {weights_key: snapshot}
        return None if session is None else cls(host, session, opened)

    @property
    def active(self) -> bool:
        return self.session.active

    @property
    def mixes(self) -> bool:
        return self.session.can_mix

    def can_add(self) -> bool:
        return self.session.can_add()

    def add(self, payload: SamplePayload) -> int:
        """Prefill a request into the batch (its ``load`` gives its weights, on this thread)."""
        return self.add_many([payload])[0]

    def add_many(self, payloads: list[SamplePayload]) -> list[int]:
        """``add`` for several requests, prefilled together, each set of weights loaded once; if one fails (a
        loader too), none was added."""
        opened, self._opened = self._opened, {}
        weights = _load_each(payloads, opened)
        handles = self.session.add_many([(payload.spec, snapshot) for payload, snapshot in zip(payloads, weights)])
        for handle, payload in zip(handles, payloads):
            self.payloads[handle] = payload
        return handles

    def run(self, stop) -> list[tuple[int, dict]]:
        finished = self.session.run(stop)
        if finished:
            crash_points.reached("sample")  # (kill tests) the tokens generated, nothing answered
        return [(handle, _sample_dicts(self.host, [self.payloads.pop(handle)], [result], timings,
                                       self.session.requests)[0])
                for handle, result, timings in finished]


def _load_each(payloads: list[SamplePayload], loaded: dict[str, Snapshot | None] | None = None) -> list:
    """Each request's weights, each key's loader called once however many requests of the batch share it (a local
    adapter folder is fingerprinted once a batch, not once a request); ``loaded``: weights this batch already has,
    by key. A loader that raises raises here, before anything is prefilled: the queue then runs or admits each
    request alone, so that only the requests of those weights fail."""
    loaded = dict(loaded or {})
    out = []
    for payload in payloads:
        if payload.weights_key not in loaded:
            loaded[payload.weights_key] = payload.load()
        out.append(loaded[payload.weights_key])
    return out


def _sample_together(host: ModelHost, payloads: list[SamplePayload]) -> list[dict]:
    """Run one or more sample requests, each with its own weights (each set loaded once), as one decoding batch
    (``sample_mixed``: requests of one set of weights decode as ``sample_batch`` does)."""
    timings: dict[str, float] = {}
    weights = _load_each(payloads)
    results = host.sample_mixed([(snapshot, payload.spec) for payload, snapshot in zip(payloads, weights)], timings)
    crash_points.reached("sample")  # (kill tests) the tokens generated, nothing answered
    return _sample_dicts(host, payloads, results, timings, len(payloads))


def _sample_dicts(host: ModelHost, payloads: list[SamplePayload], results: list, timings: dict[str, float],
                  batch_requests: int) -> list[dict]:
    """Each request's result dict: its sequences, prompt logprobs, token counts and the batch's timings."""
    out = []
    for payload, result in zip(payloads, results):
        spec, return_text = payload.spec, payload.return_text
        sequences = [
            {"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs,
             "text": host.tokenizer.decode(s.tokens, skip_special_tokens=True) if return_text else None}
            for s in result.sequences
        ]
        out.append({
            "sequences": sequences,
            "prompt_logprobs": result.prompt_logprobs or [],
            "topk_prompt_logprobs": result.topk_prompt_logprobs or [],
            "input_tokens": len(spec.prompt_tokens),
            "output_tokens": sum(len(s.tokens) for s in result.sequences),
            "metrics": {"batch_requests": float(batch_requests),
                        "time/load_weights": timings.get("load_weights", 0.0),
                        "time/prefill": timings.get("prefill", 0.0), "time/decode": timings.get("decode", 0.0),
                        **({"sampler_replica": timings["replica"]} if "replica" in timings else {})},
        })
    return out
