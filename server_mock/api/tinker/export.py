"""Tinker routes that take weights off the worker: external weights (``save_weights_external`` and their
per-file signed URLs), and the checkpoint archive of older SDKs.

What the 0.38 SDK and the cookbook do (read in their sources): ``tinker checkpoint download PATH`` and
``tinker_cookbook.weights.download`` load a ``weights`` checkpoint into a new training model, call
``save_weights_external("download", ttl_seconds=3600[, age_encryption_recipients=[key]])``, ask for
``.../external_weights/download/external_weights_urls`` (one signed URL per file, no tar), renew the export's
TTL each time they sign (the CLI fails if that call fails), fetch every URL with plain ``urllib`` (no API
key), decrypt ``.age`` files (the cookbook), and delete the export. Older SDKs' ``get_checkpoint_archive_url``
asked ``.../{kind}/{name}/archive`` and read the 302's ``Location`` and ``Expires``.

Naming of the exported adapter: Tinker's adapters call the output head ``model.unembed_tokens``, and the
cookbook's merge (``weights.build_hf_model``) maps that name to ``lm_head`` when the base model has a
separate head, or to the shared ``embed_tokens`` matrix when it ties them, which also moves the input
embeddings. The worker's head LoRA changes the output projection only, so the export uses Tinker's name for
models with a separate head (merging is then exact) and keeps PEFT's ``lm_head`` for tied ones: there the
cookbook's ``build_lora_adapter`` is exact, and its ``build_hf_model`` refuses ("'lm_head.weight' ... does not
exist in the model state dict") instead of writing a model that differs from the trained one;
``pytrio-compat export --merged`` writes the exact merged model of either kind (see docs/tinker.md).

The TTL and delete routes here serve ``external_weights`` checkpoints (the exports these tools make and
remove); they come before rest.py's routes for the other kinds, whose ``trio://`` paths exports do not have.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from email.utils import formatdate

from starlette.requests import Request
from starlette.responses import Response

from server_mock.api.downloads import ARCHIVE, Downloads, Served
from server_mock.api.tinker import schemas
from server_mock.api.tinker.endpoint import read_json
from server_mock.api.tinker.paths import to_trio_path
from server_mock.api.tinker.rest import MAX_TTL_SECONDS, MIN_TTL_SECONDS, run_id_of
from server_mock.api.tinker.state import TinkerState
from server_mock.api.tinker.submit import gated, read_op
from server_mock.errors import WorkerError, bad_request, raising
from server_mock.storage.encryption import parse_recipients

EXTERNAL = "tinker-external-weights"
TINKER_HEAD = "model.unembed_tokens"


def tinker_layout(tensors: dict, config: dict, tied_head: bool) -> tuple[dict, dict]:
    """The worker's PEFT adapter in Tinker's naming (see the module docstring for why tied heads keep theirs)."""
    if tied_head:
        return tensors, config
    renamed = {key.replace("base_model.model.lm_head.", f"base_model.model.{TINKER_HEAD}."): value
               for key, value in tensors.items()}
    targets = config.get("target_modules")
    if isinstance(targets, list):
        config = {**config, "target_modules": [TINKER_HEAD if t == "lm_head" else t for t in targets]}
    return renamed, config


def _ttl(value, field_name: str = "ttl_seconds") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_TTL_SECONDS <= value <= MAX_TTL_SECONDS:
        raise bad_request(field_name, f"must be an integer number of seconds in [{MIN_TTL_SECONDS}, {MAX_TTL_SECONDS}]"
                                      f" (1 hour to 10 years) or null for no expiry, got {value!r}")
    return value


def _run(state: TinkerState, request: Request, tenant: str) -> str:
    """The worker's run id in the URL: the run of a tinker:// path, or a Tinker model id."""
    return run_id_of(state, tenant, request.path_params["run"])


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


