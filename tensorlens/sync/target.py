"""One destination of ``tensorlens sync``: a backend that replays, and the sync's options for it.

There is one extension point per tracker, the :class:`~tensorlens.backends.base.Backend` class
registered with ``tl.register_backend(name, cls)``: it records live and, through its
``replay_*`` class methods, replays a stored run (the defaults make any backend replayable). A
:class:`SyncTarget` is what one sync knows of its destination: the backend class, the options
checked against its ``replay_options``, and the :class:`~tensorlens.backends.base.ReplayRun`
(the tracker run to continue and what the backend keeps for it) that the sync machinery stores
between sessions (:mod:`tensorlens.sync.state`). It is built by :func:`tensorlens.sync.sync_run`
from ``to=NAME``; it is no longer an extension point of its own.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from tensorlens._checks import expected
from tensorlens.backends.base import (
    Backend,
    ReplayRun,
    backend_class,
    register_backend,
    registered_backends,
    replaying_backends,
)


class SyncTarget:
    """A backend that replays and the options of one sync for it.

    >>> SyncTarget("tensorboard", logdir="tb").key        # doctest: +SKIP
    'tensorboard:/abs/tb'
    """

    #: the backend of a subclass bound to one (the deprecated ``WandbTarget``, ``MLflowTarget``,
    #: ``TensorBoardTarget`` of :mod:`tensorlens.integrations.sync_targets`)
    backend: ClassVar[str | None] = None

    def __init__(self, to: str | type[Backend] | None = None, /, **options: Any) -> None:
        name, cls = _replaying_backend(to if to is not None else type(self).backend)
        given = {k: v for k, v in options.items() if v is not None}  # None: not given (the command's unset flags)
        for option, value in given.items():
            if option not in cls.replay_options:
                takes = ", ".join(cls.replay_options) or "no options"
                raise expected(option, f"None with --to {name} (it takes {takes})", value)
        #: the ``--to`` name
        self.name = name
        self.backend_class = cls
        self.replay = ReplayRun(name, cls.replay_settings(given))

    @property
    def options(self) -> dict[str, Any]:
        """The options, checked and with the backend's defaults."""
        return self.replay.options

    @property
    def key(self) -> str:
        """Where the records go, as a stable string: what the sync state is kept under."""
        return self.backend_class.replay_destination(self.replay)

    @property
    def metadata_every_session(self) -> bool:
        return self.backend_class.replay_metadata_every_session

    @property
    def run_id(self) -> str | None:
        return self.replay.run_id

    @run_id.setter
    def run_id(self, value: str | None) -> None:
        self.replay.run_id = value

    @property
    def info(self) -> dict[str, Any]:
        return self.replay.info

    @info.setter
    def info(self, value: dict[str, Any]) -> None:
        self.replay.info = value

    def start(self, run_name: str, run_id: str | None) -> tuple[Backend, str]:
        """Open the tracker run (a new one named ``run_name`` when ``run_id`` is ``None``, else
        continue ``run_id``); returns the backend that writes into it (not yet opened) and the
        run's id."""
        self.replay.run_id = run_id
        return self.backend_class.open_for_replay(self.replay, run_name)

    def environment(self) -> dict[str, str]:
        return self.backend_class.replay_environment(self.replay)

    def check_state(self, run_id: str, info: dict[str, Any]) -> str | None:
        """What is wrong with the run id and info an earlier sync kept (untrusted), or ``None``."""
        return self.backend_class.check_replay_state(ReplayRun(self.name, self.replay.options, run_id, info))

    def finish(self) -> None:
        """After the backend was closed: end the tracker run."""
        self.backend_class.finish_replay(self.replay)

    def describe(self) -> list[str]:
        return self.backend_class.describe_replay(self.replay)


def _replaying_backend(to: Any) -> tuple[str, type[Backend]]:
    """``(name, class)`` of ``to``: a registered name or a Backend class, one that replays."""
    if isinstance(to, type) and issubclass(to, Backend):
        name, cls = to.name, to
    elif isinstance(to, str) and to in replaying_backends():
        name, cls = to, backend_class(to)
    else:
        registered = isinstance(to, str) and to in registered_backends()
        raise expected(
            "to", f"one of {replaying_backends()} (a backend registered with tl.register_backend), a Backend class "
            f"or a SyncTarget{' (this backend sets supports_replay = False)' if registered else ''}", to,
        )
    if not cls.supports_replay:
        raise expected("to", f"a backend that replays ({cls.__name__} sets supports_replay = False)", to)
    return name, cls


def sync_target_names() -> list[str]:
    """The ``--to`` names: the registered backends that replay."""
    return replaying_backends()


def register_sync_target(name: str, target: type[Backend]) -> None:
    """Deprecated: ``tl.register_backend(name, cls)`` makes a backend record live and replay."""
    if not (isinstance(target, type) and issubclass(target, Backend)):
        raise expected(
            "target", "a Backend class (a backend replays through its replay_* class methods; "
            "register it with tl.register_backend, see docs/backends.md)", target,
        )
    warnings.warn("register_sync_target is deprecated: use tl.register_backend(name, cls)", DeprecationWarning, stacklevel=2)
    register_backend(name, target)


def create_target(to: str | type[Backend] | SyncTarget, **options: Any) -> SyncTarget:
    """The destination ``to`` with ``options`` (``None`` values: not given)."""
    if isinstance(to, SyncTarget):
        given = sorted(k for k, v in options.items() if v is not None)
        if given:  # they would be ignored: the target was built with its own
            raise expected(given[0], "None when `to` is a SyncTarget (give it to the target)", options[given[0]])
        return to
    return SyncTarget(to, **options)
