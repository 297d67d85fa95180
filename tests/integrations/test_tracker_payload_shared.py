"""The backends of one run that send the same ``tracker_stats`` share one payload selector: each
record's payload is chosen once, and it is the payload a selector of its own would choose."""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import nn

import tensorlens as tl
from tensorlens.backends.base import Backend, RunInfo
from tensorlens.backends.payload import Payload, PayloadSelector, shared_selector
from tensorlens.records import StepRecord


class Taking(Backend):
    """Keeps each record and the payload it was handed."""

    def __init__(self, name: str, tracker_stats: str | None = None) -> None:
        self.name = name  # type: ignore[misc]
        self.tracker_stats = tracker_stats
        self.taken: list[tuple[StepRecord, Payload]] = []

    def open(self, run: RunInfo) -> None:
        self.open_payload(run)

    def write(self, record: StepRecord) -> None:
        self.taken.append((record, self.payload(record)))


def _same(a: Payload, b: Payload) -> None:
    for mine, theirs in ((a.scalars, b.scalars), (a.globals, b.globals)):  # NaN equals NaN here
        assert [k for k, _ in mine] == [k for k, _ in theirs]
        np.testing.assert_array_equal([v for _, v in mine], [v for _, v in theirs])
    assert [h.tensor for h in a.histograms] == [h.tensor for h in b.histograms]
    assert [(p.collection, p.stat, p.layers) for p in a.panels] == [(p.collection, p.stat, p.layers) for p in b.panels]
    for pa, pb in zip(a.panels, b.panels, strict=True):
        np.testing.assert_array_equal(pa.values, pb.values)


def test_backends_of_a_run_share_each_records_payload_and_it_is_the_one_of_their_choice(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    first, second, everything = Taking("first"), Taking("second"), Taking("everything", "all")
    hook = tl.watch(
        model, backends=[first, second, everything], out_dir=str(tmp_path), save_interval=2, activations=True
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(8):
        optimizer.zero_grad()
        x = torch.randn(16, 4)
        if step == 4:
            x[0, 0] = float("nan")  # NaN counts go from here on
        nn.functional.mse_loss(model(x), torch.randn(16, 2)).backward()
        optimizer.step()
    hook.close()

    assert len(first.taken) == len(second.taken) == len(everything.taken) == 4
    own_default, own_all = PayloadSelector("default"), PayloadSelector("all")
    for (record, payload), (record2, payload2), (record3, payload3) in zip(
        first.taken, second.taken, everything.taken, strict=True
    ):
        assert record is record2 is record3  # the dispatcher hands every backend the same record
        assert payload is payload2  # chosen once for both
        assert payload3 is not payload
        _same(payload, own_default.select(record))
        _same(payload3, own_all.select(record))
    assert any(key.endswith("/nan_count") for key, _ in first.taken[-1][1].scalars)  # the selector's memory still works
    assert not first._payload_selector._recent  # let go once both took each: records may carry raw tensors


def test_selectors_are_shared_per_run_object_and_choice_only() -> None:
    run, other = RunInfo("r", "/tmp/r"), RunInfo("r", "/tmp/r")
    a, b, c, d = Taking("a"), Taking("b"), Taking("c", "all"), Taking("d")
    a.open(run), b.open(run), c.open(run), d.open(other)
    assert a._payload_selector is b._payload_selector
    assert c._payload_selector is not a._payload_selector and d._payload_selector is not a._payload_selector
    alone = Taking("alone")
    assert alone.open_payload(None) is not a._payload_selector  # a backend driven by hand has its own


def test_threads_asking_for_one_record_get_one_payload() -> None:
    run = RunInfo("r", "/tmp/r")
    selector = shared_selector("default", run)
    assert all(shared_selector("default", run) is selector for _ in range(2))  # three backends
    scalars = [
        tl.ScalarEntry(f"gradients/l{i}.weight", stat, float(i)) for i in range(200) for stat in ("l2", "nan_count")
    ]
    records = [
        StepRecord(step, "train", step, "worker_0", 0.0, scalars=scalars) for step in range(10)
    ]  # fewer than a selector keeps
    got: list[list[Payload]] = [[] for _ in range(3)]
    start = threading.Barrier(3)

    def take(into: list[Payload]) -> None:
        start.wait()
        into.extend(selector.select(r) for r in records)

    threads = [threading.Thread(target=take, args=(into,)) for into in got]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(len(records)):
        assert got[0][i] is got[1][i] is got[2][i]
    assert not selector._recent  # every payload was let go once all three took it


def test_memo_key_builds_each_key_once_and_returns_what_the_function_does() -> None:
    from tensorlens.backends.keys import histogram_key, tracker_key

    built = []

    def counting(*parts: object) -> str:
        built.append(parts)
        return tracker_key(*parts)  # type: ignore[arg-type]

    backend = Taking("keys")
    for _ in range(3):
        assert backend.memo_key(counting, "tl", tl.ModeKeys.EVAL, "worker_1", "gradients/a/l2") == tracker_key(
            "tl", tl.ModeKeys.EVAL, "worker_1", "gradients/a/l2"
        )
        assert backend.memo_key(histogram_key, "tl", tl.ModeKeys.TRAIN, None, "gradients/a") == histogram_key(
            "tl", tl.ModeKeys.TRAIN, None, "gradients/a"
        )
    assert len(built) == 1
    assert Taking("other").memo_key(counting, "tl", tl.ModeKeys.EVAL, "worker_1", "gradients/a/l2") and len(built) == 2
