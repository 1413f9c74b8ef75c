"""Named registries: every name table of the package (advantage estimators, policy losses,
off-policy corrections, workflows, engines, weight transports, environments, rewards, Absolute
Zero domains, warm-start formats) is a :class:`Registry`. A decorator or ``add`` fills it; ``get``
fails with the valid names; ``resolve`` also takes an import path (``pkg.module:Name``) for a
component that lives outside the package, with one-line errors naming the config field.

A Registry reads as a mapping (``name in reg``, ``reg[name]``, ``dict(reg)``, iteration in
registration order)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RegistryError(KeyError, ValueError):
    """An unknown registry name. Both a KeyError and a ValueError, so either ``except`` works."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class Registry(Mapping, Generic[T]):
    def __init__(self, kind: str, items: dict[str, T] | None = None):
        self.kind = kind
        self._items: dict[str, T] = dict(items or {})

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: add the object under ``name`` (a second, different object is an error)."""

        def deco(obj: T) -> T:
            return self.add(name, obj)

        return deco

    def add(self, name: str, obj: T) -> T:
        if name in self._items and self._items[name] is not obj:
            current = getattr(self._items[name], "__qualname__", repr(self._items[name]))
            raise ValueError(f"{self.kind} {name!r} is already registered ({current})")
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:  # (no default: an unknown name is an error listing the valid ones)
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise RegistryError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def resolve(self, spec: str, field: str, listed: str = "built-in", what: str = "Name") -> Any:
        """A registered name, or an import path ``pkg.module:Name`` (imported); anything else is a
        ConfigError naming ``field`` and the registered names. A registered value that is itself an
        import path (a lazily loaded built-in) is imported."""
        from .config import ConfigError
        from .plugins import resolve_import

        if spec in self._items:
            obj = self._items[spec]
            return resolve_import(obj, field) if isinstance(obj, str) else obj
        if ":" not in spec and "." not in spec:
            raise ConfigError(
                f"{field}: unknown {self.kind} {spec!r}; {listed}: {', '.join(self._items)}, "
                f"or an import path 'pkg.module:{what}'"
            )
        return resolve_import(spec, field)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
