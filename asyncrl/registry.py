"""Named registries (advantage estimators, policy losses): a decorator to add, a lookup whose error
lists the valid names."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T", bound=Callable)


class RegistryError(KeyError, ValueError):
    """An unknown registry name. Both a KeyError and a ValueError, so either ``except`` works."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: add the function under ``name`` (a second, different function is an error)."""
        def deco(fn: T) -> T:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._items[name].__qualname__})")
            self._items[name] = fn
            return fn
        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise RegistryError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)
