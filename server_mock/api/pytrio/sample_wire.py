"""The Actor plane's JSON bodies: a training client's heartbeat and a sampling run's sample request and answer.

Every sample field the SDK may send is bounded here; the worker's own limits (``validation.validate_sample``)
apply after. The answer keys are all optional for the SDK, which ignores extras; the cookbook relies on one
sequence per sample, one logprob per token, and prompt logprobs of the prompt's length with entry 0 null.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from server_mock.api.pytrio.event_wire import MAX_ID, MAX_SHORT, MAX_TEXT, FiniteFloat, ModelInputIn, TokenId

MAX_STOP = 64  # stop strings or stop token ids (the worker's --max-stop-* limits apply after)
MAX_NUM_SAMPLES = 65_536
MAX_GEN_TOKENS = 1 << 20


class _Lenient(BaseModel):
    model_config: ClassVar[ConfigDict] = ConfigDict(extra="ignore")


class _Out(BaseModel):
    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid")


class HeartbeatIn(_Lenient):
    sdk: Annotated[str, Field(max_length=MAX_SHORT)] = ""
    sdk_version: Annotated[str, Field(max_length=MAX_SHORT)] = ""


class SamplingParamsIn(BaseModel):
    """Defaults arrive as ints (temperature 1, top_p 1, top_k -1). Either ``stop`` (strings) or ``stop_token_ids``
    (ints; an empty list also goes here). Unknown keys are refused: each changes what is generated."""

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    max_tokens: Annotated[StrictInt, Field(gt=0, le=MAX_GEN_TOKENS)]
    temperature: Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, le=1 << 31)] = -1
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]] | None = Field(default=None,
                                                                                        max_length=MAX_STOP)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or > 0")
        return value


class SampleIn(_Lenient):
    """``POST v1/sampling-runs/{cuid}/sample``. ``request_id`` is the same across the SDK's retries."""

    request_id: Annotated[str, Field(min_length=1, max_length=MAX_ID)]
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn
    num_samples: Annotated[StrictInt, Field(ge=1, le=MAX_NUM_SAMPLES)] = 1
    return_text: StrictBool = True
    return_token_logprobs: StrictBool = True
    return_prompt_logprobs: StrictBool = False
    topk_prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=1 << 20)] = 0

    @model_validator(mode="after")
    def _non_empty(self) -> SampleIn:
        if self.prompt.length == 0 and self.prompt.image_chunk() is None:
            raise ValueError("prompt: cannot be empty")
        return self


class SampleSequenceOut(_Out):
    tokens: list[int]
    logprobs: list[FiniteFloat]  # one per token, never null (the SDK's type is list[float])
    text: str | None = None
    stop_reason: str


class SampleUsageOut(_Out):
    input_tokens: int = 0
    output_tokens: int = 0


class SampleOut(_Out):
    request_id: str
    sampling_run: str
    sequences: list[SampleSequenceOut]
    prompt_logprobs: list[FiniteFloat | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, FiniteFloat]] | None] | None = None
    usage: SampleUsageOut
