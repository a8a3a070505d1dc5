"""Names in Tinker's terms: ``tinker://`` checkpoint paths, messages that mention them, metric keys.

``tinker://<run>/weights/<name>`` is the worker's ``trio://<run>/state/<name>`` and
``tinker://<run>/sampler_weights/<name>`` its ``trio://<run>/sampler/<name>``.
"""

from __future__ import annotations

import re

from server_mock.errors import bad_request

REDUCTIONS = {"mean", "sum", "min", "max", "slack", "hash2", "unique"}

# anchored with \Z, not $ (which also matches before a trailing newline)
_PATH_RE = re.compile(r"^tinker://(?P<run>[^/]+)/(?P<kind>weights|sampler_weights|external_weights)/(?P<name>[^/]+)\Z")
_TRIO_FULL_RE = re.compile(r"^trio://(?P<run>[^/]+)/(?P<kind>state|sampler)/(?P<name>[^/]+)\Z")
_TRIO_PATH_RE = re.compile(r"trio://(?P<run>[^/\s'\"]+)/(?P<kind>state|sampler)/(?P<name>[^/\s'\",;]+)")
_TO_TRIO_KIND = {"weights": "state", "sampler_weights": "sampler"}
_TO_TINKER_KIND = {v: k for k, v in _TO_TRIO_KIND.items()}


def to_trio_path(path: str, field_name: str = "path") -> str:
    match = _PATH_RE.fullmatch(path) if isinstance(path, str) else None
    if not match:
        raise bad_request(field_name, f"{_clip(path)} is not a checkpoint path: expected "
                                      "tinker://<run>/weights/<name> or tinker://<run>/sampler_weights/<name>",
                          code="invalid_checkpoint_path")
    if match["kind"] == "external_weights":
        raise bad_request(field_name, "external_weights checkpoints are exports to download "
                                      "(get_external_weights_urls); they cannot be loaded or sampled from: use the "
                                      "run's weights/ or sampler_weights/ checkpoint", code="invalid_checkpoint_path")
    return f"trio://{match['run']}/{_TO_TRIO_KIND[match['kind']]}/{match['name']}"


def to_tinker_path(path: str) -> str:
    match = _TRIO_FULL_RE.fullmatch(path or "")
    if not match:
        return path
    return f"tinker://{match['run']}/{_TO_TINKER_KIND[match['kind']]}/{match['name']}"


def tinker_message(message: str, field_name: str | None = None) -> str:
    """A service message in Tinker's terms: tinker:// paths, and the field named once."""
    message = _TRIO_PATH_RE.sub(
        lambda m: f"tinker://{m['run']}/{_TO_TINKER_KIND[m['kind']]}/{m['name']}", message)
    if field_name and message.startswith(f"{field_name}: {field_name}: "):
        message = message[len(field_name) + 2:]
    return message


def tinker_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The service's forward metrics as Tinker's ``name:reduction`` keys (the client splits on the colon).

    ``loss:sum`` is the summed loss; ``token_count:sum`` the contributing positions. ``loss_mean`` is
    dropped: the client merges chunks by datum-weighted mean, which would not give a per-token mean.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "token_count":
            out["token_count:sum"] = float(value)
        elif key.count(":") == 1 and key.split(":")[1] in REDUCTIONS:
            out[key] = float(value)
    if "loss:sum" not in out:
        out["loss:sum"] = float(metrics.get("loss_sum", 0.0))
    return out


def _clip(value: object) -> str:
    """A sent value for a message: its repr, cut to 100 characters."""
    text = repr(value[:100] if isinstance(value, str) else value)
    return text if len(text) <= 103 else text[:100] + "..."
