"""Which rules check a run when none are named: the default set, following what was recorded.

Every run is checked with :data:`~tensorlens.rules.builtin.DEFAULT_RULES` (non-finite values,
vanishing and spiking gradients, a loss that does not decrease or spikes): they read what
tensorlens records by default, so a run without it (no loss registered, say) is worth a "not
evaluated" note. The rules of :data:`~tensorlens.rules.builtin.DEFAULT_RULES_WHEN` read what is
recorded only on request (activations, dynamics, updates) and join when the run has it:
``DeadRelu`` for a run with ``activations/``, ``UpdateRatioOutOfRange`` for one with
``dynamics/`` or ``updates/``.

>>> [r.name for r in default_rules(["gradients", "losses", "activations"])]
['ExplodingTensor', 'NonFiniteGradient', 'VanishingGradient', 'GradientNormSpike', 'LossNotDecreasing', 'LossSpike', 'DeadRelu']
>>> default_rules(tl.open_run("tensorlens_runs/exp1"))                  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from tensorlens.rules.base import Rule
from tensorlens.rules.builtin import BUILTIN_RULES, DEFAULT_RULES, DEFAULT_RULES_WHEN
from tensorlens.rules.params import collection_of, kind_of


def recorded_kinds(recorded: Any) -> set[str]:
    """The kinds of tensors ``recorded`` holds: a stored run (a :class:`~tensorlens.Run` or its
    folder) by the names it holds; recording options (a :class:`tl.Options`, or anything with
    ``.options`` such as a Hook) or the ``config`` of a run's metadata by the collections they
    record; or an iterable of kind names."""
    from tensorlens.store.reader import Run, open_run  # only a run read from disk needs the store

    if isinstance(recorded, Mapping) and "collections" in recorded:  # metadata's config
        return {str(c) for c in recorded["collections"]} | ({"dynamics"} if recorded.get("dynamics") else set())
    if isinstance(recorded, (str, os.PathLike)):
        with open_run(os.fspath(recorded)) as run:
            return recorded_kinds(run)
    if isinstance(recorded, Run):
        return {kind_of(name) or collection_of(name) for name in recorded.tensor_names()}
    options = getattr(recorded, "options", recorded)
    if hasattr(options, "collections"):
        kinds = set(options.collections)
        if getattr(options, "dynamics_config", None) is not None:
            kinds.add("dynamics")
        return kinds
    if isinstance(recorded, Iterable):
        return {str(kind) for kind in recorded}
    raise TypeError(f"Expected a run, a run folder, recording options or kind names, but got {recorded!r}")


def default_rule_names(recorded: Any = None) -> list[str]:
    """The names of the default rules for what ``recorded`` holds (see :func:`recorded_kinds`;
    ``None``: the rules every run gets), in a stable order."""
    names = list(DEFAULT_RULES)
    kinds = set() if recorded is None else recorded_kinds(recorded)
    for kind, extra in DEFAULT_RULES_WHEN.items():
        if kind in kinds:
            names += [name for name in extra if name not in names]
    return names


def default_rules(recorded: Any = None) -> list[Rule]:
    """New instances of the default rules for what ``recorded`` holds (see :func:`recorded_kinds`)."""
    return [BUILTIN_RULES[name]() for name in default_rule_names(recorded)]


def default_note(name: str) -> str:
    """How a built-in rule is part of the default set, for listings: ``" (default)"``,
    ``" (default when activations are recorded)"`` or ``""``."""
    if name in DEFAULT_RULES:
        return " (default)"
    kinds = [kind for kind, extra in DEFAULT_RULES_WHEN.items() if name in extra]
    return f" (default when {' or '.join(kinds)} are recorded)" if kinds else ""
