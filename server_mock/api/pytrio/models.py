"""The served models as the PyTRIO protocol names them: ``alias`` is the worker's model name, ``model_id`` what the
SDK loads its tokenizer from (``Models.tokenizer_id``: ``--tokenizer-id NAME=ID``, else the hub id or the absolute
folder the model was served from). A client may name a model by either, since ``get_supported_models()`` returns
model ids. The run limits handed to the SDK drive how it splits its calls."""

from __future__ import annotations

from server_mock.api.pytrio import control_wire as cw
from server_mock.api.pytrio.state import PytrioState, model_cuid
from server_mock.errors import WorkerError


def resolve(state: PytrioState, name: str, field: str = "base_model") -> str:
    """The alias of the model a client names by alias or by model_id; 404 ``model_not_found`` otherwise."""
    models = state.service.models
    if models.is_served(name):
        return name
    for alias in sorted(set(models.sources) | set(models.hosts)):
        if models.tokenizer_id(alias) == name:
            return alias
    if models.lazy and name:  # the embedded worker loads what it is asked for
        return name
    served = ", ".join(sorted(models.sources)) or "none"
    raise WorkerError(404, "model_not_found", f"{field}: model {name!r} is not served here (served: {served}); "
                                              "name it by its alias or its model_id from GET /api/models", field)


def max_seq_len(state: PytrioState, alias: str) -> int:
    host = state.service.models.hosts.get(alias)
    limit = state.service.limits.max_seq_len
    return min(limit, host.max_seq_len) if host is not None and host.max_seq_len else limit


def trainer_limits(state: PytrioState, alias: str) -> cw.CapabilityOut:
    limits, options = state.service.limits, state.options
    tokens = min(options.pytrio_max_tokens_per_request or limits.max_tokens_per_request,
                 limits.max_tokens_per_request)
    datums = min(options.pytrio_max_batch_size or limits.max_datums_per_request, limits.max_datums_per_request)
    return cw.CapabilityOut(max_batch_size=datums, max_tokens_per_request=tokens,
                            max_seq_len=max_seq_len(state, alias))


def sampler_limits(state: PytrioState, alias: str) -> cw.CapabilityOut:
    limits = state.service.limits
    return cw.CapabilityOut(max_batch_size=limits.max_num_samples, max_tokens_per_request=limits.max_sample_tokens,
                            max_seq_len=max_seq_len(state, alias))


def catalog_item(state: PytrioState, alias: str) -> cw.ModelInfoOut:
    models = state.service.models
    host = models.hosts.get(alias)
    started = cw.utc(state.started)
    return cw.ModelInfoOut(cuid=model_cuid(alias), alias=alias, model_id=models.tokenizer_id(alias),
                           display_name=alias, context_length=host.max_seq_len if host is not None else None,
                           train_available=True, sample_available=True, trainer=trainer_limits(state, alias),
                           sampler=sampler_limits(state, alias), created_at=started, updated_at=started)


def preload(state: PytrioState, alias: str) -> None:
    """Start loading the model now (the run's first event needs it) without holding the Control answer."""
    models = state.service.models
    if alias not in models.hosts:
        state.spawn(models.host(alias), f"loading {alias}")