class Export:
    """The routes' shared state: the Tinker state and the worker's download URLs."""

    def __init__(self, state: TinkerState, downloads: Downloads) -> None:
        self.state = state
        self.downloads = downloads
        downloads.register(EXTERNAL, self._resolve_file)

    def _resolve_file(self, ref: str, tenant: str) -> Served:
        run_id, name, filename = json.loads(ref)
        checkpoints = self.state.service.checkpoints
        checkpoint = checkpoints.owned_export(run_id, name, tenant)
        folder = checkpoints.store.folder(checkpoint)
        if filename not in _files(folder):
            raise WorkerError(404, "not_found", "nothing to download at this URL")
        return Served(folder / filename, filename, f"{checkpoints.store.read_meta(checkpoint)['created_at']:.6f}")

    # --- POST /save_weights_external ------------------------------------------------------------------------

    async def save_weights_external(self, state: TinkerState, request: Request, tenant: str):
        body, size = await read_op(state, request, tenant, schemas.SaveWeightsExternal)
        model = state.model(body.model_id, tenant)
        name = body.path
        try:
            ttl = _ttl(body.ttl_seconds)
            recipients = parse_recipients(body.age_encryption_recipients)
        except WorkerError as exc:  # refused, but its seq_id is used up (a failed future), as read_op does:
            gated(state, tenant, model, body.seq_id, body.digest(), raising(exc), None, 0)  # nothing waits on it
            raise

        def payload():
            return state.service.runs.export_op(model.run_id, tenant, name, ttl, tinker_layout, recipients)

        def convert(result: dict) -> dict:
            return {"path": f"tinker://{result['run_id']}/external_weights/{result['name']}",
                    "size_bytes": result["size"], "type": "save_weights_external"}

        return gated(state, tenant, model, body.seq_id, body.digest(), payload, convert, size)

    # --- GET .../external_weights/{name}/external_weights_urls ------------------------------------------------

    async def external_weights_urls(self, state: TinkerState, request: Request, tenant: str):
        run_id, name = _run(state, request, tenant), request.path_params["name"]
        checkpoints = state.service.checkpoints
        checkpoint = await asyncio.to_thread(checkpoints.owned_export, run_id, name, tenant)
        files = await asyncio.to_thread(_files, checkpoints.store.folder(checkpoint))
        urls, expires = {}, None
        for filename in files:
            urls[filename], expires = await self.downloads.url_for(request, EXTERNAL,
                                                                   json.dumps([run_id, name, filename]), tenant)
        expires = expires or datetime.now(timezone.utc)
        return {"urls": urls, "expires": _iso(expires)}

    # --- PUT .../external_weights/{name}/ttl, DELETE .../external_weights/{name} ------------------------------

    async def set_ttl(self, state: TinkerState, request: Request, tenant: str):
        body = await read_json(request, state.json_limit)
        if "ttl_seconds" not in body:
            raise bad_request("ttl_seconds", "required: seconds from now, or null for no expiry")
        ttl = _ttl(body["ttl_seconds"])
        checkpoints = state.service.checkpoints
        checkpoint = await asyncio.to_thread(checkpoints.owned_export, _run(state, request, tenant),
                                             request.path_params["name"], tenant)
        await asyncio.to_thread(checkpoints.store.set_expiry, checkpoint, time.time() + ttl if ttl else None)
        return {}

    async def delete(self, state: TinkerState, request: Request, tenant: str):
        checkpoints = state.service.checkpoints
        checkpoint = await asyncio.to_thread(checkpoints.owned_export, _run(state, request, tenant),
                                             request.path_params["name"], tenant)
        await asyncio.to_thread(checkpoints.store.delete, checkpoint)
        return {}

    # --- GET .../{kind}/{name}/archive (tinker <= 0.30: get_checkpoint_archive_url) ---------------------------

    async def archive(self, state: TinkerState, request: Request, tenant: str):
        kind, name = request.path_params["kind"], request.path_params["name"]
        if kind == "external_weights":
            raise bad_request("checkpoint_id", "external weights are downloaded file by file: use "
                                               "RestClient.get_external_weights_urls", code="not_downloadable")
        run_id = _run(state, request, tenant)
        path = to_trio_path(f"tinker://{run_id}/{kind}/{name}", "checkpoint_id")
        url, expires = await self.downloads.url_for(request, ARCHIVE, path, tenant)
        body = json.dumps({"url": url, "expires": _iso(expires)})
        return Response(body, status_code=302, media_type="application/json",
                        headers={"Location": url, "Expires": formatdate(expires.timestamp(), usegmt=True)})


def _files(folder) -> list[str]:
    """The files of an export a client downloads: all but the worker's metadata and derived (dot) files."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "meta.json"
                  and not p.name.startswith("."))
