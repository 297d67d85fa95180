"""Writing the run store: one SQLite file per worker, one transaction per step (see
:mod:`tensorlens.store.schema` for the layout)."""

from __future__ import annotations

import json
import os
import time

from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.store.schema import _SCHEMA, SCHEMA_VERSION, connect, encode_array


class RunStoreWriter:
    """Writes records into one SQLite file, one transaction per record."""

    def __init__(self, path: str, meta: dict[str, str] | None = None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._db = connect(path)
        with self._db:
            self._db.executescript(_SCHEMA)
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            for key, value in (meta or {}).items():
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            self._db.execute("DELETE FROM meta WHERE key = 'ended_at'")  # a resumed run is being written again
        self._layouts: dict[tuple[str, tuple[object, ...]], int] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}  # written already: rewriting dirties pages

    def _layout(self, kind: str, names: tuple[object, ...]) -> int:
        """The id of a layout (written in the current transaction when new)."""
        key = (kind, names)
        found = self._layouts.get(key)
        if found is None:
            cursor = self._db.execute("INSERT INTO layouts (kind, names) VALUES (?, ?)", (kind, json.dumps(list(names))))
            found = int(cursor.lastrowid)
        return found

    def write(self, record: StepRecord) -> None:
        packed = record
        where = (str(packed.mode), packed.mode_step, packed.worker)
        new_layouts: dict[tuple[str, tuple[object, ...]], int] = {}
        with self._db:  # one transaction: a step is stored whole or not at all
            self._db.execute("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?)", (*where, packed.step, packed.wall_time))
            if packed.scalar_names:
                layout = self._layout("scalars", packed.scalar_names)
                new_layouts[("scalars", packed.scalar_names)] = layout
                data = packed.scalar_values.astype("<f8", copy=False).tobytes()
                self._db.execute("INSERT OR REPLACE INTO scalars VALUES (?, ?, ?, ?, ?)", (*where, layout, data))
            if packed.histogram_names:
                layout = self._layout("histograms", packed.histogram_names)
                new_layouts[("histograms", packed.histogram_names)] = layout
                self._db.execute(
                    "INSERT OR REPLACE INTO histograms VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        *where, layout, packed.counts.astype("<i8", copy=False).tobytes(),
                        packed.edges.astype("<f8", copy=False).tobytes(), packed.histogram_info.astype("<f8", copy=False).tobytes(),
                    ),
                )
            self._db.executemany(
                "INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(*where, t.tensor, packed.step, packed.wall_time, encode_array(t.value)) for t in packed.tensors],
            )
            shapes = {name: shape for name, shape in packed.shapes.items() if self._shapes.get(name) != shape}
            self._db.executemany(
                "INSERT OR REPLACE INTO shapes VALUES (?, ?)",
                [(name, json.dumps(list(shape))) for name, shape in shapes.items()],
            )
        # only once committed: after a failed transaction they must be written again
        self._layouts.update(new_layouts)
        self._shapes.update(shapes)

    def write_finding(self, finding: Finding) -> None:
        """Store one rule finding (its own transaction: findings are rare)."""
        with self._db:
            self._db.execute(
                "INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    finding.rule, int(finding.step), str(finding.mode), finding.mode_step, finding.worker, finding.tensor,
                    finding.message, None if finding.value is None else float(finding.value), time.time(),
                ),
            )

    def close(self) -> None:
        """Mark the run as ended (``meta.ended_at``: readers stop waiting for more steps) and close."""
        try:
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('ended_at', ?)", (repr(time.time()),))
        finally:
            self._db.close()
