"""A package's public names imported when first read (PEP 562), so importing the package
loads none of what they need (torch): ``fakepg`` and ``simddp.jobs`` use it. (``simddp``'s own
package keeps its copy: ``import simddp`` loads no fakepg at all.)"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: str, names: Mapping[str, str], submodules: Mapping[str, str] = {}
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``names`` maps a public name
    to the module (relative to ``package``) that defines it, ``submodules`` an attribute to the
    module it is; any other name is the package's submodule of that name, if it has one (as
    after the eager imports this replaces: ``fakepg.ops`` with only ``import fakepg``). A name
    is imported on its first read and then kept in the package, so later reads skip
    ``__getattr__``."""
    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(submodules[name], package)
        if name not in names:
            if not name.startswith("__"):
                try:
                    return importlib.import_module(f"{package}.{name}")
                except ModuleNotFoundError as e:
                    if e.name != f"{package}.{name}":
                        raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        module = sys.modules[package]
        return sorted(set(vars(module)) | set(getattr(module, "__all__", ())) | set(names)
                      | set(submodules))

    return __getattr__, __dir__
