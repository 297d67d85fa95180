"""Sync targets: where ``tensorlens sync`` replays a stored run.

A target is one tracker run (new, or the one an earlier sync wrote) and the backend a live run
would use to write into it: :class:`~tensorlens.integrations.wandb.WandbBackend`,
:class:`~tensorlens.integrations.mlflow.MLflowBackend` or
:class:`~tensorlens.integrations.tensorboard.TensorBoardBackend`. The targets themselves live in
:mod:`tensorlens.integrations.sync_targets` (they import the trackers); this module holds their
base class and the name registry, so the core imports no tracker.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, ClassVar

from tensorlens._checks import expected
from tensorlens.backends.base import Backend


class SyncTarget:
    """One destination of a sync.

    Subclasses set :attr:`name`, validate their options in ``__init__`` (eagerly, with the
    usual "Expected ..." errors) and implement :attr:`key`, :meth:`start` and :meth:`finish`.
    """

    #: The ``--to`` name.
    name: ClassVar[str] = "target"
    #: Send the run metadata in every session, not only when the tracker run is created (each
    #: W&B offline session is a folder of its own, uploaded on its own).
    metadata_every_session: ClassVar[bool] = False
    #: The keyword options it takes (``tensorlens sync`` passes all; the others must be ``None``).
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        #: Kept in the sync state between sessions (JSON): what the target needs to continue.
        self.info: dict[str, Any] = {}
        #: The tracker run, once started (or known from an earlier session).
        self.run_id: str | None = None

    @classmethod
    def from_options(cls, **options: Any) -> SyncTarget:
        """The target from the options of ``tensorlens sync``; an option it does not take is an error."""
        for option, value in options.items():
            if value is not None and option not in cls.options:
                takes = ", ".join(cls.options) or "no options"
                raise expected(option, f"None with --to {cls.name} (it takes {takes})", value)
        return cls(**{k: v for k, v in options.items() if k in cls.options and v is not None})

    @property
    def key(self) -> str:
        """Where the records go, as a stable string: what the sync state is kept under."""
        raise NotImplementedError

    def start(self, run_name: str, run_id: str | None) -> tuple[Backend, str]:
        """Open the tracker run (a new one named ``run_name`` when ``run_id`` is ``None``, else
        continue ``run_id``); returns the backend that writes into it (not yet opened) and the
        run's id."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Environment variables to set while the sync runs (those the user has set are kept):
        the tracker client's network timeouts and retries, so a tracker that goes away fails
        the sync in seconds rather than minutes."""
        return {}

    def check_state(self, run_id: str, info: dict[str, Any]) -> str | None:
        """What is wrong with the tracker run id and ``info`` kept from an earlier sync (read from
        a file, so untrusted: the id names folders and URLs), or ``None``. The default takes ids
        of word characters, ``.``, ``-`` and ``%`` that do not start with ``.``: one path
        component, never ``..``."""
        if not _RUN_ID.fullmatch(run_id):
            return f"the tracker run id {run_id!r} is not one (it would name a folder or URL outside the tracker's)"
        return None

    def finish(self) -> None:  # noqa: B027 - optional hook
        """After the backend was closed: end the tracker run (W&B ``finish``, MLflow ``FINISHED``)."""

    def describe(self) -> list[str]:
        """Lines for the user: where the run went, and what to do next (``wandb sync ...``);
        also called without :meth:`start` when there was nothing new to send."""
        return []


_RUN_ID = re.compile(r"[A-Za-z0-9_%\-][A-Za-z0-9_.%\-]{0,254}")

_TARGETS: dict[str, str | type[SyncTarget]] = {
    "wandb": "tensorlens.integrations.sync_targets:WandbTarget",
    "mlflow": "tensorlens.integrations.sync_targets:MLflowTarget",
    "tensorboard": "tensorlens.integrations.sync_targets:TensorBoardTarget",
}


def sync_target_names() -> list[str]:
    return sorted(_TARGETS)


def register_sync_target(name: str, target: type[SyncTarget]) -> None:
    """Make ``tensorlens sync RUN --to name`` (and ``sync_run(..., to=name)``) use ``target``.

    >>> class Printer(SyncTarget): ...       # doctest: +SKIP
    >>> register_sync_target("printer", Printer)   # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        raise expected("name", "a non-empty string", name)
    if not (isinstance(target, type) and issubclass(target, SyncTarget)):
        raise expected("target", "a subclass of tensorlens.sync.SyncTarget", target)
    _TARGETS[name] = target


def create_target(to: str | SyncTarget, **options: Any) -> SyncTarget:
    """The target named ``to`` built with ``options`` (those it does not take must be ``None``)."""
    if isinstance(to, SyncTarget):
        given = sorted(k for k, v in options.items() if v is not None)
        if given:  # they would be ignored: the target was built with its own
            raise expected(given[0], "None when `to` is a SyncTarget (give it to the target)", options[given[0]])
        return to
    if not isinstance(to, str) or to not in _TARGETS:
        raise expected("to", f"one of {sync_target_names()} or a SyncTarget", to)
    entry = _TARGETS[to]
    if isinstance(entry, str):
        module, attribute = entry.split(":")
        entry = _TARGETS[to] = getattr(importlib.import_module(module), attribute)
    return entry.from_options(**options)  # type: ignore[attr-defined,union-attr]
