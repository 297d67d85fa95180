"""The MLflow backend against the real library: a real ``mlflow server`` on loopback, a plain
``sqlite:///`` store, and an unreachable tracker. No mocks.

Every run is read back with ``MlflowClient.get_metric_history`` and compared with the local run
store of the same training (``tl.open_run(hook.run_dir)``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl

mlflow = pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402
from mlflow.utils.validation import _validate_metric_name  # noqa: E402

from tensorlens.backends.keys import global_key  # noqa: E402
from tensorlens.backends.payload import layer_panels  # noqa: E402
from tensorlens.engine.metadata import flatten  # noqa: E402
from tensorlens.integrations._mlflow_metadata import SUMMARY_PARAMS  # noqa: E402
from tensorlens.integrations.mlflow import (  # noqa: E402
    MAX_KEY_LENGTH,
    QUANTILES,
    SERIES_SUFFIXES,
    MetricKeyMapper,
    MLflowBackend,
    histogram_quantiles,
    mlflow_metric_key,
)
from tensorlens.store.reader import TensorNotFound  # noqa: E402

# `mlflow server` took ~40 s to answer /health on a loaded 2-core machine; the bound only keeps
# a broken server from hanging the suite.
SERVER_START_TIMEOUT_S = float(os.environ.get("TENSORLENS_MLFLOW_SERVER_TIMEOUT", "180"))
TRAIN_STEPS = 12
SAVE_INTERVAL = 2
EVAL_BATCHES = 3
MLFLOW_MAX_DOUBLE = 1.7976931348623157e308  # what MLflow's SQL stores keep for +Inf


# ---------------------------------------------------------------------------- fixtures


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(uri: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the server and the workers it started (its own process group, nothing else)."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _start_server(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``mlflow server`` (SQLite store, proxied artifacts) on 127.0.0.1 in its own
    process group; returns it and its URI once it answers /health."""
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",  # the default four compete for two shared cores
    ]
    log_path = root / "server.log"
    # no GenAI job runner: it starts eight more processes that these tests never use
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env, start_new_session=True)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not _healthy(uri):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            tail = log_path.read_text(errors="replace")[-3000:]
            pytest.fail(f"mlflow server did not become healthy (exit code {process.poll()}):\n{tail}")
        time.sleep(0.5)
    return process, uri


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` shared by the tests that leave it running; yields its URI."""
    process, uri = _start_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield uri
    finally:
        _stop(process)


def _new_run(client: MlflowClient, artifacts: Path) -> str:
    # an explicit artifact location: the default, ./mlruns, would land in the working directory
    name = f"tensorlens-{time.time_ns()}"
    location = artifacts.as_uri() if not client.tracking_uri.startswith("http") else None
    experiment = client.create_experiment(name, artifact_location=location)
    return client.create_run(experiment).info.run_id


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """``mlflow.set_tracking_uri(uri)`` for the block, restoring the previous global and env var."""
    from mlflow.tracking._tracking_service import utils as tracking_utils

    previous, previous_env = tracking_utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)
        if previous_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_env


# ---------------------------------------------------------------------------- training


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _train(hook: tl.Hook, model: nn.Module, special_scalars: bool = False, flush_at: int | None = None) -> None:
    """TRAIN_STEPS optimizer steps, then EVAL_BATCHES eval forwards; closes the hook.

    ``flush_at``: call ``hook.flush()`` after that step (uploads a partial histogram chunk early).
    """
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.MSELoss()
    hook.register_loss(criterion)
    for step in range(TRAIN_STEPS):
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        if special_scalars:
            hook.save_scalar("nan_value", math.nan)
            hook.save_scalar("pos_inf", math.inf)
            hook.save_scalar("neg_inf", -math.inf)
            hook.save_scalar("odd[0]", float(step))  # cleaned to odd_0_ ...
            hook.save_scalar("odd_0_", -float(step))  # ... which this one then has to avoid
        optimizer.step()
        if step == flush_at:
            assert hook.flush()
    model.eval()
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            model(torch.randn(5, 4))
    hook.close()


def _watch(model: nn.Module, tmp_path: Path, backends: object) -> tl.Hook:
    # tracker_stats="all": every stored statistic goes, so MLflow must equal the store
    return tl.watch(
        model, save_interval=SAVE_INTERVAL, activations=True, backends=backends, out_dir=tmp_path / "run", tracker_stats="all"
    )


# ---------------------------------------------------------------------------- reading back


def _reference_quantile(counts: np.ndarray, edges: np.ndarray, level: float) -> float:
    """Walk the bins until the cumulative count reaches ``level * total``; interpolate in that bin."""
    total = float(np.sum(counts))
    target = level * total
    before = 0.0
    for i, count in enumerate(counts.tolist()):
        if count > 0 and before + count >= target:
            return float(edges[i]) + (target - before) / count * (float(edges[i + 1]) - float(edges[i]))
        before += count
    raise AssertionError("unreachable for level in (0, 1]")


def _expected_series(path: str, backend: MLflowBackend, eval_step: int) -> dict[str, list[tuple[int, float]]]:
    """MLflow key -> sorted ``(step, value)`` built from the local run store alone."""
    expected: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with tl.open_run(path) as run:
        for record in run.records():
            step = record.mode_step if record.mode == tl.ModeKeys.TRAIN else eval_step
            nonfinite, counted = 0.0, False
            for (tensor, stat), value in zip(record.scalar_names, record.scalar_values.tolist(), strict=True):
                expected[backend.metric_key(tensor, stat, record.mode)].append((step, value))
                if stat in ("nan_count", "inf_count") and tensor != "dynamics/global":
                    nonfinite, counted = nonfinite + value, True
            if counted:  # the payload's global count of NaN and Inf over every tensor
                expected[backend.global_metric_key("nonfinite_count", record.mode)].append((step, nonfinite))
            for histogram in record.histograms:  # quantiles are recorded statistics, equal to the reference
                for suffix, level in QUANTILES:
                    stored = record.scalar(histogram.tensor, suffix)
                    if histogram.counts.sum() == 0:
                        assert math.isnan(stored)
                        continue
                    reference = _reference_quantile(histogram.counts, histogram.edges, level)
                    assert math.isclose(stored, reference, rel_tol=1e-12, abs_tol=1e-15), (histogram.tensor, suffix)
    return {key: sorted(series, key=_order) for key, series in expected.items()}


def _order(point: tuple[int, float]) -> tuple[int, float]:
    step, value = point
    return step, (math.inf if math.isnan(value) else value)


def _mlflow_value(value: float) -> float:
    """What MLflow's SQL stores give back for a value: NaN stays NaN, +-Inf becomes +-max double."""
    if math.isinf(value):
        return math.copysign(MLFLOW_MAX_DOUBLE, value)
    return value


def _assert_same(actual: float, expected: float, key: str) -> None:
    expected = _mlflow_value(expected)
    if math.isnan(expected):
        assert math.isnan(actual), key
    elif key.rsplit("/", 1)[-1] in {suffix for suffix, _ in QUANTILES}:
        # the adapter's vectorised formula and the reference loop may round differently in the last bit
        assert math.isclose(actual, expected, rel_tol=1e-12, abs_tol=1e-15), (key, actual, expected)
    else:
        assert actual == expected, (key, actual, expected)


def _assert_matches_local_store(client: MlflowClient, run_id: str, hook: tl.Hook, backend: MLflowBackend) -> int:
    """Every series in MLflow equals the local store's; returns the number of points compared."""
    expected = _expected_series(hook.run_dir, backend, eval_step=TRAIN_STEPS)
    logged = {k for k in client.get_run(run_id).data.metrics if k.startswith((backend.prefix + "/", backend.prefix + "-"))}
    assert logged == set(expected), (sorted(logged ^ set(expected))[:10])
    points = 0
    for key, series in expected.items():
        history = sorted(((m.step, m.value) for m in client.get_metric_history(run_id, key)), key=_order)
        assert [s for s, _ in history] == [s for s, _ in series], key
        # within one step (eval steps share the global step) order by the values MLflow stored
        series = sorted(((s, _mlflow_value(v)) for s, v in series), key=_order)
        for (_, actual), (_, wanted) in zip(history, series, strict=True):
            _assert_same(actual, wanted, key)
        points += len(series)
    return points


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for info in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, info.path) if info.is_dir else [info.path]
    return sorted(out)


def _histograms(path: str, mode: str) -> tuple[list[str], list[int]]:
    """Tensors with a histogram, and the mode steps holding any histogram, in the local store."""
    tensors, steps = set(), set()
    with tl.open_run(path) as run:
        for name in run.tensor_names():
            for step in run.steps(mode=mode):
                with contextlib.suppress(TensorNotFound):
                    run.tensor(name).histogram(step, mode=mode)
                    tensors.add(name)
                    steps.add(step)
    return sorted(tensors), sorted(steps)


def _assert_artifacts(client: MlflowClient, run_id: str, hook: tl.Hook, every: int, download_to: Path, heatmaps: bool = True) -> None:
    files = _artifacts(client, run_id)
    (train_tensors, train_steps), (eval_tensors, eval_steps) = _histograms(hook.run_dir, "train"), _histograms(hook.run_dir, "eval")
    # one JSON per `every` saved steps with histograms, named by the first mode step it holds
    expected = [f"tensorlens/histograms/train/histograms-{s:09d}.json" for s in train_steps[::every]]
    expected += [f"tensorlens/histograms/eval/histograms-{s:09d}.json" for s in eval_steps[::every]]
    assert sorted(f for f in files if "/histograms/" in f) == sorted(expected)
    # one image per collection and statistic of the per-layer panels (and mode), not one per tensor
    panels = set()
    with tl.open_run(hook.run_dir) as run:
        for record in run.records():
            panels |= {
                global_key("tensorlens", record.mode, None, f"per-layer/{p.collection}/{p.stat.replace('/', '_')}")
                for p in layer_panels(record)
            }
    images = sorted(f for f in files if f.startswith("images/") and f.endswith(".png"))
    if not heatmaps:
        panels = set()
    assert sorted(f.split("+", 1)[0] for f in images) == sorted("images/" + k.replace("/", "~") for k in panels)
    if heatmaps:
        assert len(panels) >= 5  # weights, biases, gradients, activations l2 and dead fraction
        # the images' own .webp thumbnails, and the run's metadata
        assert len(files) <= len(expected) + 2 * len(panels) + 1 and "tensorlens/metadata.json" in files
        image = client.download_artifacts(run_id, images[0], str(download_to))
        assert Path(image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a histogram chunk holds exactly the stored counts and edges of every tensor of its steps
    found: dict[str, list[int]] = {"train": [], "eval": []}
    checked = 0
    with tl.open_run(hook.run_dir) as run:
        for path in expected:
            document = json.loads(Path(client.download_artifacts(run_id, path, str(download_to))).read_text())
            assert document["format"] == "tensorlens.histograms" and document["version"] == 1
            for record in document["records"]:
                found[document["mode"]].append(record["mode_step"])
                tensors = train_tensors if document["mode"] == "train" else eval_tensors
                assert set(record["histograms"]) <= set(tensors) and record["histograms"]
                for name, histogram in record["histograms"].items():
                    counts, edges = run.tensor(name).histogram(record["mode_step"], mode=document["mode"])
                    assert histogram["counts"] == counts.tolist()
                    assert histogram["edges"] == edges.tolist()
                    checked += 1
    assert found == {"train": train_steps, "eval": eval_steps}  # every saved step once, in order
    assert checked > 0


# ---------------------------------------------------------------------------- metric keys (pure)


REJECTED = ["..a", "...", "a[0]", "a//b", "a/./b", "../a", "/a", "a/", "a@b", "a,b", "a+b", "a=b", "a:b", "é/x", "", ".", "..", "a/../b", "//", "a\\b", "tab\tkey"]


@pytest.mark.parametrize("key", REJECTED)
def test_cleaned_keys_pass_mlflows_own_validation(key: str) -> None:
    cleaned = mlflow_metric_key(key)
    _validate_metric_name(cleaned)  # raises MlflowException if MLflow would refuse it
    assert cleaned and len(cleaned) <= MAX_KEY_LENGTH
    assert not cleaned.startswith("/") and not cleaned.endswith("/") and "//" not in cleaned


@pytest.mark.parametrize("key", ["gradients/fc1.weight/l2", "a b/c-d_e.f", "tensorlens/eval/activations/0/p50", "x"])
def test_valid_keys_are_unchanged(key: str) -> None:
    assert mlflow_metric_key(key) == key
    assert MetricKeyMapper()(key) == key


def test_examples_from_the_brief() -> None:
    assert mlflow_metric_key("a[0]") == "a_0_"
    assert mlflow_metric_key("a//b") == "a/b"
    assert mlflow_metric_key("/a/b/") == "a/b"
    assert mlflow_metric_key("a/./b") == "a/_/b"
    assert mlflow_metric_key("../a") == "__/a"


def test_colliding_keys_get_distinct_names_whatever_their_order() -> None:
    keys = ["a[0]", "a_0_", "a(0)", "a//0", "a/0", "lin@1", "lin#1", "lin_1"]
    mapped = [MetricKeyMapper()(k) for k in keys]
    rng = random.Random(1)
    for _ in range(20):  # another process, another order: the same metrics
        order = rng.sample(keys, len(keys))
        mapper = MetricKeyMapper()
        assert {k: mapper(k) for k in order} == dict(zip(keys, mapped, strict=True))
    assert len(set(mapped)) == len(keys)
    # valid keys keep their names; a key MLflow refuses gets its cleaned form and a hash of itself
    assert [m for k, m in zip(keys, mapped, strict=True) if k == m] == ["a_0_", "a/0", "lin_1"]
    for key, value in zip(keys, mapped, strict=True):
        if key != value:
            assert re.fullmatch(re.escape(mlflow_metric_key(key)) + r"-[0-9a-f]{8}", value), (key, value)
        _validate_metric_name(value)


def test_long_keys_are_cut_and_hashed() -> None:
    mapper = MetricKeyMapper()
    exact = "k" * MAX_KEY_LENGTH
    assert mapper(exact) == exact
    long_a = "x/" * 150 + "a"
    long_b = "x/" * 150 + "b"
    mapped_a, mapped_b = mapper(long_a), mapper(long_b)
    assert mapped_a != mapped_b
    for key in (mapped_a, mapped_b):
        assert len(key) <= MAX_KEY_LENGTH
        _validate_metric_name(key)
    assert mapper("k" * (MAX_KEY_LENGTH + 1)) != exact


def test_identity_separates_equal_strings() -> None:
    mapper = MetricKeyMapper()
    assert mapper("p/eval/x", identity="mode eval, tensor x") == "p/eval/x"
    other = mapper("p/eval/x", identity="train, tensor eval/x", canonical=False)
    assert other.startswith("p/eval/x-") and mapper("p/eval/x", identity="mode eval, tensor x") == "p/eval/x"


def test_a_key_that_looks_hashed_is_hashed_too() -> None:
    mapper = MetricKeyMapper()
    hashed = mapper("lin@1")
    assert hashed.startswith("lin_1-") and mapper(hashed) != hashed  # a module named like a hashed key


def test_random_keys_are_valid_and_unique() -> None:
    rng = random.Random(0)
    alphabet = "ab/._- :[]()@,+=*\\\té0"
    keys = {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(3000)}
    keys |= {"z" * rng.randint(240, 260) + rng.choice(alphabet) for _ in range(50)}
    mapper = MetricKeyMapper()
    mapped = [mapper(k) for k in sorted(keys)]
    assert len(set(mapped)) == len(keys)
    for key in mapped:
        assert len(key) <= MAX_KEY_LENGTH
        _validate_metric_name(key)


# ---------------------------------------------------------------------------- quantiles (pure)


_HOSTILE = "ab_1/.-: @#[]()é,+*\\\t"


def _series(rng: random.Random, count: int) -> list[tuple[str, str, str, str]]:
    """``count`` distinct series ``(mode, worker, tensor, stat)`` whose names clean to few strings.

    ``worker_0`` and ``reduced`` are both a run's own worker (one run has one of them: see
    ``tensorlens.backends.keys``), so they are one series here, drawn as either.
    """
    collections = ["weights", "gradients", "summaries", "scalars", "eval", "worker_1", "train", "attn/weights", "a@b"]
    # a few statistics of each kind (tensor, quantile, derived, epoch aggregate): with all of them
    # the names would rarely meet
    known = ["l2", "mean", "numel", "abs_max", "p50", "p99", "grad_norm", "update_ratio", "dead_fraction", "l2_mean", "mean_std"]
    assert set(known) <= SERIES_SUFFIXES
    stats = [*known, "", "", "", "lr", "x-deadbeef", "odd[0]"]
    found: dict[tuple[str, str, str, str], tuple[str, str, str, str]] = {}
    while len(found) < count:
        name = "".join(rng.choice(_HOSTILE) for _ in range(rng.randint(0, 3)))
        if rng.random() < 0.02:
            name = "z" * rng.randint(230, 260) + name
        mode = rng.choice([m.value for m in tl.ModeKeys])
        worker = rng.choice(["worker_0", "worker_1", "worker_7", "reduced"])
        series = (mode, worker, f"{rng.choice(collections)}/{name}", rng.choice(stats))
        found.setdefault((mode, worker if worker in ("worker_1", "worker_7") else "own", *series[2:]), series)
    return sorted(found.values())


def _mapping(series: list[tuple[str, str, str, str]], order: list[int], uri: str) -> dict[tuple[str, str, str, str], str]:
    backend = MLflowBackend(tracking_uri=uri, run_id="0" * 32, heatmaps=False)  # never opened: no I/O
    backend._run = tl.RunInfo("p", "/p", rank=0, world_size=8, config={"include_workers": "all"})
    return {series[i]: backend.metric_key(series[i][2], series[i][3], series[i][0], series[i][1]) for i in order}


def test_metric_keys_are_injective_and_independent_of_order_for_hostile_names() -> None:
    """Property test: thousands of series whose names clean to a few strings, mapped by fresh
    backends (as other processes, modes, workers or resumed runs would) in random orders."""
    rng = random.Random(7)
    series = _series(rng, 4000)
    first = _mapping(series, list(range(len(series))), "sqlite:///unused.db")
    assert len(set(first.values())) == len(series)  # injective
    for _ in range(3):
        assert _mapping(series, rng.sample(range(len(series)), len(series)), "sqlite:///unused.db") == first
    for key in first.values():
        assert len(key) <= MAX_KEY_LENGTH
        _validate_metric_name(key)
    # many hostile names share a cleaned form: the property was tested where it matters
    cleaned = defaultdict(set)
    for (_, _, tensor, stat), key in first.items():
        cleaned[mlflow_metric_key(f"{tensor}/{stat}")].add(key)
    assert sum(len(keys) for keys in cleaned.values() if len(keys) > 1) > 1000


def test_readable_series_keep_readable_keys() -> None:
    """The key scheme of tensorlens.backends.keys, and a hash suffix only where two series could meet."""
    backend = MLflowBackend(tracking_uri="sqlite:///unused.db", run_id="0" * 32)
    backend._run = tl.RunInfo("p", "/p", rank=0, world_size=2, config={"include_workers": "all"})
    assert backend.metric_key("gradients/fc1.weight", "l2") == "tensorlens-gradients/fc1.weight/l2"
    assert (
        backend.metric_key("gradients/fc1.weight", "abs_max", "eval", "worker_1")
        == "tensorlens-eval-worker_1-gradients/fc1.weight/abs_max"
    )
    assert backend.metric_key("attn/weights/q.weight", "p50") == "tensorlens-attn/weights/q.weight/p50"
    assert backend.metric_key("scalars/train/lr") == "tensorlens-scalars/train/lr"
    assert backend.metric_key("losses/mseloss", None, "predict") == "tensorlens-predict-losses/mseloss"
    assert backend.global_metric_key("nonfinite_count") == "tensorlens/nonfinite_count"
    assert backend.global_metric_key("nonfinite_count", "eval") == "tensorlens-eval/nonfinite_count"
    # the ambiguous one of each pair carries the hash: a plain scalar ending in a statistic's name,
    # a collection named like a mode, a collection holding the section separator
    assert backend.metric_key("summaries/grad", "l2") == "tensorlens-summaries/grad/l2"
    assert re.fullmatch(r"tensorlens-summaries/grad/l2-[0-9a-f]{8}", backend.metric_key("summaries/grad/l2"))
    assert re.fullmatch(r"tensorlens-eval/x/l2-[0-9a-f]{8}", backend.metric_key("eval/x", "l2"))
    assert re.fullmatch(r"tensorlens-eval-x/y/l2-[0-9a-f]{8}", backend.metric_key("eval-x/y", "l2"))
    assert backend.metric_key("x", "l2", "eval") != "tensorlens-eval/x/l2"  # a tensor of one part: not the engine's
    # what the engine records is never hashed: derived statistics, epoch aggregates, plain scalars
    # of two parts whose name is a statistic's (they cannot meet a "<collection>/<tensor>/<stat>")
    for tensor, stat, mode, expected in [
        ("dynamics/global", "grad_norm", "train", "tensorlens/dynamics/global/grad_norm"),
        ("dynamics/global", "undefined_count", "train", "tensorlens/dynamics/global/undefined_count"),
        ("dynamics/global", "grad_norm", "eval", "tensorlens-eval/dynamics/global/grad_norm"),
        ("dynamics/fc1.weight", "update_ratio", "train", "tensorlens-dynamics/fc1.weight/update_ratio"),
        ("activations/relu", "dead_fraction", "eval", "tensorlens-eval-activations/relu/dead_fraction"),
        ("epochs/gradients/fc1.weight", "l2_mean", "epoch", "tensorlens-epoch-gradients/fc1.weight/l2_mean"),
        ("epochs/dynamics/global", "grad_norm_max", "epoch", "tensorlens-epoch/dynamics/global/grad_norm_max"),
        ("epochs/losses/loss", "mean", "epoch", "tensorlens-epoch-losses/loss/mean"),
        ("scalars/grad_norm", "", "train", "tensorlens-scalars/grad_norm"),
        ("losses/l2", "", "train", "tensorlens-losses/l2"),
    ]:
        assert backend.metric_key(tensor, stat, mode) == expected
    assert backend.metric_key("x/l2", None, "eval") == "tensorlens-eval-x/l2"
    # an epoch tensor outside an epoch record would meet the collection's own series
    assert backend.metric_key("epochs/gradients/fc1.weight", "l2_mean") != "tensorlens-gradients/fc1.weight/l2_mean"


def test_quantiles_match_a_reference_loop() -> None:
    rng = np.random.default_rng(0)
    levels = [q for _, q in QUANTILES]
    cases = [
        (np.array([5]), np.array([-1.0, 1.0])),
        (np.array([0, 0, 7, 0]), np.linspace(0, 4, 5)),
        (np.array([1, 0, 0, 1]), np.linspace(-2, 2, 5)),
        (np.array([3, 0, 3]), np.array([-0.5, 0.0, 0.0, 0.5])),  # a zero-width bin
    ]
    for bins in (1, 2, 7, 64, 512):
        counts = rng.integers(0, 5, size=bins) * (rng.random(bins) < 0.6)
        if counts.sum() == 0:
            counts[rng.integers(bins)] = 1
        low = rng.normal()
        cases.append((counts, np.sort(low + np.cumsum(rng.random(bins + 1)))))
    for counts, edges in cases:
        got = histogram_quantiles(counts, edges, levels)
        assert got is not None
        want = [_reference_quantile(counts, edges, q) for q in levels]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        assert np.all(np.diff(got) >= 0)


def test_quantiles_are_close_to_numpy_on_the_raw_values() -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(size=20_000)
    counts, edges = np.histogram(values, bins=256)
    levels = [q for _, q in QUANTILES]
    got = histogram_quantiles(counts, edges, levels)
    width = edges[1] - edges[0]
    assert np.max(np.abs(got - np.quantile(values, levels))) <= width


def test_empty_histogram_has_no_quantiles() -> None:
    assert histogram_quantiles(np.zeros(4, dtype=np.int64), np.linspace(0, 1, 5), [0.5]) is None
    assert histogram_quantiles(np.zeros(0, dtype=np.int64), np.array([0.0]), [0.5]) is None


# ---------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tracking_uri": 5}, "tracking_uri"),
        ({"tracking_uri": ""}, "tracking_uri"),
        ({"run_id": 3}, "run_id"),
        ({"prefix": "a//b"}, "prefix"),
        ({"prefix": "a[0]"}, "prefix"),
        ({"prefix": 1}, "prefix"),
        ({"synchronous": "yes"}, "synchronous"),
        ({"histogram_every": -1}, "histogram_every"),
        ({"histogram_every": True}, "histogram_every"),
        ({"heatmaps": 1}, "heatmaps"),
        ({"metadata_params": "some"}, "metadata_params"),
        ({"client": "http://x"}, "client"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"Expected `{name}` to be"):
        MLflowBackend(**{"run_id": "r", **kwargs})


def test_client_and_tracking_uri_are_exclusive() -> None:
    with pytest.raises(ValueError, match="Expected `tracking_uri` to be None when `client` is given"):
        # an http client: creating it contacts nothing (a sqlite one would build its schema first)
        MLflowBackend(client=MlflowClient("http://127.0.0.1:9"), tracking_uri="sqlite:///y.db", run_id="r")


def test_no_run_is_a_clear_error() -> None:
    assert mlflow.active_run() is None
    with pytest.raises(ValueError, match=r"mlflow\.start_run\(\)"):
        MLflowBackend()
    with pytest.raises(ValueError, match="Expected `run_id` to be"):
        tl.Hook(backends=["mlflow"], out_dir=None).close()


def test_importing_does_not_import_mlflow_and_missing_mlflow_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys
        import tensorlens.integrations.mlflow as module
        assert "mlflow" not in sys.modules, "importing the adapter imported mlflow"
        sys.modules["mlflow"] = None  # as if it were not installed
        try:
            module.MLflowBackend(run_id="r")
        except ImportError as err:
            assert "pip install 'tensorlens[mlflow]'" in str(err), err
        else:
            raise AssertionError("no ImportError")
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# ---------------------------------------------------------------------------- plain sqlite:/// store


def test_sqlite_store_without_a_server(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = _new_run(client, tmp_path / "artifacts")
    backend = MLflowBackend(tracking_uri=uri, run_id=run_id, histogram_every=4)
    model = Tiny()
    hook = _watch(model, tmp_path, [backend])
    _train(hook, model, special_scalars=True)

    assert hook.backend_stats()["mlflow"].failed == 0
    assert _assert_matches_local_store(client, run_id, hook, backend) > 500
    # NaN comes back as NaN, +-Inf as +-max double (SQL has no infinity)
    nan_history = client.get_metric_history(run_id, "tensorlens-scalars/nan_value")
    # save_scalar follows the scalars collection's save config: one point per saved step
    assert len(nan_history) == len(range(0, TRAIN_STEPS, SAVE_INTERVAL)) and all(math.isnan(m.value) for m in nan_history)
    assert {m.value for m in client.get_metric_history(run_id, "tensorlens-scalars/pos_inf")} == {MLFLOW_MAX_DOUBLE}
    assert {m.value for m in client.get_metric_history(run_id, "tensorlens-scalars/neg_inf")} == {-MLFLOW_MAX_DOUBLE}
    # two keys that clean to the same string stay two series
    odd, clean = backend.metric_key("scalars/odd[0]"), backend.metric_key("scalars/odd_0_")
    assert odd != clean and {odd, clean} <= set(client.get_run(run_id).data.metrics)
    _assert_artifacts(client, run_id, hook, every=4, download_to=tmp_path / "download")
    tags = client.get_run(run_id).data.tags
    assert tags["tensorlens.run_dir"] == hook.run_dir


def test_per_layer_images_are_named_alike_whatever_the_order_of_records_of_one_millisecond(tmp_path: Path) -> None:
    """A sync replays records in ``Run.records()`` order, the live run took them as they closed: an
    eval record and a train record of one step may swap. Metric timestamps are kept increasing, so
    they may end one millisecond apart; the per-layer images take the latest record's wall time,
    which does not depend on the order, so both runs hold image files of the same names."""
    model = Tiny()
    hook = _watch(model, tmp_path / "run", ["local"])
    _train(hook, model)
    with tl.open_run(hook.run_dir) as run:
        records = list(run.records())
    # the last train record and the two eval records after it, all in two milliseconds; the first
    # eval record closed a little before the train record was handed over
    assert [r.mode for r in records[-3:]] == [tl.ModeKeys.TRAIN] + [tl.ModeKeys.EVAL] * 2
    base = records[-1].wall_time + 1.0
    records[-3:] = [r.replace(wall_time=base + seconds) for r, seconds in zip(records[-3:], (0.0012, 0.0, 0.0013), strict=True)]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    names = []
    for order in (records, records[:-3] + [records[-2], records[-3], records[-1]]):
        run_id = _new_run(client, tmp_path / f"artifacts-{len(names)}")
        backend = MLflowBackend(tracking_uri=uri, run_id=run_id, histogram_every=0)
        backend.open(tl.RunInfo("order", hook.run_dir))
        for record in order:
            backend.write(record)
        backend.close()
        images = [path for path in _artifacts(client, run_id) if path.startswith("images/")]
        names.append(sorted(re.sub(r"\+[0-9a-f]{8}-[0-9a-f-]{27}", "", path) for path in images))
    latest = max(int(record.wall_time * 1000) for record in records)
    assert names[0] and all(f"+timestamp+{latest}" in path for path in names[0])
    assert names[0] == names[1]


@pytest.mark.parametrize("which", ["summary", "all"])
def test_metadata_is_a_few_params_and_one_artifact(tmp_path: Path, which: str) -> None:
    """MLflow lists every param above each image card's image (and as runs-table columns): by
    default a few; all of the metadata is in tensorlens/metadata.json either way."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = _new_run(client, tmp_path / "artifacts")
    model = Tiny()
    hook = _watch(model, tmp_path, [MLflowBackend(tracking_uri=uri, run_id=run_id, metadata_params=which)])
    _train(hook, model)
    with tl.open_run(hook.run_dir) as stored:
        metadata = stored.metadata()
    params = {k: v for k, v in client.get_run(run_id).data.params.items() if k.startswith("tensorlens.")}
    flat = {f"tensorlens.{k}": str(v) for k, v in flatten(metadata).items()}
    if which == "all":
        assert params == flat and len(params) > 40
    else:
        assert params == {f"tensorlens.{k}": flat[f"tensorlens.{k}"] for k in SUMMARY_PARAMS}
        assert params["tensorlens.model.class"] == "Tiny"
    path = client.download_artifacts(run_id, "tensorlens/metadata.json", str(tmp_path / "download"))
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == json.loads(json.dumps(metadata))


def test_metadata_with_a_lone_surrogate_markup_and_control_characters_is_written(tmp_path: Path) -> None:
    """MLflow's stores refuse a lone surrogate (the whole request failed): it is written escaped."""
    from tensorlens.integrations._mlflow_metadata import write_metadata

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = _new_run(client, tmp_path / "artifacts")
    metadata = {"versions": {"tensorlens": "0.1\ud800<script>\x00\x1b[31m"}, "model": {"class": "A\u202eB"}}
    write_metadata(client, run_id, "tensorlens", "tensorlens", metadata, "all")
    params = client.get_run(run_id).data.params
    assert params["tensorlens.versions.tensorlens"] == "0.1\\ud800<script>\x00\x1b[31m"
    assert params["tensorlens.model.class"] == "A\u202eB"
    path = client.download_artifacts(run_id, "tensorlens/metadata.json", str(tmp_path / "download"))
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == json.loads(json.dumps(metadata))


# ---------------------------------------------------------------------------- a real server


def test_server_with_explicit_run(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    run_id = _new_run(client, tmp_path)
    backend = MLflowBackend(tracking_uri=mlflow_server, run_id=run_id, histogram_every=4)
    model = Tiny()
    hook = _watch(model, tmp_path, [backend])
    _train(hook, model, special_scalars=True)

    stats = hook.backend_stats()["mlflow"]
    assert (stats.failed, stats.dropped) == (0, 0) and stats.written == hook.backend_stats()["local"].written
    assert _assert_matches_local_store(client, run_id, hook, backend) > 500
    assert any(k.startswith("tensorlens-eval-activations/") for k in client.get_run(run_id).data.metrics)
    _assert_artifacts(client, run_id, hook, every=4, download_to=tmp_path / "download")


def test_server_with_active_run_and_auto_backends(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    experiment = client.create_experiment(f"auto-{time.time_ns()}")
    with _tracking_uri(mlflow_server), mlflow.start_run(experiment_id=experiment) as active:
        model = Tiny()
        hook = _watch(model, tmp_path, "auto")
        (backend,) = [b for b in hook.backends if isinstance(b, MLflowBackend)]
        assert backend.run_id == active.info.run_id and backend.tracking_uri == mlflow_server
        _train(hook, model)
    assert hook.backend_stats()["mlflow"].failed == 0
    assert _assert_matches_local_store(client, active.info.run_id, hook, backend) > 500
    files = _artifacts(client, active.info.run_id)
    assert any(f.startswith("tensorlens/histograms/train/") for f in files)
    assert any(f.startswith("images/tensorlens~per-layer~weights~l2+") for f in files)


def test_server_asynchronous_through_a_client(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    run_id = _new_run(client, tmp_path)
    # what the Lightning callback passes: MLflowBackend(client=logger.experiment, run_id=logger.run_id)
    backend = MLflowBackend(client=MlflowClient(mlflow_server), run_id=run_id, synchronous=False, heatmaps=False)
    assert backend.histogram_every == 10
    model = Tiny()
    hook = _watch(model, tmp_path, [backend])
    _train(hook, model, special_scalars=True, flush_at=TRAIN_STEPS // 2)
    assert hook.backend_stats()["mlflow"].failed == 0
    assert _assert_matches_local_store(client, run_id, hook, backend) > 500
    # the chunk uploaded early by hook.flush() was replaced by the complete one
    _assert_artifacts(client, run_id, hook, every=10, download_to=tmp_path / "download", heatmaps=False)


def test_server_keeps_series_that_clean_to_one_string_apart(mlflow_server: str, tmp_path: Path) -> None:
    """``lin@1``, ``lin#1`` and ``lin_1`` (and a plain scalar named like a statistic) in two modes,
    written by two backends in opposite orders, as two processes of one run would: no series merge."""
    client = MlflowClient(mlflow_server)
    run_id = _new_run(client, tmp_path)
    names = [("activations/lin@1", "mean"), ("activations/lin#1", "mean"), ("activations/lin_1", "mean"),
             ("summaries/grad", "l2"), ("summaries/grad/l2", ""), ("eval/lin_1", "mean")]

    def record(step: int, mode: tl.ModeKeys, order: list[int]) -> tl.StepRecord:
        values = [100 * step + 10 * list(tl.ModeKeys).index(mode) + i for i in order]
        return tl.StepRecord.from_arrays(
            step, mode, step, "worker_0", 1_700_000_000.0 + step,
            scalar_names=tuple(names[i] for i in order), scalar_values=np.array(values, dtype=np.float64),
        )

    keys = {}
    for step, order in ((0, list(range(len(names)))), (1, list(reversed(range(len(names)))))):
        backend = MLflowBackend(client=client, run_id=run_id, histogram_every=0, heatmaps=False, tracker_stats="all")
        backend.open(tl.RunInfo("collide", str(tmp_path)))
        for mode in (tl.ModeKeys.TRAIN, tl.ModeKeys.EVAL):
            backend.write(record(step, mode, order))
            keys.update({(mode, i): backend.metric_key(*names[i], mode) for i in order})
        backend.close()

    assert len(set(keys.values())) == 2 * len(names)
    assert set(client.get_run(run_id).data.metrics) == set(keys.values())
    for (mode, i), key in keys.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        offset = 10 * list(tl.ModeKeys).index(mode) + i
        assert history == [(0, float(offset)), (1, float(100 + offset))], key


def test_records_written_directly_modes_workers_and_large_batches(mlflow_server: str, tmp_path: Path) -> None:
    """The backend driven by hand with records as the dispatcher hands them over."""
    client = MlflowClient(mlflow_server)
    run_id = _new_run(client, tmp_path)
    backend = MLflowBackend(client=client, run_id=run_id, prefix="tl", histogram_every=0, heatmaps=False, tracker_stats="all")
    backend.open(tl.RunInfo("direct", str(tmp_path), rank=0, world_size=2, config={"include_workers": "all"}))
    many = [tl.ScalarEntry(f"weights/layer{i}.weight", "l2", float(i)) for i in range(2100)]  # > 2 batches
    counts, edges = np.array([1, 2, 1]), np.array([0.0, 1.0, 2.0, 3.0])
    histogram = tl.HistogramEntry("weights/w", counts, edges, 0.0, 3.0, 4, 6.0, 11.0)
    records = [
        tl.StepRecord(7, tl.ModeKeys.TRAIN, 7, "worker_0", 1_700_000_000.5, scalars=many, histograms=[histogram]),
        tl.StepRecord(7, tl.ModeKeys.PREDICT, 3, "worker_1", 1_700_000_001.0, scalars=[tl.ScalarEntry("summaries/x", None, 2.5)]),
        tl.StepRecord(8, tl.ModeKeys.GLOBAL, 8, "worker_1", 1_700_000_002.0, scalars=[tl.ScalarEntry("scalars/a[0]", None, 1.0)]),
    ]
    for record in records:
        backend.write(record)
    backend.close()

    metrics = client.get_run(run_id).data.metrics
    assert len(metrics) == 2100 + 2  # quantiles are the record's own statistics: none in a hand-made record
    assert all(metrics[f"tl-weights/layer{i}.weight/l2"] == float(i) for i in range(2100))  # rank 0: no infix
    assert metrics["tl-predict-worker_1-summaries/x"] == 2.5
    assert metrics[backend.metric_key("scalars/a[0]", None, "global", "worker_1")] == 1.0
    assert re.fullmatch(r"tl-global-worker_1-scalars/a_0_-[0-9a-f]{8}", backend.metric_key("scalars/a[0]", None, "global", "worker_1"))
    l2 = client.get_metric_history(run_id, "tl-weights/layer5.weight/l2")
    assert [(m.step, m.timestamp, m.value) for m in l2] == [(7, 1_700_000_000_500, 5.0)]
    assert [m.step for m in client.get_metric_history(run_id, "tl-predict-worker_1-summaries/x")] == [7]
    assert _artifacts(client, run_id) == []  # histogram_every=0, heatmaps=False


# ---------------------------------------------------------------------------- a tracker that is down


@pytest.mark.filterwarnings("ignore:tensorlens. backend")
def test_unreachable_tracker_does_not_break_training(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    backend = MLflowBackend(tracking_uri=uri, run_id="0" * 32)
    model = Tiny()
    hook = _watch(model, tmp_path, [backend])
    _train(hook, model)

    stats = hook.backend_stats()
    assert stats["local"].written > 0 and stats["local"].failed == 0
    assert stats["mlflow"].written == 0
    assert stats["mlflow"].failed + stats["mlflow"].dropped == stats["local"].written
    with tl.open_run(hook.run_dir) as run:
        assert run.steps(mode="train") == list(range(0, TRAIN_STEPS, SAVE_INTERVAL))
        assert len(run.steps(mode="eval")) == len(range(0, EVAL_BATCHES, SAVE_INTERVAL))
        assert run.tensor("gradients/fc1.weight").reduction_values("l2").keys() == set(range(0, TRAIN_STEPS, SAVE_INTERVAL))


# ---------------------------------------------------------------------------- a tracker that dies or hangs mid-run


@pytest.fixture
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A server of this test's own, to kill or to freeze."""
    process, uri = _start_server(tmp_path_factory.mktemp("mlflow-own-server"))
    try:
        yield process, uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)  # a frozen server must be able to take SIGTERM
        _stop(process)


def _train_steps(hook: tl.Hook, model: nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 2)).backward()
        optimizer.step()


def _refuses(uri: str, within_s: float = 60.0) -> bool:
    """Whether the server's port refuses connections (its worker processes may take a moment to die)."""
    port = int(uri.rsplit(":", 1)[1])
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _tensorlens_warnings(caught: list[Any]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("tensorlens: backend MLflowBackend")]


@pytest.mark.timeout(600)
def test_a_tracker_killed_mid_run_costs_close_nothing_and_every_record_is_counted(own_server, tmp_path: Path) -> None:
    process, uri = own_server
    client = MlflowClient(uri)
    run_id = _new_run(client, tmp_path)
    backend = MLflowBackend(tracking_uri=uri, run_id=run_id, histogram_every=3, tracker_stats="all")
    model = Tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = tl.watch(model, save_interval=1, activations=True, backends=[backend], out_dir=tmp_path / "run")
        _train_steps(hook, model, 4)
        assert hook.flush() is True
        before = client.get_metric_history(run_id, "tensorlens-gradients/fc1.weight/l2")
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        assert _refuses(uri)
        _train_steps(hook, model, 4)
        started = time.monotonic()
        hook.close()
        print(f"close() after the MLflow server was killed: {time.monotonic() - started:.2f} s")

    assert [m.step for m in before] == [0, 1, 2, 3]
    stats = hook.backend_stats()
    assert stats["local"].written == 8
    mlflow_stats = stats["mlflow"]
    assert (mlflow_stats.written, mlflow_stats.failed, mlflow_stats.dropped, mlflow_stats.abandoned) == (4, 4, 0, 0)
    assert mlflow_stats.produced == 8
    messages = _tensorlens_warnings(caught)
    assert messages and all("unreachable" in m for m in messages), messages
    assert f"the MLflow tracking server at {uri} is unreachable" in messages[0]
    assert not any("falling behind" in m or "blocked" in m for m in messages)
    with tl.open_run(hook.run_dir) as run:
        assert run.steps() == list(range(8))


@pytest.mark.timeout(600)
def test_a_frozen_tracker_holds_close_only_for_the_stall_timeout(own_server, tmp_path: Path) -> None:
    """SIGSTOP: the server still accepts connections (the kernel does) but never answers."""
    process, uri = own_server
    client = MlflowClient(uri)
    run_id = _new_run(client, tmp_path)
    # send_interval=0: each write() sends its record, so the frozen server holds the writes
    backend = MLflowBackend(tracking_uri=uri, run_id=run_id, histogram_every=0, heatmaps=False, send_interval=0)
    model = Tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = tl.watch(model, save_interval=1, backends=[backend], out_dir=tmp_path / "run")
        _train_steps(hook, model, 3)
        assert hook.flush() is True
        os.killpg(process.pid, signal.SIGSTOP)
        try:
            _train_steps(hook, model, 3)
            started = time.monotonic()
            hook.close()
            print(f"close() with the MLflow server frozen: {time.monotonic() - started:.2f} s")
            # close() returned while the backend still waits for the frozen server
            assert any(t.name == "tensorlens-mlflow" and t.is_alive() for t in threading.enumerate())
        finally:
            os.killpg(process.pid, signal.SIGCONT)

    stats = hook.backend_stats()["mlflow"]
    assert stats.produced == 6 and stats.written == 3 and stats.failed == 0
    assert stats.written + stats.failed + stats.dropped + stats.abandoned == 6 and stats.abandoned == 3
    messages = _tensorlens_warnings(caught)
    assert len(messages) == 1 and "was blocked in write() for" in messages[0] and "3 record(s) abandoned" in messages[0]
    with tl.open_run(hook.run_dir) as run:
        assert run.steps() == list(range(6))
