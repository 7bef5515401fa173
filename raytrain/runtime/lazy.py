"""A package's exported names, imported on first use (PEP 562): importing the package stays light."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, list[str]],
                 namespace: dict[str, Any]) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """(__all__, __getattr__, __dir__) of `package`: each name of `exports` ({module: [names]}, modules
    relative to the package) is imported from its module when first read, then kept in `namespace`."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return sorted(where), __getattr__, __dir__
