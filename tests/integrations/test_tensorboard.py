"""The TensorBoard backend against real event files, read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

import math
import struct
import sys

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from tensorlens.backends.keys import histogram_key, tracker_key  # noqa: E402
from tensorlens.integrations.tensorboard import TensorBoardBackend  # noqa: E402


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def train(model: nn.Module, steps: int, eval_batches: int = 0, loss_fn: nn.Module | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = loss_fn or nn.MSELoss()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(torch.randn(5, 6)), torch.randn(5, 3)).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        for _ in range(eval_batches):
            model(torch.randn(5, 6))
    model.train()


def read_events(log_dir: str) -> EventAccumulator:
    # the default size guidance keeps one histogram per tag (FACTS.md): keep everything
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, HISTOGRAMS: 0})
    events.Reload()
    return events


def assert_matches_store(events: EventAccumulator, run: tl.Run, prefix: str = "tensorlens") -> int:
    """Every train scalar and histogram of the store is in the events (``tracker_stats="all"``),
    equal, under the keys of tensorlens.backends.keys; returns how many."""
    checked = 0
    for step in run.steps(mode="train"):
        for key, value in run.scalars(step).items():
            found = {e.step: e.value for e in events.Scalars(tracker_key(prefix, "train", None, key))}
            # TensorBoard keeps scalars as float32
            assert found[step] == pytest.approx(np.float32(value), nan_ok=True), key
            checked += 1
    for name in run.tensor_names():
        view = run.tensor(name)
        for step in view.steps():
            try:
                counts, edges, info = view.histogram_with_info(step)
            except KeyError:
                continue  # a plain scalar
            found = {e.step: e.histogram_value for e in events.Histograms(histogram_key(prefix, "train", None, name))}
            histo = found[step]
            assert histo.bucket == counts.astype(float).tolist()
            assert histo.bucket_limit == edges[1:].tolist()  # right edges, exact (doubles)
            assert (histo.min, histo.max, histo.num) == (info["min"], info["max"], info["count"])
            assert histo.sum == pytest.approx(info["sum"]) and histo.sum_squares == pytest.approx(info["sum_squares"])
            checked += 1
    return checked


def test_training_events_equal_the_local_store(tmp_path) -> None:
    model = mlp()
    memory, loss_fn = tl.MemoryBackend(), nn.MSELoss()
    hook = tl.watch(model, loss_fn, save_interval=2, out_dir=tmp_path / "run", backends=["tensorboard", memory],
                    activations=True, tracker_stats="all")
    train(model, 5, eval_batches=3, loss_fn=loss_fn)
    hook.close()

    assert hook.backend_stats()["tensorboard"].written == hook.backend_stats()["local"].written
    assert hook.backend_stats()["tensorboard"].failed == 0
    events = read_events(tmp_path / "run" / "tensorboard")
    with tl.open_run(hook.run_dir) as run:
        assert run.steps(mode="train") == [0, 2, 4]
        assert assert_matches_store(events, run) > 100
        # eval records: a mode infix and the mode step (one point per saved eval batch)
        eval_steps = run.steps(mode="eval")
        assert eval_steps == [0, 2]
        key = "activations/0/max"
        found = {e.step: e.value for e in events.Scalars("tensorlens-eval-activations/0/max")}
        assert found == {s: pytest.approx(np.float32(run.scalars(s, mode="eval")[key])) for s in eval_steps}
        hist = {e.step: e.histogram_value for e in events.Histograms("tensorlens-eval-activations/0/histogram")}
        counts, _ = run.tensor("activations/0").histogram(2, mode="eval")
        assert hist[2].bucket == counts.astype(float).tolist()
    tags = events.Tags()["scalars"]
    assert "tensorlens-losses/mseloss" in tags
    assert not any("train" in t.split("/")[0] for t in tags)
    # wall times are the records' own, not the time of writing
    assert events.Scalars("tensorlens-losses/mseloss")[0].wall_time == memory.records[0].wall_time


def test_reuses_a_given_writer_and_leaves_it_open(tmp_path) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    backend = TensorBoardBackend(writer=writer, prefix="stats", tracker_stats="all")
    assert backend.log_dir == str(tmp_path / "tb")
    model = mlp()
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", backends=[backend])
    train(model, 3)
    hook.close()

    writer.add_scalar("user/after_close", 1.0, global_step=7)  # still usable: we did not close it
    writer.flush()
    events = read_events(tmp_path / "tb")
    assert {e.step for e in events.Scalars("user/after_close")} == {7}
    with tl.open_run(hook.run_dir) as run:
        assert assert_matches_store(events, run, prefix="stats") > 0
    assert not (tmp_path / "run" / "tensorboard").exists()
    writer.close()


def _records(path) -> list[tuple[bytes, int, int, int]]:
    """Each TFRecord of an event file: (data, its length, the stored CRC of the length, of the data)."""
    out, blob, at = [], path.read_bytes(), 0
    while at < len(blob):
        (length,) = struct.unpack_from("<Q", blob, at)
        (length_crc,) = struct.unpack_from("<I", blob, at + 8)
        data = blob[at + 12 : at + 12 + length]
        (data_crc,) = struct.unpack_from("<I", blob, at + 12 + length)
        out.append((data, length, length_crc, data_crc))
        at += 12 + length + 4
    return out


@pytest.mark.parametrize("given", [False, True])
def test_event_records_carry_tensorboards_own_checksums(tmp_path, given: bool) -> None:
    """The records are checksummed by google-crc32c, in C, not by TensorBoard's Python loop over
    every byte (on the event writer's thread, holding the GIL): each record's two masked CRC-32C
    equal TensorBoard's own Python implementation, and TensorBoard reads the file back."""
    pytest.importorskip("google_crc32c")
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    writer = SummaryWriter(log_dir=str(tmp_path / "tb")) if given else None
    backend = TensorBoardBackend(writer=writer, log_dir=None if given else str(tmp_path / "tb"), tracker_stats="all")
    model = mlp()
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", backends=[backend])
    train(model, 3)
    assert hook.flush()  # every record written (on the backend's thread)
    record_writer = backend.writer._get_file_writer().event_writer._async_writer._writer
    assert "write" in vars(record_writer)  # ours: the Python checksum is not used
    hook.close()
    if writer is not None:
        writer.close()
    (events_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    records = _records(events_file)
    assert len(records) > 3 and sum(len(data) for data, *_ in records) > 10_000
    for data, length, length_crc, data_crc in records:
        assert length_crc == masked_crc32c(struct.pack("<Q", length))
        assert data_crc == masked_crc32c(data)
    with tl.open_run(hook.run_dir) as run:
        assert assert_matches_store(read_events(tmp_path / "tb"), run) > 0


def test_without_google_crc32c_the_writer_is_left_as_it_is(tmp_path, monkeypatch) -> None:
    from tensorlens.integrations._tensorboard_records import fast_records

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    record_writer = writer._get_file_writer().event_writer._async_writer._writer
    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # as if not installed
    assert not fast_records(writer._get_file_writer()) and "write" not in vars(record_writer)
    monkeypatch.undo()
    record_writer.write = lambda data: None  # someone else's replacement stays
    assert not fast_records(writer._get_file_writer())
    assert not fast_records(object())  # not a torch FileWriter
    writer.close()


class _PublicApiWriter:
    """A writer that is not a torch SummaryWriter (like tensorboardX's): only the public calls."""

    def __init__(self, log_dir: str) -> None:
        self._inner = SummaryWriter(log_dir=log_dir)
        self.log_dir = log_dir

    def add_scalar(self, *args, **kwargs) -> None:
        self._inner.add_scalar(*args, **kwargs)

    def add_histogram_raw(self, *args, **kwargs) -> None:
        self._inner.add_histogram_raw(*args, **kwargs)

    def flush(self) -> None:
        self._inner.flush()


def test_other_writers_get_the_public_calls_with_the_same_result(tmp_path) -> None:
    writer = _PublicApiWriter(str(tmp_path / "tb"))
    model = mlp()
    hook = tl.watch(model, save_interval=2, out_dir=tmp_path / "run", backends=[TensorBoardBackend(writer=writer)],
                    tracker_stats="all")
    train(model, 3)
    hook.close()
    with tl.open_run(hook.run_dir) as run:
        assert assert_matches_store(read_events(tmp_path / "tb"), run) > 0


def test_nan_inf_and_fixed_range_histograms(tmp_path) -> None:
    hook = tl.Recorder(
        out_dir=tmp_path / "run",
        backends=[TensorBoardBackend(log_dir=tmp_path / "tb", prefix="")],
        histogram_config=tl.HistogramConfig(bins=4, range=(-1.0, 1.0)),
        include_collections=["summaries"],
        save_config=tl.SaveConfig(save_interval=1),
    )
    values = torch.tensor([-3.0, -0.9, 0.1, 0.2, 0.95, 2.0, 5.0, float("nan"), float("inf")])
    hook.save_tensor("x", values)
    hook.step()
    hook.close()

    events = read_events(tmp_path / "tb")
    histo = events.Histograms("summaries/x/histogram")[0].histogram_value
    with tl.open_run(hook.run_dir) as run:
        counts, edges, info = run.tensor("summaries/x").histogram_with_info(0)
    # one bucket below the range, the four bins over [-1, 1], one bucket above it
    assert (info["underflow"], info["overflow"]) == (1, 2)  # -3.0 below; 2.0 and 5.0 above; Inf in neither
    assert histo.bucket == [1.0, *counts.astype(float).tolist(), 2.0]
    assert histo.bucket_limit == [edges[0], *edges[1:].tolist(), max(info["max"], edges[-1])]
    assert (histo.min, histo.max) == (info["min"], info["max"])
    assert histo.num == sum(histo.bucket) == 7  # every finite value, NaN and Inf in none
    assert math.isnan(histo.sum)  # the tensor's sum is NaN; TensorBoard does not draw it
    scalars = {t: events.Scalars(t)[0].value for t in ("summaries/x/nan_count", "summaries/x/inf_count")}
    assert scalars == {"summaries/x/nan_count": 1.0, "summaries/x/inf_count": 1.0}


def test_arguments_are_checked_eagerly(tmp_path) -> None:
    with pytest.raises(ValueError, match="Expected `log_dir` to be None or a path, but got 3"):
        TensorBoardBackend(log_dir=3)
    with pytest.raises(ValueError, match="Expected `writer` to be None or a torch.utils.tensorboard.SummaryWriter"):
        TensorBoardBackend(writer="runs")
    with pytest.raises(ValueError, match="Expected `prefix`"):
        TensorBoardBackend(prefix="/tensorlens")
    with pytest.raises(ValueError, match="Expected `prefix`"):
        TensorBoardBackend(prefix=None)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    with pytest.raises(ValueError, match="Expected `log_dir` to be None when `writer` is given"):
        TensorBoardBackend(log_dir=tmp_path, writer=writer)
    writer.close()


def test_missing_tensorboard_names_the_extra(monkeypatch) -> None:
    # None in sys.modules makes `import tensorboard` fail as if it were not installed
    for name in list(sys.modules):
        if name == "tensorboard" or name.startswith(("tensorboard.", "torch.utils.tensorboard")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'tensorlens\[tensorboard\]'"):
        TensorBoardBackend()


def test_close_without_any_record_creates_nothing(tmp_path) -> None:
    backend = TensorBoardBackend(log_dir=tmp_path / "tb")
    hook = tl.Hook(out_dir=tmp_path / "run", backends=[backend])
    hook.close()
    assert not (tmp_path / "tb").exists()
