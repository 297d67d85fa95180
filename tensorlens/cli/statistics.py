"""Statistic names given on the command line (``show --stat``, ``report --stat``), checked against
what the runs recorded: an unknown name is an error that lists the names that would work, never a
table or a page that silently leaves it out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import click

#: The statistic name ``show`` and ``export`` give a plain value (a loss): the statistic "".
PLAIN = "value"


def recorded_statistics(run: object, tensors: Iterable[str] | None = None) -> set[str]:
    """The statistic names ``run`` recorded for ``tensors`` (default: all of them); ``value`` for
    a plain scalar."""
    found: set[str] = set()
    names = run.tensor_names() if tensors is None else tensors  # type: ignore[attr-defined]
    for name in names:
        view = run.tensor(name)  # type: ignore[attr-defined]
        found.update(view.reduction_names())
    return found


def check_statistics(wanted: Sequence[str], recorded: Iterable[str], where: str = "these tensors") -> None:
    """Raise a one-line error naming the accepted statistics when one of ``wanted`` is not among
    ``recorded``."""
    recorded = set(recorded)
    missing = [s for s in wanted if s not in recorded]
    if missing:
        from tensorlens.stats.registry import STATISTICS

        unknown = [s for s in missing if s not in STATISTICS and s != PLAIN]
        message = (f"no statistic {', '.join(map(repr, missing))} recorded for {where}; "
                   f"accepted: {', '.join(sorted(recorded)) or 'none'}")
        if unknown:
            message += f" ({', '.join(map(repr, unknown))}: no such statistic in tensorlens)"
        raise click.ClickException(message)
