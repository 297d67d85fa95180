"""How long the HTML report and the module explorer take to build, and how large they are.

Run it from the repository root::

    python benchmarks/report.py                         # 10,000 steps x 200 tensors (builds a ~2 GB store once)
    python benchmarks/report.py --steps 2000 --json
    python benchmarks/report.py --store /tmp/bench-run  # reuse a store built before

Method: a synthetic run store is written through the store writer with
``StepRecord.from_arrays`` (no model, no statistics engine: only the layout of a real run),
shaped like a transformer of ``--blocks`` blocks with four linear layers each (q, k, v, mlp):
weights, biases and gradients of every parameter plus every layer's activations, which is
200 tensors for 10 blocks, each with ``min max mean std l2 numel nan_count inf_count`` and a
64-bin histogram, and a loss, every step. Gradients of one layer turn NaN for a few steps, so
the NaN section has something to show. Then, each timed separately: reading the run with
``Run.records()`` (the public reader, step by step), building the report, building the
explorer; sizes of the files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from tensorlens.records import HISTOGRAM_INFO, StepRecord
from tensorlens.store.writer import RunStoreWriter

STATS = ("min", "max", "mean", "std", "l2", "numel", "nan_count", "inf_count")
BINS = 64


def tensor_names(blocks: int) -> list[str]:
    """The tensors of the synthetic model: 20 per block."""
    names = []
    for b in range(blocks):
        for layer in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            module = f"blocks.{b}.{layer}"
            names += [f"weights/{module}.weight", f"biases/{module}.bias",
                      f"gradients/{module}.weight", f"gradients/{module}.bias", f"activations/{module}"]
    return names


def module_metadata(blocks: int, width: int = 256) -> list[dict[str, object]]:
    """The ``modules`` meta entry a recorder would write for the synthetic model."""
    out: list[dict[str, object]] = [{"name": "", "type": "Transformer", "extra_repr": ""}]
    order = 0
    for b in range(blocks):
        if b == 0:
            out.append({"name": "blocks", "type": "ModuleList", "extra_repr": ""})
        out.append({"name": f"blocks.{b}", "type": "Block", "extra_repr": ""})
        for sub in ("attn", "mlp"):
            out.append({"name": f"blocks.{b}.{sub}", "type": "Attention" if sub == "attn" else "MLP", "extra_repr": ""})
        for layer in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            out.append({
                "name": f"blocks.{b}.{layer}", "type": "Linear",
                "extra_repr": f"in_features={width}, out_features={width}, bias=True",
                "parameters": {"weight": [width, width], "bias": [width]}, "call_order": order,
            })
            order += 1
    return out


def write_synthetic_run(path: str, steps: int, blocks: int = 10, seed: int = 0, progress: bool = False) -> str:
    """Write a run store of ``steps`` steps into the folder ``path``; returns ``path``."""
    rng = np.random.default_rng(seed)
    names = tensor_names(blocks)
    count = len(names)
    scalar_names = tuple((t, s) for t in names for s in STATS) + (("losses/loss", ""),)
    histogram_names = tuple((t, BINS) for t in names)
    scale = rng.uniform(0.5, 2.0, size=count)
    numel = np.where([n.endswith("bias") for n in names], 256.0, 65536.0)
    centres = np.linspace(-3, 3, BINS)
    shape = np.exp(-0.5 * centres**2)
    meta = {"run_name": os.path.basename(os.path.abspath(path)), "world_size": "1",
            "modules": json.dumps(module_metadata(blocks))}
    writer = RunStoreWriter(os.path.join(path, "tensorlens.sqlite"), meta)
    nan_layer = names.index("gradients/blocks.3.mlp.fc.weight") if blocks > 3 else 0
    started = time.perf_counter()
    try:
        for step in range(steps):
            decay = 1.0 / (1.0 + step / 2000.0)
            std = scale * decay * (1 + 0.05 * rng.standard_normal(count))
            mean = 0.01 * std * rng.standard_normal(count)
            values = np.empty((count, len(STATS)))
            values[:, 0] = mean - 3 * std
            values[:, 1] = mean + 3 * std
            values[:, 2] = mean
            values[:, 3] = std
            values[:, 4] = np.sqrt(numel * (std**2 + mean**2))
            values[:, 5] = numel
            values[:, 6] = 0
            values[:, 7] = 0
            if steps // 2 <= step < steps // 2 + 5:
                values[nan_layer, [0, 1, 2, 3, 4]] = np.nan
                values[nan_layer, 6] = 17
            loss = 3.0 * decay + 0.05 * rng.standard_normal()
            scalar_values = np.append(values.reshape(-1), loss)
            counts = np.round(shape[None, :] * (numel[:, None] / shape.sum()) ).astype(np.int64)
            low, high = values[:, 0:1], values[:, 1:2]
            edges = low + (high - low) * np.linspace(0, 1, BINS + 1)[None, :]
            edges = np.where(np.isfinite(edges), edges, 0.0)
            info = np.zeros((count, len(HISTOGRAM_INFO)))
            info[:, 0], info[:, 1], info[:, 2] = low[:, 0], high[:, 0], numel
            record = StepRecord.from_arrays(
                step, "train", step, "worker_0", 1.7e9 + step,
                scalar_names=scalar_names, scalar_values=scalar_values,
                histogram_names=histogram_names, counts=counts.reshape(-1), edges=edges.reshape(-1),
                histogram_info=info,
            )
            writer.write(record)
            if progress and step % 500 == 0:
                print(f"  wrote {step}/{steps} steps ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    finally:
        writer.close()
    return path


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run_benchmark(steps: int, blocks: int, store: str | None, out: str) -> dict[str, object]:
    import tensorlens as tl
    from tensorlens.reports import build_explorer, build_report

    made = store is None
    store = store or tempfile.mkdtemp(prefix="tensorlens-bench-report-")
    results: dict[str, object] = {"steps": steps, "tensors": len(tensor_names(blocks))}
    try:
        if made or not os.path.exists(os.path.join(store, "tensorlens.sqlite")):
            started = time.perf_counter()
            write_synthetic_run(store, steps, blocks, progress=True)
            results["write_store_s"] = round(time.perf_counter() - started, 2)
        results["store_bytes"] = _size(store)
        with tl.open_run(store) as run:
            started = time.perf_counter()
            n = sum(1 for _ in run.records())
            results["records_read"] = n
            results["read_all_records_s"] = round(time.perf_counter() - started, 2)
        os.makedirs(out, exist_ok=True)
        for name, build in (("report", build_report), ("explorer", build_explorer)):
            path = os.path.join(out, f"{name}.html")
            started = time.perf_counter()
            build([store] if name == "report" else store).save(path)
            results[f"{name}_build_s"] = round(time.perf_counter() - started, 2)
            results[f"{name}_bytes"] = os.path.getsize(path)
    finally:
        if made:
            shutil.rmtree(store, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=10, help="20 tensors per block (default: 10 -> 200 tensors)")
    parser.add_argument("--store", default=None, help="a run folder to build (once) and reuse; default: a temporary one")
    parser.add_argument("--out", default="benchmark-report", help="folder for report.html and explorer.html")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = run_benchmark(args.steps, args.blocks, args.store, args.out)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for key, value in results.items():
            print(f"{key:>32}: {value}")


if __name__ == "__main__":
    main()
