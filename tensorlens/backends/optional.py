"""One helper for optional dependencies: import on first use, or fail with the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_optional(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise an ImportError that names the pip extra that installs it.

    >>> import_optional("json", "none", "this example").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        raise ImportError(f"{purpose} needs the `{package}` package: pip install 'tensorlens[{extra}]'") from err


def is_lightning_logger(logger: object, class_name: str) -> bool:
    """Whether ``logger`` is (a subclass of) Lightning's ``class_name`` logger, in either namespace
    (``lightning.pytorch`` or ``pytorch_lightning``), without importing Lightning."""
    return any(
        cls.__name__ == class_name and cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
        for cls in type(logger).__mro__
    )
