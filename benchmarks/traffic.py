"""Bytes read and written per recorded value by each statistics path, for one saved step.

On a GPU a step's statistics are bound by memory traffic, so the passes over the values are the
cost; this counts them on a CPU, where no GPU is needed:

- **torch** (PyTorch ops, what a GPU ran before the Triton path): every ATen op the step issues
  is seen by a ``TorchDispatchMode``, which adds up the bytes of the tensors each op takes (read)
  and gives (written); views move nothing and are free. The plan is built in a first step, then
  one step is counted: the path a GPU takes (``sync_free``: NaN/Inf counted in the first pass).
  ``torch_cpu`` is the same path as a CPU runs it (flags read on the host, NaN/Inf counted only
  where a sum is not finite), which docs/performance.md's "nine reads and three writes" describes.
- **triton**: the kernels' own accounting of their loads and stores (``TritonRows.traffic`` for
  the one pass over the values; each histogram sample value read twice, by the range and the
  binning kernel, and one 8-byte atomic add per binned value), plus the ATen ops the path issues
  around them (the dispatch mode again, with the kernel launches themselves left out: Triton's
  interpreter copies their arguments, which a GPU does not). The kernels run in Triton's
  interpreter when no GPU is here: set ``TRITON_INTERPRET=1`` (the script does, before importing
  triton, when CUDA is not available).
- **native** (the compiled CPU kernel): its accounting, one read of every value, plus the strided
  sample it writes while reading and reads again to bin it, plus the ATen ops around it.

"values" is every value of the step's tensors; "reads/value" is bytes read over the values'
own bytes (1.0: each value read once).

    python benchmarks/traffic.py                     # a GPT-2-like block of tensors, every path
    python benchmarks/traffic.py --json --out traffic.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

if __name__ == "__main__" and "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():  # before triton is imported: it reads this once
        os.environ["TRITON_INTERPRET"] = "1"

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig, ReductionConfig
from tensorlens.stats import native, path
from tensorlens.stats.histogram import sample_stride

#: torch: PyTorch ops as a GPU runs them; torch_cpu: as a CPU does (flags read on the host).
PATHS = ("torch", "torch_cpu", "native", "triton")
#: Ops that allocate or alias without moving values.
_FREE = {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh", "_local_scalar_dense", "set_"}


class Traffic(TorchDispatchMode):
    """Bytes of the tensors each ATen op reads and writes (views and allocations free)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = self.written = self.ops = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if self.paused or getattr(func, "is_view", False) or name in _FREE:
            return out
        given = {id(t) for t in tree_leaves(kwargs.get("out")) if isinstance(t, torch.Tensor)}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) not in given]
        self.read += sum(_nbytes(t) for t in inputs)
        self.written += sum(_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.ops += 1
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def step_tensors(layers: int, width: int, tokens: int, seed: int = 0) -> list[TensorJob]:
    """A transformer-like step: per layer the weights and gradients of four projections (width^2
    and 4 width^2), their biases, layer norms, and activations of ``tokens`` rows; default
    reductions plus l2 and zero_fraction, 64-bin histograms sampling 4096 values."""
    g = torch.Generator().manual_seed(seed)
    stats = ReductionConfig(norms=("l2",), counts=("zero_fraction",)).stat_names()
    histogram = HistogramConfig(bins=64)
    jobs = []
    for layer in range(layers):
        shapes = {
            "qkv": (3 * width, width),
            "proj": (width, width),
            "fc": (4 * width, width),
            "out": (width, 4 * width),
        }
        for kind in ("weights", "gradients"):
            for name, shape in shapes.items():
                jobs.append(
                    TensorJob(f"{kind}/{layer}.{name}.weight", [torch.randn(shape, generator=g)], stats, histogram)
                )
                jobs.append(
                    TensorJob(f"{kind}/{layer}.{name}.bias", [torch.randn(shape[0], generator=g)], stats, histogram)
                )
            for norm in ("ln1", "ln2"):
                jobs.append(
                    TensorJob(f"{kind}/{layer}.{norm}.weight", [torch.randn(width, generator=g)], stats, histogram)
                )
        for name, columns in (("attn", width), ("fc", 4 * width), ("mlp", width)):
            jobs.append(
                TensorJob(f"activations/{layer}.{name}", [torch.randn(tokens, columns, generator=g)], stats, histogram)
            )
    return jobs


@contextlib.contextmanager
def stats_path(chosen: str) -> Iterator[None]:
    before = os.environ.get("TENSORLENS_STATS_PATH")
    os.environ["TENSORLENS_STATS_PATH"] = chosen
    path.reset()
    native.reset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TENSORLENS_STATS_PATH", None)
        else:
            os.environ["TENSORLENS_STATS_PATH"] = before
        path.reset()
        native.reset()


def _sample_values(jobs: list[TensorJob]) -> int:
    total = 0
    for job in jobs:
        if job.histogram is None or not job.histogram.enabled:
            continue
        t = job.pieces[0]
        stride = sample_stride(t.numel(), job.histogram.sample, t.shape[-1] if t.dim() else 1)
        total += -(-t.numel() // stride)
    return total


def measure(label: str, jobs: list[TensorJob]) -> dict[str, Any] | None:
    """One counted step on path ``label`` (``None`` where it cannot run here)."""
    chosen = "torch" if label == "torch_cpu" else label
    sync_free = label in ("torch", "triton")
    values = sum(job.pieces[0].numel() for job in jobs)
    value_bytes = sum(_nbytes(job.pieces[0]) for job in jobs)
    samples = _sample_values(jobs)
    with stats_path(chosen):
        device = jobs[0].pieces[0].device
        if path.path_for(device, sync_free=sync_free) != chosen:
            return None
        engine = StepStatistics(sync_free=sync_free)
        engine.compute(jobs)  # builds the plan
        counter = Traffic()
        launches = _pause_launches(counter) if chosen == "triton" else contextlib.nullcontext()
        with launches, counter:
            engine.compute(jobs)
        plan = engine._plan
    kernel_read = kernel_written = 0
    if chosen == "triton":
        own = plan.triton_rows.traffic()
        width = 4  # the samples are read in their own dtype (float32 here)
        kernel_read = own["values"] + own["other_read"] + 2 * samples * width + samples * 8
        kernel_written = own["written"] + samples * 8
    elif chosen == "native":
        kernel_read = value_bytes + samples * 4  # one pass over the values; the gathered sample binned
        kernel_written = samples * 4 + len(jobs) * 9 * 8  # the sample gathered in the same read; the rows
    read, written = counter.read + kernel_read, counter.written + kernel_written
    return {
        "path": label,
        "tensors": len(jobs),
        "values": values,
        "value_bytes": value_bytes,
        "read_bytes_per_value": read / values,
        "written_bytes_per_value": written / values,
        "reads_per_value": read / value_bytes,
        "writes_per_value": written / value_bytes,
        "aten_ops": counter.ops,
        "aten_read_per_value": counter.read / values,
        "aten_written_per_value": counter.written / values,
        "kernel_read_per_value": kernel_read / values,
        "kernel_written_per_value": kernel_written / values,
    }


@contextlib.contextmanager
def _pause_launches(counter: Traffic) -> Iterator[None]:
    """Leave the Triton launches out of the ATen count (their traffic is the kernels' accounting;
    Triton's interpreter copies their arguments with ATen ops, which a GPU launch does not)."""
    from tensorlens.stats.triton import rows

    original = rows._quiet

    @contextlib.contextmanager
    def paused(device: torch.device) -> Iterator[None]:
        counter.paused = True
        try:
            with original(device):
                yield
        finally:
            counter.paused = False

    rows._quiet = paused
    try:
        yield
    finally:
        rows._quiet = original


def format_rows(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "path       B read/value  B written/value  reads/value  writes/value  ATen ops  (of which ATen: read, written B/value)"
    ]
    for r in results:
        lines.append(
            f"{r['path']:<10} {r['read_bytes_per_value']:>12.2f} {r['written_bytes_per_value']:>16.2f} "
            f"{r['reads_per_value']:>12.2f} {r['writes_per_value']:>13.2f} {r['aten_ops']:>9}  "
            f"({r['aten_read_per_value']:.2f}, {r['aten_written_per_value']:.2f})"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--json", action="store_true", help="print JSON on stdout (the table on stderr)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    jobs = step_tensors(args.layers, args.width, args.tokens)
    results, skipped = [], []
    for chosen in args.paths:
        found = measure(chosen, jobs)
        (results.append(found) if found is not None else skipped.append(chosen))
    table = "\n".join(format_rows(results))
    if skipped:
        table += f"\n(not measured here: {', '.join(skipped)} cannot run on these tensors)"
    values = sum(job.pieces[0].numel() for job in jobs)
    header = f"{len(jobs)} tensors, {values:,} float32 values, one saved step (default reductions + l2, zero_fraction; 64 bins)"
    payload = {
        "tensors": len(jobs),
        "values": values,
        "results": results,
        "skipped": skipped,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
    if args.json:
        print(header + "\n" + table, file=sys.stderr)
        print(json.dumps(payload, indent=2))
    else:
        print(header + "\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
