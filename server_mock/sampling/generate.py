"""KV-cached sampling with exact per-token logprobs, for every cache kind transformers uses.

One decode loop (``decode_batch.DecodeBatch``) serves one request or several coalesced ones: each distinct prompt
is prefilled once (several prompts together, left-padded), the cache is expanded to one row per sample, and all
rows advance one token per step; rows that stop leave the batch, and requests that arrive while it decodes can
join it between steps. Expanding and dropping rows go through ``Cache.reorder_cache``, which every cache layer
kind implements (full attention, sliding window, the recurrent and conv states of hybrid linear-attention /
short-conv models), so nothing here depends on one cache class. Where a model cannot take that (see
``SamplingSupport``), slower paths keep the results correct.

The returned logprobs are those of the unmodified model distribution (float32 ``log_softmax`` of the raw
logits) at the sampled tokens; temperature / top-k / top-p only shape the distribution sampled from. With a
seed, row ``r`` of a request draws from its own ``torch.Generator`` seeded from ``(seed, r)``, so a request
gets the same tokens alone or coalesced with others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server_mock.sampling.batch_rows import FULL_SUPPORT, Finished, SamplingSupport
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.sampling.logprobs import teacher_forced_logprobs
from server_mock.sampling.token_choice import row_seed
from server_mock.sampling.token_stream import TokenStream

__all__ = [
    "FULL_SUPPORT",
    "SampleResult",
    "SampleSpec",
    "SampledSequence",
    "SamplingSupport",
    "check_spec",
    "generate",
    "generate_batch",
    "result_of",
    "row_seed",
    "teacher_forced_logprobs",
]


@dataclass
class SampleSpec:
    prompt_tokens: list[int]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0
    seed: int | None = None
    # Generation stops after emitting one of these; the stop token is included in the returned tokens.
    stop_token_ids: list[int] = field(default_factory=list)
    # Generation stops once the decoded completion contains one of these; the tokens up to and including the
    # one that completed it are returned.
    stop_strings: list[str] = field(default_factory=list)
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    # the prompt's images (engine.vision.ImageSpan), their tokens already in ``prompt_tokens``
    images: tuple = ()
    # never drawn (their probability is set to 0 before choosing); logprobs stay the model's distribution's
    banned_token_ids: list[int] = field(default_factory=list)
    # told each token as its decode step ends, and read before each step to cancel the request (token_stream.py);
    # it stays in this process (a remote host decodes without it)
    stream: TokenStream | None = None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    # Element 0 is None; element i is the logprob of prompt token i given the tokens before it.
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


def check_spec(spec: SampleSpec, tokenizer) -> None:
    if not spec.prompt_tokens:
        raise ValueError("prompt_tokens must not be empty")
    if spec.num_samples < 1:
        raise ValueError("num_samples must be >= 1")
    if spec.max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if spec.temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0.0 < spec.top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    if any(spec.stop_strings) and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer")
    if getattr(spec, "images", ()) and not spec.prompt_tokens:
        raise ValueError("a prompt with images needs its tokens")


def result_of(done: Finished) -> SampleResult:
    """The ``SampleResult`` of a finished request of a ``DecodeBatch``."""
    sequences = [SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.reason)
                 for row in done.rows]
    return SampleResult(sequences=sequences, prompt_logprobs=done.prompt_logprobs,
                        topk_prompt_logprobs=done.topk_prompt_logprobs)


def generate(model, spec: SampleSpec, tokenizer=None, timings: dict[str, float] | None = None,
             support: SamplingSupport = FULL_SUPPORT, vision=None) -> SampleResult:
    """Sample ``spec.num_samples`` completions of ``spec.prompt_tokens`` with a KV cache, exact logprobs.

    ``timings``, if given, receives the seconds spent in ``prefill`` and ``decode``."""
    return generate_batch(model, [spec], tokenizer, timings, support, vision=vision)[0]


def generate_batch(model, specs: list[SampleSpec], tokenizer=None, timings: dict[str, float] | None = None,
                   support: SamplingSupport = FULL_SUPPORT, static=None, vision=None) -> list[SampleResult]:
    """Decode one or several sample requests as one batch (the async recipe's concurrent prompts); ``static``:
    fixed-shape steps (``static_steps.StaticSteps``) or None; ``vision`` (``engine.vision.ImageProcessing``):
    needed when a prompt holds images (``prompt_images.py``)."""
    for spec in specs:
        check_spec(spec, tokenizer)
    batch = DecodeBatch(model, tokenizer, support, static=static, vision=vision)
    handles = batch.admit(specs)
    batch.run()
    done = {f.handle: f for f in batch.take_finished()}
    if timings is not None:
        timings["prefill"] = timings.get("prefill", 0.0) + batch.prefill_s
        timings["decode"] = timings.get("decode", 0.0) + batch.decode_s
    return [result_of(done[h]) for h in handles]
