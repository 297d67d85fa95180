"""What is recorded and when: which collections save a step (the save schedule), which collections
a tensor belongs to, and the :class:`~tensorlens.compute.jobs.TensorJob` that summarises it.

The :class:`Schedule` holds the collections and the default configs. Every question it answers is
asked for every tensor of every saved step, so the answers that only depend on the configs are
cached, and the caches are dropped whenever a collection or a config changes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tensorlens._checks import expected
from tensorlens.collection import ALIASES, KINDS, SCALAR_KINDS, Collection, Kind
from tensorlens.compute.jobs import ReducePlan, TensorJob, reduce_plan
from tensorlens.config import HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.modes import ModeKeys

#: Reductions recorded when neither the hook nor the collection says otherwise.
DEFAULT_REDUCTIONS = ReductionConfig()
DEFAULT_ACTIVATION_REDUCTIONS = ReductionConfig(counts=("zero_fraction",))


class Schedule:
    """The collections of a recorder and what they ask for.

    >>> schedule = Schedule(SaveConfig(save_interval=10), None, HistogramConfig(), ["weights"])
    >>> sorted(schedule.saving(ModeKeys.TRAIN, 20)), sorted(schedule.saving(ModeKeys.TRAIN, 21))
    (['weights'], [])
    """

    def __init__(
        self,
        save_config: SaveConfig,
        reduction_config: ReductionConfig | None,
        histogram_config: HistogramConfig,
        include_collections: Iterable[str],
        include_regex: Iterable[str] | str | None = None,
    ) -> None:
        self.save_config = save_config
        self.reduction_config = reduction_config
        self.histogram_config = histogram_config
        self._collections: dict[str, Collection] = {kind: Collection(kind) for kind in KINDS}
        self._enabled: set[str] = set()
        self._saving_cache: tuple[ModeKeys, int, frozenset[str]] | None = None
        self.version = 0  # bumped by every change: what is derived from the configs is rebuilt
        self._capture_plans: dict[tuple[object, ...], ReducePlan | None] = {}
        self._plans_configs: tuple[object, ...] | None = None
        for name in include_collections:
            self.enable(name)
        if include_regex is not None:
            patterns = [include_regex] if isinstance(include_regex, str) else list(include_regex)
            self.get_collection("custom").include(*patterns)

    # ------------------------------------------------------------------ collections

    def enable(self, name: str) -> None:
        for kind in ALIASES.get(name, (name,)):
            self.get_collection(kind)
            self._enabled.add(kind)
        self.changed()

    def get_collection(self, name: str) -> Collection:
        """The collection called ``name``, created (as a custom collection) if new. Configuring a
        collection (``include``) enables it; built-ins are also enabled by ``include_collections``."""
        if name not in self._collections:
            self._collections[name] = Collection(name, on_change=self._collection_changed)
        collection = self._collections[name]
        collection.on_change = self._collection_changed
        if collection.patterns or not collection.builtin:
            self._enabled.add(name)
        self.changed()
        return collection

    def add_collection(self, collection: Collection) -> Collection:
        if not isinstance(collection, Collection):
            raise expected("collection", "a tl.Collection", collection)
        collection.on_change = self.changed
        self._collections[collection.name] = collection
        self._enabled.add(collection.name)
        self.changed()
        return collection

    def ensure_collection(self, name: str) -> Collection:
        """The collection ``name`` for ``save_tensor``: created (not enabled) if new."""
        if name not in self._collections:
            self._collections[name] = Collection(name, on_change=self.changed)
            self.changed()
        return self._collections[name]

    @property
    def collections(self) -> dict[str, Collection]:
        return dict(self._collections)

    def collection(self, name: str) -> Collection:
        return self._collections[name]

    def enabled_collections(self) -> list[str]:
        return sorted(n for n in self._enabled if n in self._collections and self._collections[n].kinds)

    def is_enabled(self, name: str) -> bool:
        return name in self._enabled

    def _collection_changed(self) -> None:
        """A collection from :meth:`get_collection` changed: one given patterns since
        (``get_collection("activations").include(...)``) is enabled, as documented."""
        for name, collection in self._collections.items():
            if collection.patterns and collection.kinds:
                self._enabled.add(name)
        self.changed()

    def changed(self) -> None:
        """Forget what was derived from the collections (called on every change)."""
        self._saving_cache = None
        self.version += 1

    # ------------------------------------------------------------------ the save schedule

    def saving(self, mode: ModeKeys, mode_step: int) -> frozenset[str]:
        """Names of the enabled collections that save this (mode, mode step)."""
        cache = self._saving_cache
        if cache is not None and cache[0] == mode and cache[1] == mode_step:
            return cache[2]
        saving = frozenset(
            name
            for name in self._enabled
            if (c := self._collections.get(name)) is not None
            and (c.save_config or self.save_config).should_save(mode, mode_step)
        )
        self._saving_cache = (mode, mode_step, saving)
        return saving

    def saves(self, collection: str, mode: ModeKeys, mode_step: int) -> bool:
        """Whether ``collection`` (enabled or not, e.g. one only written by ``save_tensor``) saves
        this step by its own save config or the recorder's."""
        c = self._collections.get(collection)
        return c is not None and (c.save_config or self.save_config).should_save(mode, mode_step)

    def collections_for(self, kind: str, name: str, saving: frozenset[str]) -> list[Collection]:
        return [c for n in saving if (c := self._collections[n]).matches(kind, name)]

    def with_kinds(self, saving: frozenset[str], kinds: Iterable[str]) -> list[Collection]:
        """The collections saving now that hold any of ``kinds``."""
        wanted = set(kinds)
        return [c for n in saving if wanted & set((c := self._collections[n]).kinds)]

    # ------------------------------------------------------------------ jobs

    def reduction(self, collection: Collection, kind: str) -> ReductionConfig:
        return collection.reduction_config or self.reduction_config or (
            DEFAULT_ACTIVATION_REDUCTIONS if kind == Kind.ACTIVATIONS else DEFAULT_REDUCTIONS
        )

    def job(
        self, collection: Collection, kind: str, name: str, pieces: list[torch.Tensor], partitioned: bool = True
    ) -> TensorJob:
        reduction = self.reduction(collection, kind)
        return TensorJob(
            name=collection.record_name(kind, name),
            pieces=pieces,
            stats=reduction.stat_names(),
            histogram=collection.histogram_config or self.histogram_config,
            save_raw=reduction.save_raw_tensor,
            save_shape=reduction.save_shape,
            plain_scalar=kind in SCALAR_KINDS,
            partitioned=partitioned,
        )

    def capture_plan(self, mode: ModeKeys, kind: str, module_name: str, saving: frozenset[str]) -> ReducePlan | None:
        """How to reduce a large tensor captured from ``module_name`` at once, in its hook: one plan
        per (mode, kind, module) while the configs that decide it are unchanged, or ``None`` when
        some job that records it needs its values (a raw save, another histogram)."""
        configs = (
            saving, self.reduction_config, self.histogram_config,
            *((c.name, c.kinds, c.reduction_config, c.histogram_config, tuple(p.pattern for p in c.patterns))
              for c in (self._collections[n] for n in sorted(saving))),
        )
        if configs != self._plans_configs:
            self._capture_plans.clear()
            self._plans_configs = configs
        key = (mode, kind, module_name)
        if key not in self._capture_plans:
            jobs = [self.job(c, kind, module_name, []) for c in self.collections_for(kind, module_name, saving)]
            usable = jobs and not any(job.save_raw or job.histogram != jobs[0].histogram for job in jobs)
            stats = tuple(dict.fromkeys(stat for job in jobs for stat in job.stats))
            self._capture_plans[key] = reduce_plan(stats, jobs[0].histogram) if usable else None
        return self._capture_plans[key]
