"""TrainingClient: one LoRA adapter on the worker, trained by ordered forward/backward and optimizer calls.

Ordering: every call takes a ticket when it is made; submissions go out strictly in ticket order and
each accepted one gets the next ``seq_id``. The worker executes a run's requests in ``seq_id`` order and
treats a resent ``seq_id`` as the same request, so a retry after a lost response is never applied twice.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from typing import TYPE_CHECKING, Any, Callable

from .errors import DependencyError, PyTrioError, TrainingRunBrokenError, ValidationError
from .sampling_client import SamplingClient
from .types import (
    AdamParams,
    APIFuture,
    Datum,
    ForwardBackwardOutput,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)
from .validation import checkpoint_name, validate_batch
from .wire import (
    Accepted,
    ForwardOp,
    ForwardResult,
    LoadOp,
    OptimStepOp,
    SaveOp,
    SaveResult,
    TrainingOp,
    TrainingRunInfo,
)

if TYPE_CHECKING:
    from .service_client import ServiceClient


class TrainingClient:
    def __init__(self, service: "ServiceClient", info: TrainingRunInfo) -> None:
        self._service = service
        self._rt = service._runtime
        self._info = info
        self.training_run_id = info.training_run_id
        self.training_run_cuid = info.training_run_id
        self.model_id = info.base_model
        self.model_alias = info.base_model
        self.lora = info.lora
        self._ticket_lock = threading.Lock()
        self._next_ticket = 0
        self._turn = asyncio.Condition()  # binds to the runtime loop on first use
        self._now_serving = 0
        self._next_seq = info.last_seq_id + 1
        self._broken: str | None = None
        self._ops_done = 0
        # submitted ops whose result has not arrived (configure(training_event_max_in_flight=...)); taken in
        # ticket order, so a call waiting for a slot also holds back the calls made after it
        self._in_flight = asyncio.Semaphore(self._rt.config.training_event_max_in_flight)

    # --- ordered submission ---------------------------------------------------------------------------

    def _enqueue(self, payload: Any, convert: Callable[[dict], Any], operation: str) -> APIFuture:
        if self._broken:
            raise TrainingRunBrokenError(self._broken, hint="create a new training client")
        with self._ticket_lock:
            ticket = self._next_ticket
            self._next_ticket += 1
        self._ops_done += 1
        return APIFuture(self._rt.submit(self._submit_and_wait(ticket, payload, convert, operation)))

    async def _submit_and_wait(self, ticket: int, payload: Any, convert: Callable[[dict], Any], operation: str) -> Any:
        async with self._turn:
            await self._turn.wait_for(lambda: self._now_serving == ticket)
        try:
            if self._broken:
                raise TrainingRunBrokenError(self._broken, hint="create a new training client")
            await self._in_flight.acquire()
            try:
                op = TrainingOp(seq_id=self._next_seq, payload=payload)
                raw = await self._rt.request(
                    "POST", f"/v1/training_runs/{self.training_run_id}/ops", body=op,
                    retry_window=self._rt.config.training_retry_timeout_seconds, operation=operation,
                    timeout=self._rt.config.actor_event_submit_timeout_seconds,
                )
            except BaseException as exc:
                self._in_flight.release()
                if isinstance(exc, PyTrioError) and exc.retryable:
                    # We cannot know whether the worker took this seq_id: later calls would be misordered.
                    self._broken = f"training run {self.training_run_id} lost contact during {operation}: {exc.message}"
                raise
            self._next_seq += 1
        finally:
            async with self._turn:
                self._now_serving += 1
                self._turn.notify_all()
        try:
            accepted = Accepted.model_validate(raw)
            result = await self._rt.wait_for_request(
                accepted.request_id, operation, retry_window=self._rt.config.training_retry_timeout_seconds)
        finally:
            self._in_flight.release()
        return convert(result)

    # --- forward / backward -----------------------------------------------------------------------------

    def _forward_op(self, kind: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None) -> ForwardOp:
        name, wire = validate_batch(data, loss_fn, self._info.vocab_size, self._info.limits.max_seq_len)
        return ForwardOp(op=kind, loss_fn=name, loss_fn_config=dict(loss_fn_config or {}), data=wire)

    def forward(self, data: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict[str, object] | None = None, auto_shift: bool = False
                ) -> APIFuture[ForwardBackwardOutput]:
        data = _maybe_shift(data, auto_shift)
        return self._enqueue(self._forward_op("forward", data, loss_fn, loss_fn_config), _to_fb_output, "forward")

    def forward_backward(self, data: list[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, object] | None = None, auto_shift: bool = False
                         ) -> APIFuture[ForwardBackwardOutput]:
        data = _maybe_shift(data, auto_shift)
        op = self._forward_op("forward_backward", data, loss_fn, loss_fn_config)
        return self._enqueue(op, _to_fb_output, "forward_backward")

    async def forward_async(self, *args: Any, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        return self.forward(*args, **kwargs)

    async def forward_backward_async(self, *args: Any, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(*args, **kwargs)

    def forward_backward_custom(self, data: list[Datum], loss_fn: Callable,
                                loss_fn_config: dict[str, object] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Any differentiable loss of the per-token logprobs, computed locally with torch.

        A forward pass returns the learner's logprobs; the user's loss runs here; its gradient with
        respect to each logprob is sent back as cross-entropy ``weights = -dL/dlogprob``, whose
        gradient (summed, not averaged, on the worker) equals the user's loss gradient exactly.
        """
        try:
            import torch
        except ImportError as exc:
            raise DependencyError("forward_backward_custom needs torch: pip install torch",
                                  code="dependency.missing_torch") from exc
        forward = self.forward(data, "cross_entropy").result()
        logprobs = []
        for i, out in enumerate(forward.loss_fn_outputs):
            if "logprobs" not in out:
                raise ValidationError(f"forward output {i} has no logprobs", code="validation.missing_logprobs")
            logprobs.append(torch.tensor(out["logprobs"].to_numpy(), dtype=torch.float32, requires_grad=True))
        if loss_fn_config is not None and _takes_three_args(loss_fn):
            loss, metrics = loss_fn(data, logprobs, loss_fn_config)
        else:
            loss, metrics = loss_fn(data, logprobs)
        loss.backward()
        surrogate = []
        for i, (datum, lp) in enumerate(zip(data, logprobs)):
            if lp.grad is None:
                raise ValidationError(f"the custom loss does not depend on logprobs of datum {i}",
                                      code="validation.missing_custom_loss_gradient")
            surrogate.append(Datum(
                model_input=datum.model_input,
                loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"],
                                "weights": TensorData.from_torch(-lp.grad)},
            ))
        user_metrics = {k: float(v) for k, v in dict(metrics or {}).items()}
        return self.forward_backward(surrogate, "cross_entropy").map(
            lambda out: ForwardBackwardOutput(loss_fn_outputs=out.loss_fn_outputs,
                                              metrics={**out.metrics, **user_metrics}))

    async def forward_backward_custom_async(self, *args: Any, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        return await asyncio.to_thread(self.forward_backward_custom, *args, **kwargs)

    # --- optimizer --------------------------------------------------------------------------------------

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        if not isinstance(adam_params, AdamParams):
            adam_params = AdamParams.model_validate(adam_params)
        return self._enqueue(OptimStepOp(adam_params=adam_params), OptimStepResponse.model_validate, "optim_step")

    async def optim_step_async(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self.optim_step(adam_params)

    # --- checkpoints ------------------------------------------------------------------------------------

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
                   ) -> APIFuture[SaveWeightsResponse]:
        op = SaveOp(op="save_state", name=checkpoint_name(name), ttl_seconds=ttl_seconds, overwrite=overwrite)
        return self._enqueue(op, lambda r: SaveWeightsResponse(**SaveResult.model_validate(r).model_dump()),
                             "save_state")

    async def save_state_async(self, *args: Any, **kwargs: Any) -> APIFuture[SaveWeightsResponse]:
        return self.save_state(*args, **kwargs)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None
                                 ) -> APIFuture[SaveWeightsForSamplerResponse]:
        op = SaveOp(op="save_weights_for_sampler", name=checkpoint_name(name), ttl_seconds=ttl_seconds)
        return self._enqueue(op, _to_sampler_save, "save_weights_for_sampler")

    async def save_weights_for_sampler_async(self, *args: Any, **kwargs: Any
                                             ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(*args, **kwargs)

    def load_state(self, path: str) -> APIFuture[dict]:
        return self._enqueue(LoadOp(path=path, load_optimizer=False), lambda r: {}, "load_state")

    def load_state_with_optimizer(self, path: str) -> APIFuture[dict]:
        return self._enqueue(LoadOp(path=path, load_optimizer=True), lambda r: {}, "load_state_with_optimizer")

    async def load_state_async(self, path: str) -> APIFuture[dict]:
        return self.load_state(path)

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[dict]:
        return self.load_state_with_optimizer(path)

    # --- sampling clients -------------------------------------------------------------------------------

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Snapshot the current adapter in worker memory (no disk round trip) and sample from it."""
        op = SaveOp(op="save_weights_for_sampler", name=checkpoint_name(name or f"temp-sampling-{uuid.uuid4().hex}"),
                    ttl_seconds=21600, ephemeral=name is None)
        saved = self._enqueue(op, _to_sampler_save, "save_weights_and_get_sampling_client").result()
        return self.create_sampling_client(saved.path)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        return await asyncio.to_thread(self.save_weights_and_get_sampling_client, name)

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return self._service.create_sampling_client(base_model=self.model_id, model_path=model_path)

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        return await asyncio.to_thread(self.create_sampling_client, model_path)

    def get_tokenizer(self) -> Any:
        return self._service._tokenizer_for(self.model_id)

    def get_info(self) -> TrainingRunInfo:
        return self._info


# --- conversions ----------------------------------------------------------------------------------------


def _to_fb_output(raw: dict) -> ForwardBackwardOutput:
    result = ForwardResult.model_validate(raw)
    outputs = [{k: v.to_tensor_data() for k, v in out.items()} for out in result.loss_fn_outputs]
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=result.metrics)


def _to_sampler_save(raw: dict) -> SaveWeightsForSamplerResponse:
    return SaveWeightsForSamplerResponse(**SaveResult.model_validate(raw).model_dump())


def _maybe_shift(data: list[Datum], auto_shift: bool) -> list[Datum]:
    """auto_shift=True: per-token inputs are given aligned with model_input (labels[i] = token i);
    shift them left so position i is trained to predict label i+1. The first label is dropped and the
    last position, which has no next label, is ignored (-100, zero weight/advantage)."""
    if not auto_shift:
        return data
    shifted = []
    for datum in data:
        inputs = {}
        for key, tensor in datum.loss_fn_inputs.items():
            pad = -100 if key == "target_tokens" else 0
            values = list(tensor.data[1:]) + [pad]
            inputs[key] = TensorData(data=values, dtype=tensor.dtype, shape=tensor.shape)
        shifted.append(Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return shifted


def _takes_three_args(fn: Callable) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_POSITIONAL for p in params) or len(params) >= 3


__all__ = ["TrainingClient"]
