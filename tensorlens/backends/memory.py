"""An in-memory backend: keeps every record in a list. Meant for tests and notebooks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tensorlens.backends.base import Backend, RunInfo
from tensorlens.records import StepRecord


class MemoryBackend(Backend):
    """Keeps records in :attr:`records`.

    >>> mem = MemoryBackend()
    >>> # hook = tl.Hook(backends=[mem]); ...; mem.records[0].scalar_dict()
    """

    name: ClassVar[str] = "memory"
    supports_tensors: ClassVar[bool] = True
    supports_replay: ClassVar[bool] = False  # what a sync sent would end with the sync
    main_process_only: ClassVar[bool] = False

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.run: RunInfo | None = None
        self.metadata: dict[str, Any] | None = None
        self.closed = False

    def open(self, run: RunInfo) -> None:
        self.run = run

    def write_metadata(self, metadata: Mapping[str, Any]) -> None:
        self.metadata = dict(metadata)

    def write(self, record: StepRecord) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True

    def scalars(self, key: str) -> dict[int, float]:
        """``{step: value}`` of one scalar key across train records."""
        return {r.step: r.scalar_dict()[key] for r in self.records if key in r.scalar_dict() and r.mode.value == "train"}
