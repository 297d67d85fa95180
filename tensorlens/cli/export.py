"""``tensorlens export RUN --format csv|parquet``: every scalar of a run as a tidy table.

Columns: ``step, mode, mode_step, worker, tensor, statistic, value``; one row per number. A
plain scalar (a loss, ``save_scalar``) has the statistic ``value``. Values are written at full
precision (CSV: Python's shortest round-trip form; ``nan``, ``inf``, ``-inf`` as such).
"""

from __future__ import annotations

import csv
import itertools
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import click

from tensorlens.cli.group import PipeClosed
from tensorlens.cli.output import check_output, open_output
from tensorlens.cli.progress import progress, record_count
from tensorlens.cli.table import echo, printable
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord

COLUMNS = ("step", "mode", "mode_step", "worker", "tensor", "statistic", "value")
PARQUET_HINT = "Parquet export needs pyarrow: pip install 'tensorlens[parquet]' (CSV needs nothing: --format csv)"
_ROWS_PER_BATCH = 200_000


def _records(run: Any, mode: str | None, worker: str | None, advance: Any) -> Iterator[StepRecord]:
    for record in run.records(mode=mode, worker=worker):
        advance(1)
        yield record


def _selection(record: StepRecord, pattern: re.Pattern[str] | None, cache: dict[int, Any]) -> Any:
    """``(tensors, statistics, positions)`` of a record's scalars, cached per layout."""
    names = record.scalar_names
    found = cache.get(id(names))
    if found is None or found[0] is not names:
        keep = [i for i, (t, _) in enumerate(names) if pattern is None or pattern.search(t)]
        found = cache[id(names)] = (names, [names[i][0] for i in keep], [names[i][1] or "value" for i in keep], keep)
    return found[1:]


def write_csv(run: Any, out: Any, mode: str | None, worker: str | None, pattern: re.Pattern[str] | None,
              advance: Any) -> int:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    cache: dict[int, Any] = {}
    rows = 0
    for record in _records(run, mode, worker, advance):
        tensors, stats, positions = _selection(record, pattern, cache)
        values = record.scalar_values[positions].tolist()
        mode_name = str(record.mode)
        writer.writerows(zip(
            itertools.repeat(record.step), itertools.repeat(mode_name), itertools.repeat(record.mode_step),
            itertools.repeat(record.worker), tensors, stats, values,
        ))
        rows += len(values)
    return rows


def write_parquet(run: Any, out: Any, mode: str | None, worker: str | None, pattern: re.Pattern[str] | None,
                  advance: Any) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise click.ClickException(PARQUET_HINT) from None
    schema = pa.schema([
        ("step", pa.int64()), ("mode", pa.dictionary(pa.int8(), pa.string())), ("mode_step", pa.int64()),
        ("worker", pa.dictionary(pa.int32(), pa.string())), ("tensor", pa.dictionary(pa.int32(), pa.string())),
        ("statistic", pa.dictionary(pa.int32(), pa.string())), ("value", pa.float64()),
    ])
    cache: dict[int, Any] = {}
    columns: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    rows = 0
    with pq.ParquetWriter(out, schema) as writer:
        def flush() -> None:
            if columns["step"]:
                writer.write_table(pa.Table.from_pydict(columns, schema=schema))
                for values in columns.values():
                    values.clear()

        for record in _records(run, mode, worker, advance):
            tensors, stats, positions = _selection(record, pattern, cache)
            n = len(positions)
            columns["step"] += [record.step] * n
            columns["mode"] += [str(record.mode)] * n
            columns["mode_step"] += [record.mode_step] * n
            columns["worker"] += [record.worker] * n
            columns["tensor"] += tensors
            columns["statistic"] += stats
            columns["value"] += record.scalar_values[positions].tolist()
            rows += n
            if len(columns["step"]) >= _ROWS_PER_BATCH:
                flush()
        flush()
    return rows


class _Terminal:
    """Standard output when it is a terminal: names are data in a file or a pipe, but on a screen
    their control characters would be obeyed, so there they go through ``printable``."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(printable(text, newlines=True))


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@click.command("export")
@click.argument("run", type=click.Path(exists=True))
@click.option("--format", "fmt", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@click.option("-o", "--output", default=None,
              help="File to write (default: <run name>.csv or .parquet here; '-' for standard output, CSV only).")
@click.option("--mode", type=click.Choice([m.value for m in ModeKeys]), default=None, help="Only this mode (default: all).")
@click.option("--worker", default=None, help="Only this worker (default: all).")
@click.option("--regex", default=None, help="Only tensors whose name matches this regular expression.")
def command(run: str, fmt: str, output: str | None, mode: str | None, worker: str | None, regex: str | None) -> None:
    """Export every scalar of RUN as a tidy table: step, mode, mode_step, worker, tensor,
    statistic, value (one row per number; histograms are not exported)."""
    from tensorlens.reports.data import check_run_folder
    from tensorlens.store.reader import open_run

    try:
        pattern = re.compile(regex) if regex is not None else None
    except re.error as err:
        raise click.ClickException(f"--regex {regex!r} is not a valid regular expression ({err})") from None
    if fmt == "parquet":
        if output == "-":
            raise click.ClickException("Parquet cannot be written to standard output: give -o FILE")
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise click.ClickException(PARQUET_HINT) from None
    with open_run(check_run_folder(run)) as opened:
        if output is None:
            output = f"{os.path.basename(os.path.normpath(run)) or 'run'}.{fmt}"
        if output != "-":
            check_output(output, [run])  # before the run is read: a refusal costs nothing
        total = record_count(opened, mode, worker)
        to_screen = output == "-" and _isatty(sys.stdout)
        with progress(total, "exporting", unit="record", enabled=not to_screen) as advance:
            if output == "-":
                try:
                    rows = write_csv(opened, _Terminal(sys.stdout) if to_screen else sys.stdout, mode, worker,
                                     pattern, advance)
                    sys.stdout.flush()
                except BrokenPipeError:
                    raise PipeClosed from None
            else:
                with open_output(output, [run], binary=fmt == "parquet") as f:
                    if fmt == "parquet":
                        rows = write_parquet(opened, f, mode, worker, pattern, advance)
                    else:
                        rows = write_csv(opened, f, mode, worker, pattern, advance)
    if output != "-":
        echo(f"wrote {rows} rows to {output}", err=True)
