"""What tensorlens costs a training loop that already reports to W&B, MLflow and TensorBoard.

Run it from the repository root::

    python benchmarks/trackers.py                          # readable table
    python benchmarks/trackers.py --json > out.json
    python benchmarks/trackers.py --tracker-stats all      # the whole store to every tracker
    python benchmarks/trackers.py --tracker-histogram-interval 1   # the parameters' histograms at every saved step
    python benchmarks/trackers.py --breakdown              # CPU per saved step, part by part

Method (why it is built this way):

- The loop of issue 24: a GPT-2 from ``transformers.GPT2Config`` (``--layers`` blocks,
  ``--width`` wide, no download), AdamW, and the user's own reporting every step: the loss to a
  W&B run (offline), an MLflow run (SQLite store in a temporary folder) and a TensorBoard
  ``SummaryWriter``, all three open for the whole benchmark.
- Two copies of the model train side by side: ``baseline`` (no tensorlens) and ``tensorlens``
  (``tl.watch(activations=True, dynamics=True, save_interval=--save-interval)`` with the W&B,
  MLflow and TensorBoard backends attached to the same runs). Their blocks of ``--block`` steps
  alternate, so both see the same machine load; the block is a multiple of the save interval,
  so every tensorlens block has the same saved steps.
- Timed: each optimizer step (forward, backward, step, the user's three ``log`` calls), on the
  training thread. Tracker writes happen on tensorlens's background thread, so they show up as
  time the training thread waits for the GIL. ``close_s`` is ``hook.close()`` at the end
  (what was still queued for the trackers).
- ``ratio`` is the tensorlens step time over the baseline's (mean and median); issue 24's target
  is a mean ratio of at most 1.2. ``saved_step_ms`` / ``other_step_ms`` split the tensorlens steps
  into saved ones (statistics computed on the training thread) and the others (which pay only for
  the background threads' GIL). ``thread_cpu_s`` is the CPU time of each thread by name until
  ``hook.close()`` (with ``psutil``): what each tracker's thread (``tensorlens-wandb``, ...) and the
  dispatcher cost. ``full_gc_in_steps`` counts the interpreter's full collections that fell inside
  each variant's timed steps (0.1-0.5 s each here: one of them explains an outlying run). Nothing
  asserts a time: this is a measuring tool.
- ``per round`` is the median (and quartiles) of one ratio per round, the tensorlens block over the
  baseline block just before it. Both blocks hold the same saved steps, so each ratio charges them
  in full; unlike the ratio of the means, the median is not moved by a burst of load from another
  process that lands on one or two blocks (this machine is shared: the same code gives ratios of
  the means several per cent apart from one run to the next).
- ``--breakdown`` measures instead where the time goes, as CPU time (``time.thread_time``), which
  other processes do not inflate the way they inflate wall time: the training thread's CPU per
  saved and per other step against the baseline's (steps alternating one by one), the dispatcher
  thread's CPU per record (the record's assembly), then, on the records of that run and one thread
  at a time, the payload's choice and each backend's ``write`` per record (the first two records,
  which carry one-off work such as W&B's chart tables, left out), and what the tracker library's
  own threads spent on those records (W&B hands each ``run.log`` to a thread of its own, which
  sends it to W&B's service process; that process is left out). On two cores and one GIL,
  Python run on tensorlens's threads lengthens the training thread's steps by about as much, so
  the sum over a save interval, divided by the baseline's CPU over that interval, estimates the
  ratio before any GIL waiting or other process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

import tensorlens as tl


def build_model(layers: int, width: int, seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    heads = max(1, width // 16)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=1024, n_positions=128))


@contextlib.contextmanager
def trackers(folder: str) -> Any:
    """A W&B run (offline), an MLflow run (SQLite) and a TensorBoard writer, open together."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    import mlflow
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    mlflow.set_tracking_uri(f"sqlite:///{os.path.join(folder, 'mlflow.db')}")
    run = wandb.init(project="tensorlens-bench", dir=folder, settings=wandb.Settings(console="off"))
    # artifacts beside the store: the default experiment's would go to ./mlruns in the working folder
    experiment = mlflow.create_experiment("tensorlens-bench", artifact_location=os.path.join(folder, "mlflow-artifacts"))
    mlflow.start_run(experiment_id=experiment)
    writer = SummaryWriter(os.path.join(folder, "tb-user"))
    try:
        yield run, mlflow, writer
    finally:
        writer.close()
        mlflow.end_run()
        run.finish()


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by thread name (``{}`` without psutil)."""
    try:
        import psutil
    except ImportError:
        return {}
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for thread in psutil.Process().threads():
        name = names.get(thread.id, "other (trackers' own threads)")
        out[name] = out.get(name, 0.0) + thread.user_time + thread.system_time
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def library_threads_cpu() -> float:
    """CPU seconds so far of this process's threads that are neither the training thread nor
    tensorlens's (a tracker library's own: W&B's asyncio thread)."""
    return sum(v for k, v in thread_cpu_seconds().items() if k != "MainThread" and not k.startswith("tensorlens-"))


