"""Sampling for the OpenAI-compatible API, through the service's own path.

A request names a served base model or a ``trio://`` sampler path; it becomes a service sampler (one
per tenant and model, kept) and one native ``sample`` request per prompt, submitted with
``WorkerService.submit_sample``. So OpenAI requests share the per-model queues, the batching of
requests for the same weights, and every limit (max tokens, samples, queued requests) with native
sampling, and their tokens and logprobs are the ones native ``sample`` returns for the same prompt
tokens and seed.
"""

from __future__ import annotations

import asyncio

from pytrio_compat.wire import CreateSampler, SampleRequest, WireImage, WireSamplingParams
from server_mock.api.openai.protocol import Generation
from server_mock.api.openai.render import Choice, finish
from server_mock.engine.jobs import job_result
from server_mock.errors import WorkerError
from server_mock.service.samplers import ReusedSamplers
from server_mock.service.validation import describe_int
from server_mock.service.worker import WorkerService

SAMPLERS_PER_KEY = 16  # samplers kept for reuse per API key (one per model named), the least recently used out

# native field -> OpenAI field, for the errors the service raises (``None``: the prompt's field)
_PARAMS = {"prompt_tokens": None, "prompt_images": None, "num_samples": "n", "sampling_params.max_tokens": "max_tokens",
           "sampling_params.temperature": "temperature", "sampling_params.top_p": "top_p",
           "sampling_params.top_k": "top_k", "sampling_params.stop": "stop", "sampling_params.seed": "seed",
           "topk_prompt_logprobs": "top_logprobs", "model_path": "model", "base_model": "model"}


def openai_error(exc: WorkerError, prompt_field: str, max_tokens_field: str = "max_tokens") -> WorkerError:
    """A service error with its field (and the message's leading field name) in OpenAI's terms."""
    if exc.field not in _PARAMS:
        return exc
    param = _PARAMS[exc.field] or prompt_field
    if param == "max_tokens":
        param = max_tokens_field
    message = exc.message
    if message.startswith(exc.field):  # "sampling_params.stop[0]: ..." -> "stop[0]: ..."
        message = param + message[len(exc.field):]
    status, code = exc.status, exc.code
    if exc.code == "checkpoint_not_found":
        status, code = 404, "model_not_found"
    return WorkerError(status, code, message, param)


