"""AdminService: what the admin routes do. Load a model under a new name, or swap the engine behind a
served name blue/green (the new core is built in a thread, its tokenizer loaded and the engine warmed up
while the old one serves; then the registry switches atomically and the old serving drains in the
background); remove a model; list every serving with its replicas."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from pagedserve.config import ModelSpec
from pagedserve.engine.core_client import EngineCapacityError
from pagedserve.entrypoints.admin.protocol import LoadModelRequest
from pagedserve.entrypoints.model_serving import FAILED, LOADING, READY, ModelServing
from pagedserve.entrypoints.openai.request_checks import model_not_found
from pagedserve.entrypoints.serving.errors import APIError, bad_request
from pagedserve.tokenizer import load_tokenizer, tokenizer_path

if TYPE_CHECKING:
    from pagedserve.entrypoints.context import ServerContext

logger = logging.getLogger("pagedserve.admin")

GGUF_MAGIC = b"GGUF"


def conflict(message: str) -> APIError:
    return APIError(message, 409, code="conflict", type="conflict_error")


def model_entry(serving: ModelServing) -> dict[str, Any]:
    """One serving in ``GET /admin/models``: its name, model path, state, engine, dtype and replicas."""
    return {
        "name": serving.name,
        "model": serving.model_path,
        "state": serving.state,
        "engine": serving.spec.engine,
        "dtype": serving.core.model_info.dtype,
        "replicas": [
            {
                "id": status.replica_id,
                "pid": status.pid,
                "node": status.node,
                "running": status.stats.num_running,
                "waiting": status.stats.num_waiting,
                "kv_usage": status.stats.kv_cache_usage,
            }
            for status in serving.core.replica_statuses()
        ],
    }


def check_model_path(path: str) -> None:
    """400 unless ``path`` looks like a model: a GGUF file, or a directory with a config.json."""
    if not os.path.exists(path):
        raise bad_request(f"The model path {path!r} does not exist.", "model")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise bad_request(f"{path!r} is not a model: a Hugging Face directory has a config.json.", "model")
        return
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise bad_request(f"The model file {path!r} cannot be read: {exc.strerror}.", "model") from None
    if magic != GGUF_MAGIC:
        raise bad_request(f"{path!r} is not a model: expected a .gguf file or a Hugging Face directory.", "model")


class AdminService:
    """Loads, swaps and removes the models of one server. At most one load per name at a time (else 409)."""

    def __init__(self, context: ServerContext) -> None:
        self.context = context
        self._loading: dict[str, dict[str, Any]] = {}  # name -> its pending entry
        self._failed: dict[str, dict[str, Any]] = {}  # name -> the entry of its last failed load

    # ----------------------------------------------------------------- listing
    def list_models(self) -> list[dict[str, Any]]:
        """Failed and pending loads, draining servings, then the current ones (last: a mapping by name
        keeps the current serving of each name)."""
        registry = self.context.registry
        others = [*self._failed.values(), *self._loading.values(), *map(model_entry, registry.retiring())]
        return others + [model_entry(serving) for serving in registry.servings()]

    # ----------------------------------------------------------------- loading and swapping
    def start_load(self, request: LoadModelRequest) -> tuple[ModelSpec, asyncio.Task]:
        """Check the request (400 / 409 / 503) and start loading in the background; the task returns the
        new serving once it is current, or raises APIError (the old engine, if any, still serving)."""
        state = self.context.state
        if state.draining or not state.ready:
            raise APIError("The server is starting or shutting down; retry later.", 503, code="service_unavailable")
        spec = self._spec_for(request)
        if spec.name in self._loading:
            raise conflict(f"A load of {spec.name!r} is already in progress; wait for it to finish.")
        self._loading[spec.name] = {
            "name": spec.name,
            "model": spec.engine_config.model.model,
            "state": LOADING,
            "engine": spec.engine,
            "dtype": spec.engine_config.model.dtype,
            "replicas": [],
        }
        self._failed.pop(spec.name, None)
        task = self.context.spawn(self._load(spec), name=f"load-model-{spec.name}")
        task.add_done_callback(_retrieve_exception)
        return spec, task

    def _spec_for(self, request: LoadModelRequest) -> ModelSpec:
        if request.quantization not in (None, "none", "int8", "int4", "gguf"):
            raise bad_request("quantization must be one of none, int8, int4, gguf.", "quantization")
        if request.quantization == "gguf" and not request.model.endswith(".gguf"):
            raise bad_request("quantization 'gguf' needs a .gguf model file; use int8 or int4.", "quantization")
        check_model_path(request.model)
        current = self.context.registry.get(request.name)
        name = current.name if current is not None else request.name  # an alias swaps its model
        base = self.context.config.default_model
        model = dataclasses.replace(
            base.engine_config.model,
            model=request.model,
            tokenizer=None,
            dtype=request.dtype or base.engine_config.model.dtype,
            served_model_name=name,
            quantization=request.quantization or base.engine_config.model.quantization,
        )
        replicas = request.replicas or (current.spec.replicas if current is not None else 1)
        if self.context.config.cluster is None and replicas != 1:
            raise bad_request("replicas > 1 need engine replicas on Ray (start with --replicas or --ray-address).")
        try:
            return ModelSpec(
                name=name,
                engine_config=dataclasses.replace(base.engine_config, model=model),
                engine=request.engine or (current.spec.engine if current is not None else base.engine),
                replicas=replicas,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def _load(self, spec: ModelSpec) -> ModelServing:
        context = self.context
        registry = context.registry
        logger.info("model %r: loading %s", spec.name, spec.engine_config.model.model)
        try:
            try:
                core = await asyncio.to_thread(context.factory.create, spec, at_startup=False)
            except ValueError as exc:
                raise bad_request(str(exc)) from exc
            except EngineCapacityError as exc:
                raise conflict(f"Loading {spec.name!r} failed: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - the reason goes to the client
                raise APIError(f"Loading {spec.name!r} failed: {exc}", 500) from exc
            serving = None
            try:
                tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path(spec.engine_config.model))
                current = registry.get(spec.name)
                names = current.names if current is not None else (spec.name,)
                serving = context.new_serving(spec, names, core, tokenizer)
                await serving.start()
                if serving.engine.is_dead:
                    raise RuntimeError("the new engine died while warming up")
            except BaseException as exc:
                if serving is not None:
                    serving.state = FAILED
                    await serving.shutdown()
                else:
                    await core.shutdown()
                if not isinstance(exc, Exception):
                    raise
                raise APIError(f"Loading {spec.name!r} failed: {exc}", 500) from exc
            serving.state = READY
            if spec.name in registry:
                old = registry.replace(serving)
                context.spawn(registry.retire(old, context.config.http.request_timeout), name=f"retire-{spec.name}")
                logger.info("model %r: now served by %s; draining the old engine", spec.name, serving.model_path)
            else:
                registry.add(serving)
                logger.info("model %r: now served (%s)", spec.name, serving.model_path)
            return serving
        except APIError as exc:
            logger.error("model %r: load failed: %s", spec.name, exc.message)
            self._failed[spec.name] = {**self._loading[spec.name], "state": FAILED, "error": exc.message}
            raise
        finally:
            self._loading.pop(spec.name, None)

    # ----------------------------------------------------------------- removing
    def remove(self, name: str) -> ModelServing:
        """Stop serving ``name`` (404 unknown, 409 the last model or a load in progress); it drains and shuts
        down in the background."""
        registry = self.context.registry
        serving = registry.get(name)
        if serving is None:
            raise model_not_found(name)
        if len(registry) == 1:
            raise conflict(f"{name!r} is the last model served; load another one before removing it.")
        if serving.name in self._loading:
            raise conflict(f"A load of {serving.name!r} is in progress; wait for it to finish.")
        registry.remove(serving.name)
        timeout = self.context.config.http.request_timeout
        self.context.spawn(registry.retire(serving, timeout), name=f"retire-{serving.name}")
        logger.info("model %r: removed; draining its engine", serving.name)
        return serving


def _retrieve_exception(task: asyncio.Task) -> None:
    """A load nobody awaits (``?wait=false``) reports its error through GET /admin/models, not a warning."""
    if not task.cancelled():
        task.exception()
