"""What each backend costs the training thread, and how fast it writes in the background.

Run it from the repository root::

    python benchmarks/backends.py                        # every backend, readable table
    python benchmarks/backends.py --json > out.json
    python benchmarks/backends.py --backends local tensorboard --steps 20 --burst 20

Method (why it is built this way):

- One synthetic record per saved step, shaped like a mid-sized model: ``--scalars`` scalars
  (``--tensors`` tensors x statistics, ~1000) and ``--histograms`` 64-bin histograms (~100).
  The record is built once; each step submits a copy with its own step number, so only the
  dispatch path is measured, not the statistics engine (``benchmarks/overhead.py`` measures that).
- Each backend gets its own :class:`~tensorlens.dispatch.Dispatcher`, exactly as a hook would
  build it, and nothing else: the local store is not added, so each row is one backend alone.
- **Blocked**: ``--steps`` saved steps, each after a fixed unit of simulated training (small
  torch ops, calibrated to about ``--work-ms`` on an idle interpreter). What is timed is the
  training thread's call of ``Dispatcher.submit``: the whole cost a saved step pays for
  dispatch. Writing happens on background threads, but pure-Python writing holds the GIL, so a
  busy backend shows up as GIL waits (switch interval: 5 ms): look at p99 and max too.
  ``cpu`` is the mean CPU time of the training thread inside ``submit`` (``thread_time``): the
  work itself, without GIL waits or the OS running other processes.
- The ``memory`` backend does almost nothing in the background: its row is the noise floor
  of the machine (on a loaded machine, wall-clock outliers of several ms hit every row).
- **Work slowdown**: the work unit's median duration while the backend writes in the
  background, divided by its median duration just before and just after, with the backend idle. It is how much a backend's
  background work (holding the GIL) slows a Python-heavy training loop; 1.00 is none.
- **Throughput**: ``--burst`` records submitted back to back, then ``flush()``; records per
  second from the first submit until the backend flushed the last one.
- W&B runs offline in a temporary folder; MLflow logs to a SQLite store in a temporary folder;
  TensorBoard writes event files there. A backend whose library is missing is reported, not run.
- Nothing asserts a time: this is a measuring tool, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator

import numpy as np
import torch

import tensorlens as tl
from tensorlens.backends.base import backend_class
from tensorlens.dispatch import Dispatcher
from tensorlens.modes import ModeKeys

ALL_BACKENDS = ("local", "memory", "tensorboard", "wandb", "mlflow")
STATS = ("min", "max", "mean", "std", "l2", "numel", "nan_count", "inf_count", "abs_mean", "zero_fraction")


@dataclasses.dataclass
class Result:
    backend: str
    blocked_mean_ms: float | None = None
    blocked_p50_ms: float | None = None
    blocked_p99_ms: float | None = None
    blocked_max_ms: float | None = None
    blocked_cpu_ms: float | None = None
    work_slowdown: float | None = None
    records_per_s: float | None = None
    scalars_per_s: float | None = None
    written: int = 0
    dropped: int = 0
    failed: int = 0
    error: str | None = None


def make_record(n_scalars: int, n_histograms: int, bins: int) -> tl.StepRecord:
    """A record shaped like a model with ``n_scalars / len(STATS)`` tensors."""
    rng = np.random.default_rng(0)
    tensors = [f"gradients/encoder.layers.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(-(-n_scalars // len(STATS)))]
    scalars = [tl.ScalarEntry(name, stat, float(rng.normal())) for name in tensors for stat in STATS][:n_scalars]
    histograms = []
    for i in range(n_histograms):
        values = rng.normal(size=4096)
        counts, edges = np.histogram(values, bins=bins)
        histograms.append(
            tl.HistogramEntry(
                tensor=tensors[i % len(tensors)],
                counts=counts.astype(np.int64),
                edges=edges,
                min=float(values.min()),
                max=float(values.max()),
                count=values.size,
                sum=float(values.sum()),
                sum_squares=float(values @ values),
            )
        )
    return tl.StepRecord(0, ModeKeys.TRAIN, 0, "worker_0", time.time(), scalars=scalars, histograms=histograms)


@contextlib.contextmanager
def open_backend(name: str, work_dir: str) -> Iterator[tl.Backend]:
    """The backend ``name`` writing under ``work_dir`` (a tracker run created for it)."""
    if name == "wandb":
        import wandb

        run = wandb.init(mode="offline", dir=work_dir, project="tensorlens-bench", settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False, silent=True))
        try:
            yield backend_class(name)(run=run)
        finally:
            run.finish()
    elif name == "mlflow":
        import mlflow

        uri = f"sqlite:///{os.path.join(work_dir, 'mlflow.db')}"
        client = mlflow.MlflowClient(tracking_uri=uri)
        run = client.create_run(experiment_id="0")
        try:
            yield backend_class(name)(tracking_uri=uri, run_id=run.info.run_id)
        finally:
            client.set_terminated(run.info.run_id)
    else:
        yield backend_class(name)()


_WORK_INPUT = torch.randn(64, 64) / 8


def simulated_training(iterations: int) -> None:
    """A fixed amount of small torch ops: kernels release the GIL, dispatching them needs it,
    as in a small model's training step on a CPU."""
    a = _WORK_INPUT
    for _ in range(iterations):
        a = torch.tanh(a @ _WORK_INPUT)


