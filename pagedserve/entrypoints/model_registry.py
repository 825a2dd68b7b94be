"""ModelRegistry: served name -> the current ModelServing behind it. ``acquire`` resolves a request's
``model`` (empty: the default, the first model; unknown: 404) and takes a lease in the same step;
``add`` / ``replace`` (one assignment: the atomic switch of a blue/green swap) / ``remove`` change what
is served; ``retire`` drains a serving that is no longer current and shuts it down."""

from __future__ import annotations

import logging

from pagedserve.entrypoints.model_serving import DRAINING, ModelServing
from pagedserve.entrypoints.openai.request_checks import model_not_found

logger = logging.getLogger("pagedserve.server")


class _Slot:
    """What one model's names point to; a swap changes ``serving`` for all of them at once."""

    __slots__ = ("serving",)

    def __init__(self, serving: ModelServing) -> None:
        self.serving = serving


class ModelRegistry:
    """The served models, in the order they were added (the first is the default). One event loop, no locks."""

    def __init__(self) -> None:
        self._models: dict[str, _Slot] = {}  # the first name of each model -> its slot, in order
        self._names: dict[str, _Slot] = {}  # every served name (aliases too) -> its model's slot
        self._default: _Slot | None = None
        self._retiring: list[ModelServing] = []

    # ----------------------------------------------------------------- requests
    def acquire(self, model: str | None) -> ModelServing:
        """The serving for ``model`` with a lease taken (give it back with ``release``); 404 if not served."""
        serving = self.resolve(model)
        serving.leases += 1
        return serving

    def resolve(self, model: str | None) -> ModelServing:
        """The serving for ``model`` (no lease: for what ends before the next ``await``); 404 if not served."""
        slot = self._names.get(model) if model else self._default
        if slot is None:
            raise model_not_found(model or "")
        return slot.serving

    # ----------------------------------------------------------------- what is served
    @property
    def default(self) -> ModelServing:
        assert self._default is not None, "no model is served"
        return self._default.serving

    def get(self, name: str) -> ModelServing | None:
        """The current serving of a served name (or alias), None if not served."""
        slot = self._names.get(name)
        return None if slot is None else slot.serving

    def servings(self) -> list[ModelServing]:
        """The current serving of each model, the default first."""
        return [slot.serving for slot in self._models.values()]

    def served_names(self) -> list[str]:
        """Every name clients may use, in order (each model's names together)."""
        return [name for slot in self._models.values() for name in slot.serving.names]

    def retiring(self) -> list[ModelServing]:
        """Servings no longer current, still draining."""
        return list(self._retiring)

    def is_current(self, serving: ModelServing) -> bool:
        slot = self._models.get(serving.name)
        return slot is not None and slot.serving is serving

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    # ----------------------------------------------------------------- changes
    def add(self, serving: ModelServing) -> None:
        """Serve a new model under its names; ValueError if one of them is served already."""
        taken = [name for name in serving.names if name in self._names]
        if taken:
            raise ValueError(f"already served: {', '.join(taken)}")
        slot = _Slot(serving)
        self._models[serving.name] = slot
        for name in serving.names:
            self._names[name] = slot
        if self._default is None:
            self._default = slot

    def replace(self, serving: ModelServing) -> ModelServing:
        """Switch ``serving.name`` (and its aliases) to ``serving``; returns the serving it replaced.

        The new serving must carry the same names (``ServerConfig.names_of``); requests resolved before the switch keep
        their old serving (their leases), requests resolved after it get the new one.
        """
        slot = self._models.get(serving.name)
        if slot is None:
            raise KeyError(serving.name)
        if serving.names != slot.serving.names:
            raise ValueError(f"a replacement of {serving.name!r} must keep its names {slot.serving.names}")
        old, slot.serving = slot.serving, serving
        return old

    def remove(self, name: str) -> ModelServing:
        """Stop serving the model known as ``name``; returns its serving (KeyError if not served)."""
        slot = self._names[name]
        serving = slot.serving
        del self._models[serving.name]
        for alias in serving.names:
            self._names.pop(alias, None)
        if self._default is slot:
            self._default = next(iter(self._models.values()), None)
        return serving

    async def retire(self, serving: ModelServing, timeout: float | None) -> None:
        """Drain a serving that is no longer current (leases and unfinished requests to 0, or ``timeout``
        seconds), then shut its engine down."""
        serving.state = DRAINING
        self._retiring.append(serving)
        try:
            await serving.drain(timeout)
            await serving.shutdown()
            logger.info("model %r: the replaced engine (%s) is shut down", serving.name, serving.model_path)
        finally:
            self._retiring.remove(serving)
