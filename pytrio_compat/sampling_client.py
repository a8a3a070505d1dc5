"""SamplingClient: generate from a fixed set of weights (base model or a saved LoRA snapshot)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError as PydanticValidationError

from .errors import APIError, ValidationError
from .types import APIFuture, ModelInput, SampleResponse, SamplingParams
from .wire import Accepted, SampleRequest, SamplerInfo, WireImage, WireSamplingParams

if TYPE_CHECKING:
    from .service_client import ServiceClient


class SamplingClient:
    def __init__(self, service: "ServiceClient", info: SamplerInfo) -> None:
        self._service = service
        self._rt = service._runtime
        self.sampler_id = info.sampler_id
        self.sampling_run_cuid = info.sampler_id
        self.model_id = info.base_model
        self.model_path = info.model_path
        # sample calls running at once (configure(sampling_request_max_in_flight=...)); the others wait
        self._in_flight = asyncio.Semaphore(self._rt.config.sampling_request_max_in_flight)

    # --- sample ---------------------------------------------------------------------------------------

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> APIFuture[SampleResponse]:
        request = _sample_request(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                  topk_prompt_logprobs, return_text)
        return APIFuture(self._rt.submit(self._sample(request)))

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> SampleResponse:
        request = _sample_request(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                  topk_prompt_logprobs, return_text)
        return await self._rt.run_async(self._sample(request))

    async def _sample(self, request: SampleRequest) -> SampleResponse:
        """One sample call: at most sampling_request_max_in_flight at once, each within sampling_timeout_seconds."""
        limit = self._rt.config.sampling_timeout_seconds
        async with self._in_flight:
            try:
                return await asyncio.wait_for(self._sample_once(request), limit)
            except asyncio.TimeoutError:
                raise APIError(f"sample did not finish within sampling_timeout_seconds={limit:g}",
                               code="actor.sampling.total_timeout", operation="sample", retryable=False,
                               hint="raise configure(sampling_timeout_seconds=...) or ask for fewer tokens") from None

    async def _sample_once(self, request: SampleRequest) -> SampleResponse:
        cfg = self._rt.config
        window = cfg.sampling_retry_timeout_seconds
        raw = await self._rt.request("POST", f"/v1/samplers/{self.sampler_id}/sample", body=request,
                                     retry_window=window, operation="sample",
                                     timeout=cfg.actor_event_submit_timeout_seconds)
        accepted = Accepted.model_validate(raw)
        result = await self._rt.wait_for_request(accepted.request_id, "sample", retry_window=window)
        return SampleResponse.model_validate(result)

    # --- logprobs -------------------------------------------------------------------------------------

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        request = _logprob_request(prompt)
        return APIFuture(self._rt.submit(self._sample(request))).map(lambda r: list(r.prompt_logprobs))

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        response = await self._rt.run_async(self._sample(_logprob_request(prompt)))
        return list(response.prompt_logprobs)

    def get_tokenizer(self) -> Any:
        return self._service._tokenizer_for(self.model_id)

    def get_base_model(self) -> str:
        return self.model_id


def _logprob_request(prompt: ModelInput) -> SampleRequest:
    if isinstance(prompt, ModelInput) and prompt.has_images:
        raise ValidationError("prompt logprobs are not available for image inputs",
                              code="validation.image_logprobs_unsupported")
    return _sample_request(prompt, 1, SamplingParams(max_tokens=1), True, 0, False)


def _sample_request(
    prompt: ModelInput, num_samples: int, params: SamplingParams | None, include_prompt_logprobs: bool,
    topk_prompt_logprobs: int, return_text: bool,
) -> SampleRequest:
    if not isinstance(prompt, ModelInput):
        prompt = ModelInput.model_validate(prompt)
    params = params or SamplingParams()
    if prompt.is_empty:
        raise ValidationError("prompt cannot be empty", code="validation.empty_prompt",
                              hint="pass ModelInput.from_ints(token_ids) with at least one token")
    if params.max_tokens is None or params.max_tokens <= 0:
        raise ValidationError(
            f"sampling_params.max_tokens must be a positive integer, got {params.max_tokens}",
            code="validation.invalid_sampling_request", hint="set SamplingParams(max_tokens=N)",
        )
    if num_samples < 1 or topk_prompt_logprobs < 0:
        raise ValidationError(
            f"num_samples must be >= 1 and topk_prompt_logprobs >= 0, got {num_samples} and {topk_prompt_logprobs}",
            code="validation.invalid_sampling_request",
        )
    text_tokens, images = prompt.text_and_images()
    stop = params.stop
    stop_strings = stop_ids = None
    if isinstance(stop, str):
        stop_strings = [stop]
    elif stop is not None:
        items = list(stop)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            stop_ids = items  # includes []: no stop at all, not even EOS
        else:
            stop_strings = [str(x) for x in items]
    try:
        return SampleRequest(
            prompt_tokens=text_tokens,
            prompt_images=[WireImage(position=at, chunk=chunk) for at, chunk in images] or None,
            num_samples=num_samples,
            sampling_params=WireSamplingParams(
                max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, seed=params.seed, stop=stop_strings, stop_token_ids=stop_ids,
            ),
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            return_text=return_text,
        )
    except PydanticValidationError as exc:
        raise ValidationError(f"invalid sampling request: {exc}", code="validation.invalid_sampling_request") from exc
