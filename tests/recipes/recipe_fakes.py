"""A fake service for running the demos in-process: answers like the PyTRIO clients (futures, async
twins, SampleResponse, ForwardBackwardOutput) without a worker, so each step's logic can be checked exactly."""

from __future__ import annotations

import asyncio
import random
import re

from pytrio_compat.types import (
    APIFuture,
    ForwardBackwardOutput,
    OptimStepResponse,
    SampleResponse,
    SampleSequence,
    SaveWeightsForSamplerResponse,
    TensorData,
)

QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


class FakeSampler:
    """Answers "What is a + b?" prompts. Sampling (temperature > 0) is a seeded coin flip per sequence
    between the right and a wrong boxed sum, sometimes cut short (stop_reason "length", box unclosed);
    greedy answers right exactly when a + b is even."""

    def __init__(self, service: FakeService) -> None:
        self.service = service
        self.version = service.optim_steps  # the updates in the weights this sampler holds

    def _respond(self, prompt, num_samples, sampling_params) -> SampleResponse:
        tok = self.service.tokenizer
        self.service.sample_calls.append({"num_samples": num_samples, "params": sampling_params,
                                          "prompt": list(prompt.to_ints()), "version": self.version,
                                          "updates_done": self.service.updates_done})
        text = tok.decode(prompt.to_ints())
        matches = QUESTION.findall(text)
        a, b = (int(x) for x in matches[-1]) if matches else (0, 0)
        rng = random.Random(sampling_params.seed)
        seqs = []
        for _ in range(num_samples):
            if sampling_params.temperature == 0:
                right = (a + b) % 2 == 0
            else:
                right = rng.random() < self.service.p_right
            answer = a + b if right else a + b + 1
            body = f"{a} + {b} = {answer}. \\boxed{{{answer}}}"
            tokens = tok.encode(body, add_special_tokens=False)
            truncated = rng.random() < self.service.p_truncate and sampling_params.temperature != 0
            if truncated:
                tokens = tokens[:-1]
            else:
                tokens = tokens + [tok.convert_tokens_to_ids("<|im_end|>")]
            logprobs = [-round(rng.uniform(0.01, 2.0), 4) for _ in tokens]
            seqs.append(SampleSequence(stop_reason="length" if truncated else "stop", tokens=tokens,
                                       logprobs=logprobs, text=tok.decode(tokens, skip_special_tokens=True)))
        return SampleResponse(sequences=seqs)

    def sample(self, prompt, num_samples=1, sampling_params=None, **kwargs):
        return APIFuture.completed(self._respond(prompt, num_samples, sampling_params))

    async def sample_async(self, prompt, num_samples=1, sampling_params=None, **kwargs):
        return self._respond(prompt, num_samples, sampling_params)

    def get_tokenizer(self):
        return self.service.tokenizer


class Training:
    """The future of an async training call: its result comes after a short wait, as if the worker were training
    meanwhile (so work the script started before awaiting it runs first); an optim_step's counts in
    `updates_done` once awaited."""

    def __init__(self, service: FakeService, value) -> None:
        self.service, self.value = service, value

    def __await__(self):
        async def wait():
            await asyncio.sleep(0.005)
            if isinstance(self.value, OptimStepResponse):
                self.service.updates_done += 1
            return self.value

        return wait().__await__()


class FakeTrainingClient:
    def __init__(self, service: FakeService) -> None:
        self.service = service

    def get_tokenizer(self):
        return self.service.tokenizer

    def save_weights_and_get_sampling_client(self):
        self.service.snapshots += 1
        return FakeSampler(self.service)

    async def save_weights_and_get_sampling_client_async(self):
        return self.save_weights_and_get_sampling_client()

    def _fb_output(self, datums, loss_fn_config=None) -> ForwardBackwardOutput:
        # The "learner" sees every sampled logprob 0.01 lower than the sampler did.
        outputs = [{"logprobs": TensorData(data=[x - 0.01 for x in d.loss_fn_inputs["logprobs"].data],
                                           dtype="float32")} for d in datums]
        metrics = {"loss_sum": -1.5, "loss_mean": -0.25, "token_count": 6.0}
        config = loss_fn_config or {}
        if "kl_coef" in config:  # the worker's KL to the reference and entropy, as fixed numbers
            metrics.update({"kl_sum": 0.12, "kl_mean": 0.02})
        if config.get("return_entropy"):
            metrics.update({"entropy_sum": 4.2, "entropy_mean": 0.7})
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)

    def forward_backward(self, datums, loss_fn="cross_entropy", loss_fn_config=None, auto_shift=False):
        self.service.calls.append(("forward_backward", loss_fn, len(datums)))
        self.service.loss_fn_configs.append(loss_fn_config)
        self.service.fb_datums.append(list(datums))
        return APIFuture.completed(self._fb_output(datums, loss_fn_config))

    def forward_backward_custom(self, datums, loss_fn, loss_fn_config=None):
        import torch

        self.service.calls.append(("forward_backward_custom", None, len(datums)))
        lps = [torch.tensor(d.loss_fn_inputs["logprobs"].data, dtype=torch.float32, requires_grad=True)
               for d in datums]
        loss, custom = loss_fn(datums, lps)
        loss.backward()
        out = self._fb_output(datums)
        out.metrics.update(custom)
        return APIFuture.completed(out)

    def optim_step(self, adam_params):
        self.service.calls.append(("optim_step", adam_params.learning_rate, None))
        self.service.optim_steps += 1
        return APIFuture.completed(OptimStepResponse(metrics={"grad_norm": 0.5}))

    def save_weights_for_sampler(self, name, ttl_seconds=None):
        self.service.calls.append(("save_weights_for_sampler", name, None))
        return APIFuture.completed(SaveWeightsForSamplerResponse(path=f"trio://fake/{name}", model="fake", size=0))

    async def forward_backward_async(self, *a, **k):
        return Training(self.service, self.forward_backward(*a, **k).result())

    async def forward_backward_custom_async(self, *a, **k):
        return Training(self.service, self.forward_backward_custom(*a, **k).result())

    async def optim_step_async(self, *a, **k):
        return Training(self.service, self.optim_step(*a, **k).result())

    async def save_weights_for_sampler_async(self, *a, **k):
        return self.save_weights_for_sampler(*a, **k)


class FakeService:
    """State shared by the fake clients of one test."""

    def __init__(self, tokenizer, p_right: float = 0.5, p_truncate: float = 0.25) -> None:
        self.tokenizer = tokenizer
        self.p_right = p_right
        self.p_truncate = p_truncate
        self.calls: list[tuple] = []
        self.loss_fn_configs: list[dict | None] = []
        self.fb_datums: list[list] = []  # the datums of each forward_backward
        self.sample_calls: list[dict] = []
        self.snapshots = 0
        self.optim_steps = 0  # optim_step calls so far (a sampler's `version` is this at its snapshot)
        self.updates_done = 0  # optim_step results awaited through optim_step_async
        self.service_kwargs: dict | None = None
        self.training_kwargs: dict | None = None
        self.configure_kwargs: dict | None = None

    def service_client_class(self):
        service = self

        class FakeServiceClient:
            def __init__(self, **kwargs):
                service.service_kwargs = kwargs

            def create_lora_training_client(self, **kwargs):
                service.training_kwargs = kwargs
                return FakeTrainingClient(service)

            async def create_lora_training_client_async(self, **kwargs):
                return self.create_lora_training_client(**kwargs)

        return FakeServiceClient
