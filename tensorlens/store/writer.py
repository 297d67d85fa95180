"""Writing the run store: one SQLite file per worker, one transaction per step (see
:mod:`tensorlens.store.schema` for the layout). Every row carries its checksum."""

from __future__ import annotations

import json
import os
import time

from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.store import jsontext
from tensorlens.store.schema import _SCHEMA, SCHEMA_VERSION, connect, encode_array, insert, with_checksum


class RunStoreWriter:
    """Writes records into one SQLite file, one transaction per record."""

    def __init__(self, path: str, meta: dict[str, str] | None = None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._db = connect(path)
        # tables and schema version in one transaction: a reader never sees tables without a
        # version (executescript would commit each CREATE on its own)
        self._db.execute("BEGIN")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            (layouts,), = self._db.execute("SELECT count(*) FROM layouts").fetchall()
            (shapes,), = self._db.execute("SELECT count(*) FROM shapes").fetchall()
            # how many rows these tables hold: a reader listing names notices a row gone missing
            rows = {"schema_version": SCHEMA_VERSION, "layout_rows": str(layouts), "shape_rows": str(shapes), **_strict(meta or {})}
            self._db.executemany(insert("meta"), [with_checksum(key, value) for key, value in rows.items()])
            self._db.execute("DELETE FROM meta WHERE key = 'ended_at'")  # a resumed run is being written again
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._layouts: dict[tuple[str, tuple[object, ...]], int] = {}
        # ids chosen here, not by SQLite, so that each layout row's checksum covers its id
        self._next_layout = 1 + (self._db.execute("SELECT max(id) FROM layouts").fetchone()[0] or 0)
        self._shapes: dict[str, tuple[int, ...]] = {}  # written already: rewriting dirties pages
        self._layout_rows = layouts

    def write_meta(self, values: dict[str, str]) -> None:
        """Set keys of the ``meta`` table (one transaction)."""
        values = _strict(values)
        with self._db:
            self._db.executemany(insert("meta"), [with_checksum(key, value) for key, value in values.items()])

    def _layout(self, kind: str, names: tuple[object, ...], new: dict[tuple[str, tuple[object, ...]], int]) -> int:
        """The id of a layout (written in the current transaction when new)."""
        key = (kind, names)
        found = self._layouts.get(key, new.get(key))
        if found is None:
            found = self._next_layout + len(new)
            self._db.execute(insert("layouts"), with_checksum(found, kind, json.dumps(list(names))))
            new[key] = found
        return found

    def write(self, record: StepRecord) -> None:
        packed = record
        where = (str(packed.mode), packed.mode_step, packed.worker)
        new_layouts: dict[tuple[str, tuple[object, ...]], int] = {}
        tensor_names = {t.tensor for t in packed.tensors}
        with self._db:  # one transaction: a step is stored whole or not at all
            for table in ("scalars", "histograms", "tensors"):  # a step written again replaces all its rows
                self._db.execute(f"DELETE FROM {table} WHERE mode = ? AND mode_step = ? AND worker = ?", where)
            self._db.execute(
                insert("steps"),
                with_checksum(*where, packed.step, packed.wall_time, int(bool(packed.scalar_names)),
                              int(bool(packed.histogram_names)), len(tensor_names)),
            )
            if packed.scalar_names:
                layout = self._layout("scalars", packed.scalar_names, new_layouts)
                data = packed.scalar_values.astype("<f8", copy=False).tobytes()
                self._db.execute(insert("scalars"), with_checksum(*where, layout, data))
            if packed.histogram_names:
                layout = self._layout("histograms", packed.histogram_names, new_layouts)
                self._db.execute(
                    insert("histograms"),
                    with_checksum(
                        *where, layout, packed.counts.astype("<i8", copy=False).tobytes(),
                        packed.edges.astype("<f8", copy=False).tobytes(), packed.histogram_info.astype("<f8", copy=False).tobytes(),
                    ),
                )
            self._db.executemany(
                insert("tensors"),
                [with_checksum(*where, t.tensor, packed.step, packed.wall_time, encode_array(t.value)) for t in packed.tensors],
            )
            shapes = {name: shape for name, shape in packed.shapes.items() if self._shapes.get(name) != shape}
            self._db.executemany(
                insert("shapes"), [with_checksum(name, json.dumps(list(shape))) for name, shape in shapes.items()]
            )
            if new_layouts:
                self._db.execute(insert("meta"), with_checksum("layout_rows", str(self._layout_rows + len(new_layouts))))
            if shapes:  # rare: a tensor's first step, or a new shape
                (shape_rows,), = self._db.execute("SELECT count(*) FROM shapes").fetchall()
                self._db.execute(insert("meta"), with_checksum("shape_rows", str(shape_rows)))
        # only once committed: after a failed transaction they must be written again
        self._layouts.update(new_layouts)
        self._next_layout += len(new_layouts)
        self._shapes.update(shapes)
        self._layout_rows += len(new_layouts)

    def write_finding(self, finding: Finding) -> None:
        """Store one rule finding (its own transaction: findings are rare)."""
        with self._db:
            self._db.execute(
                insert("findings"),
                with_checksum(
                    finding.rule, int(finding.step), str(finding.mode), finding.mode_step, finding.worker, finding.tensor,
                    finding.message, None if finding.value is None or finding.value != finding.value else float(finding.value),
                    time.time(),
                ),
            )

    def close(self) -> None:
        """Mark the run as ended (``meta.ended_at``: readers stop waiting for more steps) and close."""
        try:
            with self._db:
                self._db.execute(insert("meta"), with_checksum("ended_at", repr(time.time())))
        finally:
            self._db.close()


def _strict(meta: dict[str, str]) -> dict[str, str]:
    """The ``meta`` entries that hold JSON as strict JSON (``NaN``/``Infinity`` as text): the
    reader refuses those tokens where they cannot be data, and browsers' ``JSON.parse`` everywhere."""
    return {key: jsontext.strict(value) if key in jsontext.JSON_META_KEYS else value for key, value in meta.items()}