class GcPauses:
    """The interpreter's full (generation 2) collections that fall inside a timed step, by variant:
    one takes 0.1-0.5 s in a process holding torch, transformers, wandb and mlflow, so a single
    one in 20 saved steps moves the mean ratio by several per cent."""

    def __init__(self) -> None:
        self.inside: str | None = None  # the variant whose timed step runs now
        self._started: float | None = None
        self.pauses: dict[str, list[float]] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2 or self.inside is None:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.setdefault(self.inside, []).append(time.perf_counter() - self._started)
            self._started = None

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, str]:
        return {name: f"{len(p)} taking {1e3 * sum(p):.0f} ms" for name, p in sorted(self.pauses.items())}


def setup(args: argparse.Namespace, prefix: str) -> tuple[str, torch.Tensor, dict[str, Any], dict[str, Any]]:
    """``(folder, batch, models, optimizers)``: a temporary folder, one batch of tokens, and the two
    identical models (``baseline``, ``tensorlens``) with their AdamW, as both modes train them."""
    torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix=prefix)
    batch = torch.randint(0, 1024, (args.batch, args.seq))
    models = {name: build_model(args.layers, args.width, seed=0) for name in ("baseline", "tensorlens")}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    return folder, batch, models, optimizers


def watch(model: torch.nn.Module, args: argparse.Namespace, folder: str, backends: list[Any]) -> Any:
    """The watch of issue 24's loop: activations and dynamics, saved every ``--save-interval`` steps."""
    extra = {} if args.tracker_stats is None else {"tracker_stats": args.tracker_stats}
    if args.tracker_histogram_interval is not None:
        extra["tracker_histogram_interval"] = args.tracker_histogram_interval
    return tl.watch(model, activations=True, dynamics=True, save_interval=args.save_interval, backends=backends,
                    out_dir=os.path.join(folder, "store"), **extra)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One optimizer step of the user's loop; the loss read on the host, as a loop that logs it does."""
    loss = model(batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def payload_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the trackers were sent, for the report's ``meta``."""
    return {"tracker_stats": args.tracker_stats or os.environ.get("TENSORLENS_TRACKER_STATS") or "default",
            "tracker_histogram_interval": args.tracker_histogram_interval}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    folder, batch, models, optimizers = setup(args, "tl-bench-trackers-")
    times: dict[str, list[float]] = {name: [] for name in models}
    saved: list[bool] = []  # per timed tensorlens step: was it a saved step
    with trackers(folder) as (run, mlflow, writer), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from tensorlens.integrations.tensorboard import TensorBoardBackend

        hook = watch(models["tensorlens"], args, folder, ["local"] if args.local_only else [
            TensorBoardBackend(log_dir=os.path.join(folder, "tb")) if name == "tensorboard" else name
            for name in args.backends])
        step = 0
        own_steps = {name: 0 for name in models}
        gc_pauses = GcPauses()

        def train(name: str, n: int, timed: bool) -> None:
            nonlocal step
            model, opt = models[name], optimizers[name]
            for _ in range(n):
                is_saved = own_steps[name] % args.save_interval == 0
                own_steps[name] += 1
                gc_pauses.inside = name if timed else None
                start = time.perf_counter()
                value = train_step(model, opt, batch)
                run.log({f"{name}/loss": value})
                mlflow.log_metric(f"{name}_loss", value, step=step)
                writer.add_scalar(f"{name}/loss", value, step)
                step += 1
                gc_pauses.inside = None
                if timed:
                    times[name].append(time.perf_counter() - start)
                    if name == "tensorlens":
                        saved.append(is_saved)

        for name in models:  # warm-up: first calls, the kernel compile, the trackers' first rows
            train(name, args.block, timed=False)
        for _ in range(args.rounds):
            for name in models:
                train(name, args.block, timed=True)
        gc_pauses.stop()
        cpu = thread_cpu_seconds()
        start = time.perf_counter()
        hook.close()
        close_s = time.perf_counter() - start
    base, lens = times["baseline"], times["tensorlens"]
    # one ratio per round: the tensorlens block over the baseline block just before it (each block
    # holds the same saved steps, so a block's mean charges them in full); their median is not moved
    # by a burst of load from another process that lands on one block, the ratio of the means is
    rounds = [
        statistics.fmean(lens[i:i + args.block]) / statistics.fmean(base[i:i + args.block])
        for i in range(0, len(base), args.block)
    ]
    result = {
        "baseline_mean_ms": 1e3 * statistics.fmean(base),
        "baseline_median_ms": 1e3 * statistics.median(base),
        "tensorlens_mean_ms": 1e3 * statistics.fmean(lens),
        "tensorlens_median_ms": 1e3 * statistics.median(lens),
        "ratio_mean": statistics.fmean(lens) / statistics.fmean(base),
        "ratio_median": statistics.median(lens) / statistics.median(base),
        "ratio_rounds_median": statistics.median(rounds),
        "ratio_rounds_quartiles": [round(q, 3) for q in statistics.quantiles(rounds, n=4)] if len(rounds) > 1 else rounds,
        "saved_step_ms": 1e3 * statistics.fmean([t for t, s in zip(lens, saved, strict=True) if s]),
        "other_step_ms": 1e3 * statistics.fmean([t for t, s in zip(lens, saved, strict=True) if not s]),
        "close_s": close_s,
        "full_gc_in_steps": gc_pauses.summary(),
        "thread_cpu_s": cpu,
        "steps_timed_each": len(base),
    }
    return {
        "meta": {
            "python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
            "layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq,
            "save_interval": args.save_interval, "block": args.block, "rounds": args.rounds,
            **payload_options(args),
            "tensorlens_backends": "local" if args.local_only else ", ".join(["local", *args.backends]),
        },
        "result": result,
        "target": {"ratio_mean_at_most": 1.2, "met": result["ratio_mean"] <= 1.2},
    }


def run_breakdown(args: argparse.Namespace) -> dict[str, Any]:
    """CPU time per saved step, part by part (see the module docstring, ``--breakdown``)."""
    from tensorlens.backends.local import LocalBackend
    from tensorlens.backends.memory import MemoryBackend
    from tensorlens.backends.payload import PayloadSelector, resolve_tracker_stats

    folder, batch, models, optimizers = setup(args, "tl-bench-breakdown-")
    memory = MemoryBackend()
    cpu: dict[str, list[float]] = {"baseline": [], "saved": [], "other": []}
    warm = 2 * args.save_interval
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hook = watch(models["tensorlens"], args, folder, [memory])
        dispatch_before = 0.0
        steps = warm + args.rounds * args.block
        for i in range(steps):
            if i == warm:
                dispatch_before = thread_cpu_seconds().get("tensorlens-dispatch", 0.0)
            for name in models:  # one step each, in turn: both see the same load
                start = time.thread_time()
                train_step(models[name], optimizers[name], batch)
                spent = time.thread_time() - start
                if i >= warm:
                    cpu["baseline" if name == "baseline" else ("saved" if i % args.save_interval == 0 else "other")].append(spent)
        dispatch = thread_cpu_seconds().get("tensorlens-dispatch", 0.0) - dispatch_before
        hook.close()
    records = [r for r in memory.records if str(r.mode) == "train"]
    timed_records = len(cpu["saved"])
    ms = {k: 1e3 * statistics.fmean(v) for k, v in cpu.items()}
    parts: dict[str, float] = {
        "training thread: statistics of a saved step": ms["saved"] - ms["baseline"],
        "training thread: the other steps of an interval, together": (args.save_interval - 1) * (ms["other"] - ms["baseline"]),
        "dispatcher thread: the record's assembly": 1e3 * dispatch / max(1, timed_records) if dispatch else float("nan"),
    }

    def per_record(fn: Any) -> float:
        spent = []
        for record in records:
            start = time.thread_time()
            fn(record)
            spent.append(time.thread_time() - start)
        return 1e3 * statistics.fmean(spent[2:] or spent)

    # the run's own choice, as its trackers resolve it (Backend.open_payload)
    run_info = memory.run
    parts["payload's choice (once per record, shared by the trackers)"] = per_record(
        PayloadSelector(resolve_tracker_stats(None, run_info.tracker_stats), run_info.tracker_histogram_interval)._choose)
    backends: dict[str, Any] = {"local": LocalBackend}
    with contextlib.nullcontext() if args.local_only else trackers(folder), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not args.local_only:
            from tensorlens.integrations.mlflow import MLflowBackend
            from tensorlens.integrations.tensorboard import TensorBoardBackend
            from tensorlens.integrations.wandb import WandbBackend

            makers = {"wandb": WandbBackend, "mlflow": MLflowBackend,
                      "tensorboard": lambda: TensorBoardBackend(log_dir=os.path.join(folder, "tb"))}
            backends.update({name: makers[name] for name in args.backends})
        for name, make in backends.items():
            backend = make()
            # a RunInfo of its own: its own payload selector (the writes below include a choice)
            run = dataclasses.replace(run_info, run_dir=os.path.join(folder, f"run-{name}"))
            os.makedirs(run.run_dir, exist_ok=True)
            backend.open(run)
            backend.write_metadata(memory.metadata or {})
            before = library_threads_cpu()
            parts[f"{name} backend: write" + ("" if name == "local" else " (its own payload choice included)")] = per_record(backend.write)
            time.sleep(0.5)  # what the library's own threads still do with these records
            spent = library_threads_cpu() - before
            if spent > 0.001 * len(records):  # W&B's: each run.log goes to its service process through a thread of its own
                parts[f"{name} backend: the library's own threads"] = 1e3 * spent / len(records)
            backend.close()
    baseline_interval = args.save_interval * ms["baseline"]
    # each tracker's write includes its own payload choice, which the trackers of a run share: the
    # choice counts once, on its own line
    writers = sum(1 for part in parts if part.endswith("(its own payload choice included)"))
    total = sum(v for v in parts.values() if v == v) - writers * parts["payload's choice (once per record, shared by the trackers)"]
    return {
        "meta": {"layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq,
                 "save_interval": args.save_interval, "threads": args.threads, "records": len(records),
                 **payload_options(args)},
        "baseline_step_cpu_ms": ms["baseline"],
        "saved_step_cpu_ms": ms["saved"],
        "other_step_cpu_ms": ms["other"],
        "parts_ms_per_saved_step": parts,
        "baseline_interval_cpu_ms": baseline_interval,
        "total_ms_per_saved_step": total,
        "estimated_ratio": 1 + total / baseline_interval,
    }


def print_breakdown(report: dict[str, Any]) -> None:
    m = report["meta"]
    print(f"GPT-2 {m['layers']}x{m['width']}, activations and dynamics, saved every {m['save_interval']} steps, "
          f"tracker_stats={m['tracker_stats']}, tracker_histogram_interval={m['tracker_histogram_interval'] or 'default'}: "
          f"CPU time per saved step ({m['records']} records)")
    print(f"  training thread per step: baseline {report['baseline_step_cpu_ms']:.1f} ms, tensorlens saved "
          f"{report['saved_step_cpu_ms']:.1f} ms, other {report['other_step_cpu_ms']:.1f} ms")
    interval = report["baseline_interval_cpu_ms"]
    for part, value in report["parts_ms_per_saved_step"].items():
        print(f"  {value:7.2f} ms  {value / interval:6.3f}  {part}")
    total = report["total_ms_per_saved_step"]
    print(f"  {total:7.2f} ms  {total / interval:6.3f}  in all (the shared payload choice counted once), over "
          f"{interval:.0f} ms of baseline CPU per interval: estimated ratio {report['estimated_ratio']:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="steps per block (a multiple of --save-interval)")
    parser.add_argument("--rounds", type=int, default=4, help="blocks of each variant, alternating")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tracker-stats", default=None, help='"default", "all" or names such as l2,histogram')
    parser.add_argument("--tracker-histogram-interval", type=int, default=None,
                        help="train steps between the records whose histograms go to the trackers (default: 100 "
                             "with the default payload; 1: every saved step)")
    parser.add_argument("--local-only", action="store_true",
                        help="tensorlens with the run store only: what its statistics cost before any tracker")
    parser.add_argument("--backends", default="wandb,mlflow,tensorboard",
                        help="the trackers tensorlens sends to (the user's loop always reports to all three): "
                             "one at a time shows what each costs")
    parser.add_argument("--breakdown", action="store_true",
                        help="CPU time per saved step, part by part, instead of the wall-time comparison")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not set(args.backends) <= {"wandb", "mlflow", "tensorboard"}:
        parser.error("--backends takes wandb, mlflow and tensorboard")
    if args.block % args.save_interval:
        parser.error("--block must be a multiple of --save-interval (every block then has the same saved steps)")
    if args.tracker_stats and args.tracker_stats not in ("default", "all"):
        args.tracker_stats = [s.strip() for s in args.tracker_stats.split(",") if s.strip()]
    if args.breakdown:
        report = run_breakdown(args)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_breakdown(report)
        return 0
    report = run_benchmark(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    r = report["result"]
    print(f"GPT-2 {args.layers}x{args.width}, W&B offline + MLflow (SQLite) + TensorBoard, activations and dynamics, "
          f"saved every {args.save_interval} steps, tracker_stats={report['meta']['tracker_stats']}, "
          f"tracker_histogram_interval={report['meta']['tracker_histogram_interval'] or 'default'}, "
          f"tensorlens backends: {report['meta']['tensorlens_backends']}")
    print(f"  baseline    mean {r['baseline_mean_ms']:8.1f} ms  median {r['baseline_median_ms']:8.1f} ms")
    print(f"  tensorlens  mean {r['tensorlens_mean_ms']:8.1f} ms  median {r['tensorlens_median_ms']:8.1f} ms")
    print(f"  ratio       mean {r['ratio_mean']:8.2f}     median {r['ratio_median']:8.2f}     (target <= 1.2)")
    print(f"  per round   median {r['ratio_rounds_median']:8.2f}     quartiles "
          + " ".join(f"{q:.2f}" for q in r["ratio_rounds_quartiles"])
          + f"     (tensorlens block / the baseline block before it, {args.rounds} rounds)")
    print(f"  tensorlens  saved steps {r['saved_step_ms']:8.1f} ms  other steps {r['other_step_ms']:8.1f} ms")
    print(f"  hook.close() {r['close_s']:.2f} s; {r['steps_timed_each']} steps timed per variant")
    gcs = r["full_gc_in_steps"]
    print("  full GC inside timed steps: " + (", ".join(f"{k} {v}" for k, v in gcs.items()) or "none"))
    if r["thread_cpu_s"]:
        print("  CPU seconds by thread: " + ", ".join(f"{k} {v}" for k, v in r["thread_cpu_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
