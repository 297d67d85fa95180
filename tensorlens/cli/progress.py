"""Progress bars for commands that can take more than a second: tqdm on stderr, only when stderr
is a terminal (nothing in logs or pipes), and nothing at all when tqdm is not installed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress(total: int | None, description: str, unit: str = "step",
             enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """``with progress(n, "reading") as advance: ... advance(k)``; ``enabled=False`` when the
    command's own output goes to the same terminal (the bar would be drawn over it)."""
    if not enabled:
        yield lambda n: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield lambda n: None
        return
    # disable=None: tqdm turns itself off when stderr is not a terminal
    bar = tqdm(total=total, desc=description, unit=unit, disable=None, leave=False, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


def record_count(run: object, mode: str | None = None, worker: str | None = None) -> int | None:
    """About how many records ``run.records(mode=..., worker=...)`` yields (for a progress bar's total)."""
    try:
        modes = [mode] if mode is not None else [str(m) for m in run.modes()]  # type: ignore[attr-defined]
        workers = 1 if worker is not None else max(len(run.workers()), 1)  # type: ignore[attr-defined]
        return sum(len(run.steps(m)) for m in modes) * workers  # type: ignore[attr-defined]
    except Exception:
        return None
