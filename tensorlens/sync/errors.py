"""The errors of ``tensorlens sync``: one that stopped it, another sync holding the destination,
and SIGTERM (each leaves what was sent recorded, so the same sync continues it)."""

from __future__ import annotations

__all__ = ["SyncBusyError", "SyncError", "SyncTerminated"]


class SyncError(RuntimeError):
    """A sync stopped before the end; what was sent is recorded, the same sync continues it."""


class SyncBusyError(SyncError):
    """Another sync of the same run to the same destination is running: this one sent nothing."""


class SyncTerminated(KeyboardInterrupt):
    """The sync got SIGTERM: it stopped between two records, like Ctrl-C, with what was sent
    recorded. A ``KeyboardInterrupt``, so code that stops cleanly on Ctrl-C does here too; the
    command exits 143 (128 + SIGTERM)."""
