"""Stores crafted to hurt the reader, every row with a valid checksum (so the checks before the
one under test pass): JSON nested 200,000 deep, ``NaN``/``Infinity`` where JSON has none, a raw
tensor whose header claims 745 GiB. Each is a :class:`tl.CorruptRunError` naming the file, table
and entry: no ``RecursionError``, no ``MemoryError``, no traceback from the CLI.
"""

from __future__ import annotations

import io
import json
import math
import random
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorlens as tl
from tensorlens.store import jsontext
from tensorlens.store.schema import insert, with_checksum
from tensorlens.store.validate import tensor_array
from tensorlens.store.writer import RunStoreWriter

pytestmark = pytest.mark.timeout(300)

DEEP = "[" * 200_000 + "]" * 200_000
DEEP_OBJECT = '{"a":' * 200_000 + "1" + "}" * 200_000
MODULES = [{"name": "", "type": "Linear", "extra_repr": "in_features=2", "parameters": {"weight": [3, 2]}}]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A small intact run: scalars, a histogram, a raw tensor, a shape, metadata, config and modules."""
    folder = tmp_path / "run"
    writer = RunStoreWriter(str(folder / "tensorlens.sqlite"), {"config": json.dumps({"lr": 0.1})})
    writer.write_meta({"metadata": json.dumps({"model": {"parameters": 9}}), "modules": json.dumps(MODULES)})
    for step in range(3):
        writer.write(tl.StepRecord(
            step, "train", step, "worker_0", 1.0 + step,
            scalars=[tl.ScalarEntry("weights/w", "l2", 2.0 * step)],
            histograms=[tl.HistogramEntry("weights/w", np.array([1, 2]), np.array([0.0, 1.0, 2.0]), 0.0, 2.0, 3, 3.0, 5.0)],
            tensors=[tl.TensorEntry("summaries/t", np.arange(6, dtype=np.float32).reshape(2, 3) * step)],
            shapes={"weights/w": (3, 2)},
        ))
    writer.close()
    return folder


def _edit(folder: Path, table: str, row: tuple[object, ...]) -> None:
    """Replace a row of ``table`` with ``row``, its checksum recomputed (the row looks intact)."""
    db = sqlite3.connect(folder / "tensorlens.sqlite")
    with db:
        db.execute(insert(table), with_checksum(*row))
    db.close()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensorlens", *argv], capture_output=True, text=True, timeout=240)


def _refused_by_cli(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith("Error: corrupt run store") and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


# ----------------------------------------------------------------------------- JSON nested deep


@pytest.mark.parametrize("text", [DEEP, DEEP_OBJECT], ids=["arrays", "objects"])
def test_a_layout_nested_deep_is_refused(run: Path, text: str) -> None:
    _edit(run, "layouts", (1, "scalars", text))
    with tl.open_run(str(run)) as opened, pytest.raises(tl.CorruptRunError, match=r"table layouts, layout 1\): its JSON nests deeper"):
        opened.tensor_names()
    with tl.open_run(str(run)) as opened, pytest.raises(tl.CorruptRunError, match="layout 1"):
        opened.scalars(0)
    _refused_by_cli(_cli("show", str(run)), "layouts", "nests deeper")


def test_brackets_inside_strings_are_not_nesting(run: Path) -> None:
    """A tensor name may hold any characters: a layout naming ``a[[[[...`` is data, not depth."""
    name = "weights/" + "[{" * 5000
    _edit(run, "layouts", (1, "scalars", json.dumps([[name, "l2"]])))
    with tl.open_run(str(run)) as opened:
        assert name in opened.tensor_names()
        assert opened.scalars(2) == {f"{name}/l2": 4.0}


@pytest.mark.parametrize("key", ["modules", "metadata", "config"])
def test_a_meta_entry_nested_deep_is_refused_naming_it(run: Path, key: str) -> None:
    _edit(run, "meta", (key, DEEP))
    with tl.open_run(str(run)) as opened:
        with pytest.raises(tl.CorruptRunError, match=rf"{run}.*table meta, key '{key}'\): its JSON nests deeper"):
            opened.meta_json(key)
        assert opened.meta[key] == DEEP  # the stored text, for whoever wants it as text
        assert opened.steps() == [0, 1, 2]  # the rest of the run still reads
        if key == "metadata":
            with pytest.raises(tl.CorruptRunError, match="key 'metadata'"):
                opened.metadata()
        else:
            assert opened.metadata() == {"model": {"parameters": 9}}


def test_json_meta_entries_read_back(run: Path) -> None:
    with tl.open_run(str(run)) as opened:
        assert opened.meta_json("modules") == MODULES
        assert opened.meta_json("config") == {"lr": 0.1}
        assert opened.metadata() == {"model": {"parameters": 9}}
        with pytest.raises(KeyError, match="not a JSON entry"):
            opened.meta_json("run_name")
    _edit(run, "meta", ("metadata", "[1, 2]"))
    with tl.open_run(str(run)) as opened, pytest.raises(tl.CorruptRunError, match="its metadata is list, not a JSON object"):
        opened.metadata()


def test_a_shape_nested_deep_is_refused(run: Path) -> None:
    _edit(run, "shapes", ("weights/w", DEEP))
    with tl.open_run(str(run)) as opened, pytest.raises(tl.CorruptRunError, match=r"table shapes, tensor 'weights/w'\): its JSON"):
        opened.shape("weights/w")


# ----------------------------------------------------------------------------- NaN and Infinity


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_json_numbers_in_modules_are_refused_naming_the_entry(run: Path, token: str) -> None:
    text = json.dumps(MODULES)[:-2] + f', "scale": {token}}}]'
    _edit(run, "meta", ("modules", text))
    with tl.open_run(str(run)) as opened:
        with pytest.raises(tl.CorruptRunError, match=rf"{run}.*table meta, key 'modules'\): its JSON holds"):
            opened.meta_json("modules")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_json_numbers_in_a_layout_are_refused(run: Path, token: str) -> None:
    _edit(run, "layouts", (2, "histograms", f'[["weights/w", {token}]]'))
    with tl.open_run(str(run)) as opened, pytest.raises(tl.CorruptRunError, match="layout 2"):
        opened.tensor_names()


def test_non_finite_config_values_read_as_text(run: Path) -> None:
    """A configuration may hold ``inf`` (``max_grad_norm=inf``): a store written before the writer
    made such values text reads them as text, as the writer now stores them."""
    _edit(run, "meta", ("config", '{"max_grad_norm": Infinity, "floor": -Infinity, "x": NaN, "big": 1e999}'))
    _edit(run, "meta", ("metadata", '{"clip": Infinity}'))
    with tl.open_run(str(run)) as opened:
        assert opened.meta_json("config") == {"max_grad_norm": "Infinity", "floor": "-Infinity", "x": "NaN", "big": "Infinity"}
        assert opened.metadata() == {"clip": "Infinity"}


def test_the_writer_stores_json_meta_strict(tmp_path: Path) -> None:
    path = tmp_path / "run" / "tensorlens.sqlite"
    writer = RunStoreWriter(str(path), {"config": json.dumps({"clip": math.inf, "lr": 0.1})})
    writer.write_meta({"metadata": json.dumps({"loss_floor": -math.inf, "nan": math.nan}), "run_name": "NaN"})
    writer.close()
    db = sqlite3.connect(path)
    stored = dict(db.execute("SELECT key, value FROM meta").fetchall())
    db.close()
    assert json.loads(stored["config"]) == {"clip": "Infinity", "lr": 0.1}
    assert json.loads(stored["metadata"]) == {"loss_floor": "-Infinity", "nan": "NaN"}
    assert stored["run_name"] == "NaN"  # not a JSON entry: as given
    for key in ("config", "metadata"):
        json.loads(stored[key], parse_constant=lambda name, key=key: pytest.fail(f"{name} stored in {key}"))
    with pytest.raises(ValueError, match="deeper than"):
        RunStoreWriter(str(tmp_path / "other" / "tensorlens.sqlite")).write_meta({"modules": "[" * 300 + "]" * 300})


# ----------------------------------------------------------------------------- raw tensors


def _npy(header: dict[str, object], payload: bytes = b"\0" * 64, version: tuple[int, int] = (1, 0)) -> bytes:
    """An ``.npy`` blob with any header (the format: magic, version, length, a dict's repr padded to 64)."""
    size = 2 if version == (1, 0) else 4
    text = repr(header).encode("latin1")
    text += b" " * (-(10 + size - 2 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY" + bytes(version) + len(text).to_bytes(size, "little") + text + payload


def test_a_raw_tensor_claiming_745_gib_is_refused_before_allocating(run: Path) -> None:
    blob = _npy({"descr": "<f8", "fortran_order": False, "shape": (10**11,)})
    _edit(run, "tensors", ("train", 1, "worker_0", "summaries/t", 1, 2.0, blob))
    with tl.open_run(str(run)) as opened:
        with pytest.raises(tl.CorruptRunError, match=r"table tensors, train step 1 of worker_0\): the raw tensor's header says"):
            opened.read_tensor("summaries/t", 1)
        with pytest.raises(tl.CorruptRunError, match="the raw tensor's header says"):
            list(opened.records())
        assert opened.read_tensor("summaries/t", 2).tensor.sum() == 30.0  # the other steps read
    _refused_by_cli(_cli("export", str(run), "-o", "-"), "tensors", "header says")


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (_npy({"descr": "<f8", "fortran_order": False, "shape": (4,)}, b"\0" * 31), "header says"),  # one byte short
        (_npy({"descr": "<f8", "fortran_order": False, "shape": (4,)}, b"\0" * 33), "header says"),  # one byte over
        (_npy({"descr": "<f8", "fortran_order": False, "shape": (2**40, 2**40)}), "header says"),
        (_npy({"descr": "<f8", "fortran_order": False, "shape": (-1, 4)}), "negative"),
        (_npy({"descr": "|O", "fortran_order": False, "shape": (1,)}, b"\0" * 8), "not an array of numbers"),
        (_npy({"descr": [("a", "<f8")], "fortran_order": False, "shape": (1,)}, b"\0" * 8), "not an array of numbers"),
        (_npy({"descr": "<M8[s]", "fortran_order": False, "shape": (1,)}, b"\0" * 8), "not an array of numbers"),
        (_npy({"descr": "<f8", "fortran_order": False, "shape": (1,)}, b"\0" * 8, (3, 0)), "does not decode"),
        (b"\x93NUMPY\x01\x00\xff\xff{'descr': '<f8'", "does not decode"),  # a header longer than the blob
        (b"\x93NUMPY\x01\x00" + (len(b"(" * 3000) + 1).to_bytes(2, "little") + b"(" * 3000 + b"\n", "does not decode"),
        (b"not npy at all", "does not decode"),
        (b"", "does not decode"),
    ],
    ids=["short", "long", "2^80 values", "negative", "object", "structured", "datetime", "version 3", "cut header",
         "deep header", "no magic", "empty"],
)
def test_raw_tensor_headers_that_lie_are_refused(blob: bytes, problem: str) -> None:
    with pytest.raises(tl.CorruptRunError, match=problem):
        tensor_array("/runs/a/tensorlens.sqlite", blob, "train step 0 of worker_0")


@pytest.mark.parametrize("dtype", ["<f8", ">f4", "<i2", "|u1", "|b1", "<c16", "<f2", ">i8"])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (3, 0, 2), (2, 3, 4)])
@pytest.mark.parametrize("fortran", [False, True])
def test_raw_tensors_decode_as_np_load_decodes_them(dtype: str, shape: tuple[int, ...], fortran: bool) -> None:
    values = (np.arange(math.prod(shape)) % 7).astype(dtype).reshape(shape)
    values = np.asfortranarray(values) if fortran else values
    stream = io.BytesIO()
    np.save(stream, values, allow_pickle=False)
    expected = np.load(io.BytesIO(stream.getvalue()), allow_pickle=False)
    found = tensor_array("/runs/a/tensorlens.sqlite", stream.getvalue(), "train step 0 of worker_0")
    assert found.dtype == expected.dtype and found.shape == expected.shape
    assert found.strides == expected.strides or found.size == 0  # an empty array's strides mean nothing
    assert found.tobytes(order="A") == expected.tobytes(order="A")
    assert found.flags.writeable and found.flags.owndata


def test_the_depth_scan_counts_only_structure() -> None:
    assert jsontext.depth("[" * 300 + "]" * 300) == 300
    assert jsontext.depth(json.dumps(["[" * 1000, {"a": "{" * 1000}])) == 2
    assert jsontext.depth(json.dumps([["\\\"[" * 500]])) == 2  # escaped quotes stay inside strings
    assert jsontext.depth(json.dumps([["\\", "[" * 500], "\\\\\"["])) == 2  # escaped backslashes before a quote
    assert not jsontext.too_deep("[" * 200 + "]" * 200) and jsontext.too_deep("[" * 201 + "]" * 201)


def test_the_depth_scan_agrees_with_the_parsed_value_on_random_json() -> None:
    """Strings full of brackets, quotes and backslashes: the scan tells them apart as json does."""
    rng = random.Random(0)
    texts = ["[\\\"{", "\\", 'a"b[', '}]\\"', "\\\\\"", "é[ü", "\ud800"]

    def value(level: int) -> Any:
        pick = rng.random()
        if level > 6 or pick < 0.3:
            return rng.choice([*texts, 1, None])
        if pick < 0.65:
            return [value(level + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(texts) + str(i): value(level + 1) for i in range(rng.randint(0, 3))}

    def nesting(v: Any) -> int:
        inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        return 0 if inner is None else 1 + max(map(nesting, inner), default=0)

    for _ in range(2000):
        v = value(0)
        text = json.dumps(v, ensure_ascii=rng.random() < 0.5)
        assert jsontext.depth(text) == nesting(v), text


def test_a_dangling_store_link_is_refused_naming_its_target(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tensorlens.sqlite").symlink_to(folder / "gone.sqlite")  # inside its folder, but gone
    with pytest.raises(tl.CorruptRunError, match=r"symbolic link to '.*gone.sqlite', which does not exist"):
        tl.open_run(str(folder))
    _refused_by_cli(_cli("show", str(folder)), "gone.sqlite")


@pytest.mark.parametrize("count", ["²", "1" * 5000, "-1", " 3"])
def test_a_row_count_that_is_not_digits_is_refused(run: Path, count: str) -> None:
    """``"²".isdigit()`` is true and ``int("²")`` a ValueError; 5000 digits are past ``int()``'s limit."""
    _edit(run, "meta", ("layout_rows", count))
    with tl.open_run(str(run)) as opened, pytest.raises(tl.CorruptRunError, match="'layout_rows' entry is missing or not a count"):
        opened.tensor_names()


def test_a_huge_schema_version_is_named_briefly(run: Path) -> None:
    _edit(run, "meta", ("schema_version", "9" * 10_000_000))
    with pytest.raises(tl.CorruptRunError, match="schema 9{40}; this tensorlens") as raised:
        tl.open_run(str(run))
    assert len(str(raised.value)) < 500


def test_megabytes_of_a_hostile_value_make_a_short_message(run: Path) -> None:
    """A worker name of 5 MB in a steps row with a valid checksum: the error says where, briefly."""
    db = sqlite3.connect(run / "tensorlens.sqlite")
    with db:
        db.execute("DELETE FROM steps WHERE mode_step = 1")
        db.execute(insert("steps"), with_checksum("bogus", 1, "w" * 5_000_000, 1, 2.0, 1, 1, 1))
    db.close()
    with tl.open_run(str(run)) as opened, pytest.raises(tl.CorruptRunError, match="mode 'bogus' is not one of") as raised:
        opened.steps()
    assert len(str(raised.value)) < 2000 and "characters)" in str(raised.value)
    assert len(raised.value.where or "") > 5_000_000  # the whole place stays on the exception


def test_sync_of_a_config_nested_deep_is_one_error_line(run: Path, tmp_path: Path) -> None:
    """sync reads the run's config to open the tracker run: through the same bounded reader."""
    _edit(run, "meta", ("config", DEEP))
    done = _cli("sync", str(run), "--to", "tensorboard", "--logdir", str(tmp_path / "tb"))
    _refused_by_cli(done, "key 'config'", "nests deeper")
