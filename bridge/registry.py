"""The handler registry: explicit, stable names (SPEC §8.1). Registering a name twice is an error."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bridge.handler_api import HandlerFn


class RegistryError(ValueError):
    pass


@dataclass(frozen=True)
class Handler:
    name: str
    fn: HandlerFn
    version: str | None = None

    @property
    def is_async(self) -> bool:
        # A callable object with `async def __call__` (e.g. the HTTP handler) counts too.
        call = type(self.fn).__call__ if not inspect.isfunction(self.fn) else None
        return inspect.iscoroutinefunction(self.fn) or (call is not None and inspect.iscoroutinefunction(call))


class Registry:
    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def register(self, name: str, fn: HandlerFn, version: str | None = None) -> Handler:
        if not name or not isinstance(name, str):
            raise RegistryError("a handler name must be a non-empty string")
        if name in self._handlers:
            raise RegistryError(f"handler {name!r} is already registered; names are one-shot")
        if not callable(fn):
            raise RegistryError(f"handler {name!r}: {fn!r} is not callable")
        handler = Handler(name, fn, version)
        self._handlers[name] = handler
        return handler

    def handler(self, name: str, version: str | None = None) -> Callable[[HandlerFn], HandlerFn]:
        """Decorator form: `@registry.handler("charge-payment", version="v3")`."""

        def decorate(fn: HandlerFn) -> HandlerFn:
            self.register(name, fn, version)
            return fn

        return decorate

    def extended(self, extra: dict[str, HandlerFn]) -> Registry:
        """A new registry with these handlers added; a name already taken is an error."""
        out = Registry()
        out._handlers = dict(self._handlers)
        for name, fn in extra.items():
            out.register(name, fn)
        return out

    def get(self, name: str) -> Handler | None:
        return self._handlers.get(name)

    def names(self) -> list[str]:
        return sorted(self._handlers)

    def __contains__(self, name: object) -> bool:
        return name in self._handlers


# The process-wide registry that `handlers/` modules register into on import.
REGISTRY = Registry()
register = REGISTRY.register
handler = REGISTRY.handler


def load_handler_modules(modules: Iterable[str]) -> Registry:
    """Import the configured handler modules (they register themselves) and return the registry."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise RegistryError(f"cannot import handler module {module!r}: {e}") from e
    return REGISTRY
