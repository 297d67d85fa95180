"""The ``"local"`` backend: the run store on disk (see :mod:`tensorlens.store.schema`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from tensorlens.backends.base import Backend, RunInfo
from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.store.schema import METADATA_KEY, store_filename
from tensorlens.store.writer import RunStoreWriter


class LocalBackend(Backend):
    """Writes every record of this worker to ``<run_dir>/tensorlens.sqlite``."""

    name: ClassVar[str] = "local"
    supports_tensors: ClassVar[bool] = True
    supports_replay: ClassVar[bool] = False  # the stored run itself: sync reads it, never writes one
    main_process_only: ClassVar[bool] = False  # each worker keeps its own file
    critical: ClassVar[bool] = True

    def __init__(self) -> None:
        self._run: RunInfo | None = None
        self._writer: RunStoreWriter | None = None

    def open(self, run: RunInfo) -> None:
        path = os.path.join(run.run_dir, store_filename(f"worker_{run.rank}", primary=run.rank == 0))
        meta = {"run_name": run.run_name, "world_size": str(run.world_size), "config": json.dumps(run.config, default=str)}
        self._writer = RunStoreWriter(path, meta)
        self._run = run

    @property
    def path(self) -> str | None:
        return self._writer.path if self._writer else None

    def write_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Kept as JSON under ``meta.metadata`` (:meth:`tensorlens.Run.metadata` reads it back)."""
        assert self._writer is not None, "LocalBackend.write_metadata before open"
        meta = {METADATA_KEY: json.dumps(dict(metadata), default=str)}
        if self._run is not None and self._run.modules is not None:
            try:  # the module tree for the explorer: a failure here costs only the tree
                meta["modules"] = json.dumps(self._run.modules(), default=str)
            except Exception:
                pass
        self._writer.write_meta(meta)

    def write(self, record: StepRecord) -> None:
        assert self._writer is not None, "LocalBackend.write before open"
        self._writer.write(record)

    def write_finding(self, finding: Finding) -> None:
        assert self._writer is not None, "LocalBackend.write_finding before open"
        self._writer.write_finding(finding)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