def calibrate(work_ms: float) -> int:
    """Iterations of :func:`simulated_training` taking about ``work_ms``."""
    iterations = 10
    while True:
        start = time.perf_counter()
        simulated_training(iterations)
        elapsed = (time.perf_counter() - start) * 1000
        if elapsed >= work_ms / 4 or iterations > 1_000_000:
            break
        iterations *= 2
    return max(1, round(iterations * work_ms / elapsed))


def measure(name: str, template: tl.StepRecord, args: argparse.Namespace, work: int) -> Result:
    result = Result(name)
    with tempfile.TemporaryDirectory(prefix="tensorlens-bench-") as work_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            backend_ctx = open_backend(name, work_dir)
            backend = backend_ctx.__enter__()
        except Exception as err:  # a missing or broken integration is a row, not a crash
            result.error = f"{type(err).__name__}: {err}"
            return result
        try:
            run = tl.RunInfo("bench", os.path.join(work_dir, "run"))
            dispatcher = Dispatcher([backend], run, max_pending=max(64, args.burst + 1))
            step = 0

            def next_record() -> tl.StepRecord:
                nonlocal step
                record = template.replace(step=step, mode_step=step, wall_time=time.time())
                step += 1
                return record

            # warm-up: open() and the first writes (imports, file creation) happen here
            for _ in range(2):
                record = next_record()
                dispatcher.submit(record)
            dispatcher.flush(timeout=600)

            # the idle reference is taken right here, not once for all backends: on a shared
            # machine the load changes from one backend to the next
            iterations = work

            def idle_work(repeats: int = 10) -> list[float]:
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    simulated_training(iterations)
                    samples.append((time.perf_counter() - start) * 1000)
                return samples

            idle = idle_work()
            blocked, blocked_cpu, worked = [], [], []
            for _ in range(args.steps):
                start = time.perf_counter()
                simulated_training(iterations)
                record = next_record()
                submit, submit_cpu = time.perf_counter(), time.thread_time()
                dispatcher.submit(record)
                blocked.append((time.perf_counter() - submit) * 1000)
                blocked_cpu.append((time.thread_time() - submit_cpu) * 1000)
                worked.append((submit - start) * 1000)
            dispatcher.flush(timeout=600)
            idle += idle_work()  # before and after: the machine's load drifts
            result.work_slowdown = statistics.median(worked) / statistics.median(idle)

            start = time.perf_counter()
            for _ in range(args.burst):
                record = next_record()
                dispatcher.submit(record)
            dispatcher.flush(timeout=600)
            elapsed = time.perf_counter() - start
            dispatcher.close(timeout=600)

            blocked.sort()
            result.blocked_mean_ms = statistics.fmean(blocked)
            result.blocked_p50_ms = blocked[len(blocked) // 2]
            result.blocked_p99_ms = blocked[min(len(blocked) - 1, int(len(blocked) * 0.99))]
            result.blocked_max_ms = blocked[-1]
            result.blocked_cpu_ms = statistics.fmean(blocked_cpu)
            result.records_per_s = args.burst / elapsed
            result.scalars_per_s = args.burst * len(template.scalars) / elapsed
            stats = dispatcher.stats()[name]
            result.written, result.dropped, result.failed = stats.written, stats.dropped, stats.failed
        except Exception as err:
            result.error = f"{type(err).__name__}: {err}"
        finally:
            with contextlib.suppress(Exception):
                backend_ctx.__exit__(None, None, None)
    return result


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    print(
        f"per saved step: {args.scalars} scalars, {args.histograms} histograms x {args.bins} bins; "
        f"{args.steps} paced steps (~{args.work_ms:g} ms of work each), burst of {args.burst}"
    )
    header = f"{'backend':<12} {'blocked ms: mean':>16} {'p50':>7} {'p99':>7} {'max':>7} {'cpu':>6} {'slowdown':>9} {'records/s':>10} {'scalars/s':>11} {'written':>8} {'dropped':>8} {'failed':>7}"
    print(header)
    print("-" * len(header))
    for r in results:
        if r.error:
            print(f"{r.backend:<12} not run: {r.error}")
            continue
        print(
            f"{r.backend:<12} {_fmt(r.blocked_mean_ms):>16} {_fmt(r.blocked_p50_ms):>7} {_fmt(r.blocked_p99_ms):>7} "
            f"{_fmt(r.blocked_max_ms):>7} {_fmt(r.blocked_cpu_ms):>6} {_fmt(r.work_slowdown, 2):>9} {_fmt(r.records_per_s, 1):>10} {_fmt(r.scalars_per_s, 0):>11} "
            f"{r.written:>8} {r.dropped:>8} {r.failed:>7}"
        )


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(ALL_BACKENDS), help="registered backend names")
    parser.add_argument("--scalars", type=int, default=1000)
    parser.add_argument("--histograms", type=int, default=100)
    parser.add_argument("--bins", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="paced saved steps for the blocked-time measurement")
    parser.add_argument("--work-ms", type=float, default=20.0, help="simulated training between saved steps")
    parser.add_argument("--burst", type=int, default=50, help="records submitted back to back for throughput")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")

    torch.set_num_threads(1)  # the training thread's kernels should not take every core from the writers
    template = make_record(args.scalars, args.histograms, args.bins)
    work = calibrate(args.work_ms)
    results = [measure(name, template, args, work) for name in args.backends]
    if args.json:
        meta = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "config": {k: v for k, v in vars(args).items() if k != "json"},
        }
        json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, sys.stdout, indent=2)
        print()
    else:
        print_table(results, args)
    return results


if __name__ == "__main__":
    main()
