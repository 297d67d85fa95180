"""Where ``tl.summarize_scalar`` / ``tl.summarize_tensor`` send their values: the live recorders.

Model code calls those functions without holding a recorder, so every recorder registers here when
it is created and leaves when it is closed. :mod:`tensorlens.capture.summaries` reads the list;
this module imports nothing of either (the recorder and the summaries meet here, no import cycle).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol


class SummaryTarget(Protocol):
    """What a summary is handed to (a :class:`~tensorlens.engine.recorder.Recorder`)."""

    def add_summary(self, name: str, value: Any, is_tensor: bool) -> None: ...


_live: list[weakref.ref[SummaryTarget]] = []
_lock = threading.Lock()


def register(target: SummaryTarget) -> None:
    with _lock:
        _live.append(weakref.ref(target))


def unregister(target: SummaryTarget) -> None:
    with _lock:
        _live[:] = [ref for ref in _live if ref() is not None and ref() is not target]


def any_live() -> bool:
    """Whether any target is registered: one list check, so summaries cost nothing without a hook."""
    return bool(_live)


def live() -> list[SummaryTarget]:
    return [target for target in (ref() for ref in list(_live)) if target is not None]