class Generator:
    def __init__(self, service: WorkerService) -> None:
        self.service = service
        self._samplers = ReusedSamplers(service.samplers, SAMPLERS_PER_KEY)

    def served_models(self) -> list[str]:
        return [m.model_name for m in self.service.models.capabilities()]

    async def resolve(self, model: str, tenant: str):
        """The sampler id and the model host for ``model``: a served base model or an owned trio:// path."""
        if model.startswith("trio://"):
            create = CreateSampler(model_path=model)
        elif model in self.served_models() or self.service.lazy_models:
            create = CreateSampler(base_model=model)  # with --lazy-models, any model the worker can load
        else:
            raise WorkerError(404, "model_not_found", f"model: {model!r} does not exist here: use one of the "
                                                      f"served models ({', '.join(self.served_models()) or 'none'}) "
                                                      "or a trio:// sampler checkpoint of yours (GET /models)", "model")
        try:
            sampler = await self._samplers.get(create, tenant)
        except WorkerError as exc:
            raise openai_error(exc, "model") from None
        host = await self.service.models.host(sampler.base_model, "model")
        return sampler.sampler_id, host

    async def submit_all(self, sampler_id: str, host, prompts: list[list[int]], gen: Generation, tenant: str,
                         prompt_field: str, images: list[list[WireImage] | None] | None = None,
                         streams: list | None = None) -> list:
        """Check every prompt, then queue each one's ``n`` samples; returns the service jobs. ``images[i]``: the
        images of prompt i (decoded and checked in a worker thread by the service); ``streams[i]``: the token
        stream of prompt i's request (streaming.py), cancelled for every prompt if one cannot be queued."""
        requests = [self.prepare(host, prompt, gen, prompt_field, f" of prompt {i}" if len(prompts) > 1 else "")
                    for i, prompt in enumerate(prompts)]
        for request, prompt_images in zip(requests, images or []):
            request.prompt_images = prompt_images
        jobs = []
        for i, r in enumerate(requests):
            try:
                jobs.append(await self.service.samplers.submit_async(sampler_id, r, tenant,
                                                                     stream=streams[i] if streams else None))
            except WorkerError as exc:
                for stream in streams or []:
                    stream.cancelled = True  # the prompts queued already are not answered
                raise openai_error(exc, prompt_field, gen.max_tokens_field) from None
        return jobs

    def prepare(self, host, prompt: list[int], gen: Generation, prompt_field: str, which: str = "") -> SampleRequest:
        """One prompt's native sample request, checked against the vocabulary and the model's context."""
        vocab = host.vocab_size
        bad = next((i for i, t in enumerate(prompt) if vocab is not None and not 0 <= t < vocab), None)
        if bad is not None:
            raise WorkerError(400, "token_id_out_of_range", f"{prompt_field}: token id {describe_int(prompt[bad])} at "
                                                            f"position {bad}{which} is outside the vocabulary "
                                                            f"[0, {vocab})", prompt_field)
        limits = self.service.limits
        context = host.max_seq_len or (len(prompt) + limits.max_sample_tokens + 1)
        room = context - len(prompt) - (1 if gen.top_logprobs else 0)  # top logprobs re-read the answer + 1
        if gen.max_tokens is None:
            if room < 1:
                raise WorkerError(413, "context_length_exceeded", f"{prompt_field}: the prompt has {len(prompt)} "
                                  f"tokens, which leaves no room to generate within max_seq_len={context}",
                                  prompt_field)
            max_tokens = min(room, limits.max_sample_tokens)
        elif gen.max_tokens > room:
            raise WorkerError(413, "context_length_exceeded",
                              f"{gen.max_tokens_field}: the prompt ({len(prompt)} tokens) + {gen.max_tokens_field} "
                              f"({gen.max_tokens}) exceeds the model's context max_seq_len={context}"
                              + (" (top_logprobs needs one more)" if gen.top_logprobs else ""), gen.max_tokens_field)
        else:
            max_tokens = gen.max_tokens
        return SampleRequest(
            prompt_tokens=prompt, num_samples=gen.n, return_text=False,
            sampling_params=WireSamplingParams(max_tokens=max_tokens, temperature=gen.temperature, top_k=gen.top_k,
                                               top_p=gen.top_p, seed=gen.seed, stop=gen.stop or None))

    def _submit(self, sampler_id: str, request: SampleRequest, tenant: str, prompt_field: str,
                max_tokens_field: str = "max_tokens"):
        try:
            return self.service.samplers.submit(sampler_id, request, tenant)
        except WorkerError as exc:
            raise openai_error(exc, prompt_field, max_tokens_field) from None

    async def results(self, jobs: list, gen: Generation, prompt_field: str) -> list[dict]:
        """Wait for the jobs: each prompt's sample result (``{"sequences": [...]}``)."""
        try:
            return list(await asyncio.gather(*(job_result(job) for job in jobs)))
        except WorkerError as exc:
            raise openai_error(exc, prompt_field, gen.max_tokens_field) from None

    def finisher(self, host, gen: Generation):
        """``finish(index, sequence)``: a sampled sequence as choice ``index`` (no top logprobs)."""
        stop_ids = set(getattr(host.tokenizer, "all_special_ids", []) or [])
        return lambda index, seq: finish(host.tokenizer, index, seq, gen.stop, stop_ids)

    async def choices(self, sampler_id: str, host, prompts: list[list[int]], jobs: list, gen: Generation,
                      tenant: str, prompt_field: str) -> list[Choice]:
        """Wait for the jobs; each sampled sequence as a choice (index = prompt index x n + sample index)."""
        try:
            results = await asyncio.gather(*(job_result(job) for job in jobs))
        except WorkerError as exc:
            raise openai_error(exc, prompt_field, gen.max_tokens_field) from None
        sequences = [(p, prompt, seq) for p, (prompt, result) in enumerate(zip(prompts, results))
                     for seq in result["sequences"]]
        tops = [None] * len(sequences)
        if gen.top_logprobs:
            tops = await self._top_logprobs(sampler_id, [(prompt, seq) for _, prompt, seq in sequences],
                                            gen.top_logprobs, tenant, prompt_field)
        stop_ids = set(getattr(host.tokenizer, "all_special_ids", []) or [])
        out = []
        for i, ((_, _, seq), top) in enumerate(zip(sequences, tops)):  # i = prompt index x n + sample index
            out.append(finish(host.tokenizer, i, seq, gen.stop, stop_ids, top))
        return out

    async def _top_logprobs(self, sampler_id: str, sequences: list[tuple[list[int], dict]], k: int, tenant: str,
                            prompt_field: str) -> list[list[list[tuple[int, float]]]]:
        """The k most likely tokens at each sampled position: a teacher-forced pass over prompt + answer."""
        jobs = []
        for prompt, seq in sequences:
            request = SampleRequest(prompt_tokens=prompt + list(seq["tokens"]), num_samples=1, return_text=False,
                                    include_prompt_logprobs=True, topk_prompt_logprobs=k,
                                    sampling_params=WireSamplingParams(max_tokens=1, temperature=0.0))
            jobs.append(self._submit(sampler_id, request, tenant, prompt_field))
        try:
            results = await asyncio.gather(*(job_result(job) for job in jobs))
        except WorkerError as exc:
            raise openai_error(exc, prompt_field) from None
        out = []
        for (prompt, seq), result in zip(sequences, results):
            rows = result.get("topk_prompt_logprobs") or []
            picked = rows[len(prompt):len(prompt) + len(seq["tokens"])]
            out.append([[(int(t), float(lp)) for t, lp in (row or [])] for row in picked])
        return out
