"""Table definitions, one module per area; importing this package registers them all on Base.metadata."""

import importlib
import pkgutil

from gpuyard.store.base import Base

for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["Base"]
