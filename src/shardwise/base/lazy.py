"""Lazy exports for a package (PEP 562: a module ``__getattr__`` and ``__dir__``).

A package whose submodules import torch exports its names through ``lazy_exports`` so that
importing one torch-free submodule (``shardwise.comm.cost`` for the planner) does not import
the others: ``shardwise plan`` for a named model then never imports torch (two seconds).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a public name to the
    submodule that defines it (``"all_reduce": "api"``); any other name that is a submodule
    (``comm.cost``) loads that submodule. A loaded name is cached in the package."""

    def __getattr__(name: str):
        if name in table:
            value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # __getattr__ runs once per name
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
