"""GPT-2 124M on one GPU: what recording statistics costs on each path, and a saved step that waits
for the device only for its one copy. Run by ``benchmarks/gpu.sh`` (inside 10 minutes).

1. **Exactness on the device**: tensors of every float dtype and size class (NaN and Inf too), on
   the Triton path and on PyTorch ops: scalars within float rounding, histogram counts and edges
   equal to the bit.
2. **Host syncs**: the plain loop's step, then a saved step of each path (weights, biases,
   gradients, activations) under ``torch.cuda.set_sync_debug_mode("error")``, the one copy of the
   step's statistics to the host excepted (it is the step's one sync, by design); and the syncs of
   a saved step counted under ``"warn"`` against the plain loop's.
3. **Overhead**: GPT-2 124M from its config (Hugging Face ``transformers``), bf16 autocast,
   sequence 1024, AdamW, at the largest batch that fits with room to spare; variants interleaved
   in rounds (a block of steps each, order rotated each round): the plain loop twice (A/A
   control), weights+biases+gradients every step on each path, and with activations on each path.
   Each variant has its own model (same init) and optimizer; block times are taken between
   ``torch.cuda.synchronize()`` calls and include ``hook.flush()``. Ratios are medians of
   per-round ratios to the plain loop of the same round.

``--dry-run`` runs every part on a tiny GPT-2 on the CPU (paths that run there), to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import tensorlens as tl
from tensorlens.compute.jobs import TensorJob
from tensorlens.compute.step import StepStatistics
from tensorlens.config import HistogramConfig
from tensorlens.dispatch.assemble import host_record
from tensorlens.stats import path as stats_paths

FULL = ("weights", "biases", "gradients", "activations")
PARAMETERS = ("weights", "biases", "gradients")


@contextlib.contextmanager
def stats_path(chosen: str | None) -> Iterator[None]:
    """``TENSORLENS_STATS_PATH=chosen`` for what runs inside (read at every step)."""
    before = os.environ.get("TENSORLENS_STATS_PATH")
    if chosen is None:
        os.environ.pop("TENSORLENS_STATS_PATH", None)
    else:
        os.environ["TENSORLENS_STATS_PATH"] = chosen
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TENSORLENS_STATS_PATH", None)
        else:
            os.environ["TENSORLENS_STATS_PATH"] = before


def gpu_paths(device: torch.device) -> list[str]:
    """The paths that run on ``device`` here: PyTorch ops always, Triton where it runs there, the
    compiled kernel on a CPU."""
    found = ["torch"]
    if stats_paths.triton_runs_on(device):
        found.append("triton")
    if device.type == "cpu":
        from tensorlens.stats import native

        if native.available():
            found.append("native")
    return found


# ------------------------------------------------------------------------------------ 1. exactness


def exactness(device: torch.device, paths: list[str]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(n, generator=g) * s
        for n, s in ((0, 1), (1, 1), (7, 3), (2048, 1), (70_001, 0.02), (3_000_001, 1e-3))
    ]
    tensors[2][3] = math.nan
    tensors[4][5] = math.inf
    tensors += [
        torch.randn(4096, generator=g).to(torch.bfloat16),
        torch.randn(5000, generator=g).half(),
        torch.randn(100_000, generator=g, dtype=torch.float64),
        torch.relu(torch.randn(1024, 768, generator=g)),
    ]
    stats = (
        "min",
        "max",
        "mean",
        "std",
        "l1",
        "l2",
        "rms",
        "abs_min",
        "abs_std",
        "zero_fraction",
        "nan_count",
        "inf_count",
    )
    jobs = [TensorJob(f"t/{i}", [t.to(device)], stats, HistogramConfig(bins=64)) for i, t in enumerate(tensors)]
    jobs.append(TensorJob("fixed", [tensors[-1].to(device)], ("mean",), HistogramConfig(bins=16, range=(0.0, 1.0))))
    records = {}
    for chosen in paths:
        with stats_path(chosen):
            engine = StepStatistics(sync_free=True)
            records[chosen] = host_record(engine.compute(jobs))
            on = engine._plan.path
        records[chosen + ":plan"] = on
    reference = records["torch"]
    out: dict[str, Any] = {"tensors": len(jobs)}
    for chosen in paths:
        if chosen == "torch":
            continue
        found = records[chosen]
        a, b = found.scalar_values, reference.scalar_values
        finite = np.isfinite(a) & np.isfinite(b)
        relative = (
            float((np.abs(a[finite] - b[finite]) / np.maximum(np.abs(b[finite]), 1e-30)).max()) if finite.any() else 0.0
        )
        nonfinite_equal = bool(
            (np.isfinite(a) == np.isfinite(b)).all() and np.array_equal(a[~finite], b[~finite], equal_nan=True)
        )
        exact = ("nan_count", "inf_count", "numel", "min", "max")
        counts_equal = all(
            (found.scalar(t, s) == reference.scalar(t, s))
            or (math.isnan(found.scalar(t, s)) and math.isnan(reference.scalar(t, s)))
            for t, s in found.scalar_names
            if s in exact
        )
        histograms_equal = all(
            h.tensor == r.tensor and (h.counts == r.counts).all() and (h.edges == r.edges).all()
            for h, r in zip(found.histograms, reference.histograms, strict=True)
        )
        out[chosen] = {
            "plan_path": records[chosen + ":plan"],
            "max_relative_difference": relative,
            "nonfinite_equal": nonfinite_equal,
            "counts_min_max_equal": bool(counts_equal),
            "histograms_equal": bool(histograms_equal),
        }
    return out


# ------------------------------------------------------------------------------------ the model


def gpt2(device: torch.device, dry_run: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64) if dry_run else GPT2Config()
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(device)


class Variant:
    """One measured configuration: its own model, optimizer and (for tensorlens) hook."""

    def __init__(
        self, name: str, base: torch.nn.Module, collections: tuple[str, ...] | None, chosen: str | None, out_dir: str
    ) -> None:
        self.name, self.chosen, self.collections = name, chosen, collections
        self.model = copy.deepcopy(base)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.hook: tl.Hook | None = None
        self.out_dir = out_dir
        self.times: list[float] = []

    def attach(self) -> None:
        """The hook, made right before the variant's own first step (a hook follows the first
        optimizer that steps after it is created)."""
        if self.collections is not None:
            with stats_path(self.chosen):
                self.hook = tl.watch(
                    self.model,
                    collections=list(self.collections),
                    save_interval=1,
                    histograms=tl.HistogramConfig(bins=64),
                    backends=["local"],
                    out_dir=os.path.join(self.out_dir, self.name.replace("[", "-").replace("]", "")),
                )

    def step(self, batch: torch.Tensor, device: torch.device) -> None:
        with stats_path(self.chosen):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = self.model(input_ids=batch).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), batch.reshape(-1)
                )
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def settle(self) -> None:
        if self.hook is not None:
            self.hook.flush()

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()
        del self.model, self.optimizer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_batch(
    base: torch.nn.Module, device: torch.device, seq: int, vocab: int, dry_run: bool, tmp: str, chosen: str
) -> tuple[int, list[dict[str, Any]]]:
    """The largest batch whose recorded step (activations on) peaks under 85 % of the GPU's memory
    with room for the other variants' models (``len(VARIANTS)`` copies of weights and Adam state)."""
    if device.type != "cuda" or dry_run:
        return 2, []
    total = torch.cuda.get_device_properties(device).total_memory
    parameters = sum(p.numel() for p in base.parameters())
    others = 7 * parameters * 16  # fp32 weights, gradients and two Adam moments of every other variant
    tried = []
    for batch in (64, 48, 32, 24, 16, 12, 8, 4, 2, 1):
        variant = Variant("probe", base, FULL, chosen, tmp)
        try:
            variant.attach()
            torch.cuda.reset_peak_memory_stats(device)
            tokens = torch.randint(0, vocab, (batch, seq), device=device)
            for _ in range(2):
                variant.step(tokens, device)
            _sync(device)
            peak = torch.cuda.max_memory_allocated(device)
            fits = peak + others < 0.85 * total
            tried.append({"batch": batch, "peak_gib": peak / 2**30, "fits": fits})
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            if "out of memory" not in str(err).lower():
                raise
            tried.append({"batch": batch, "peak_gib": None, "fits": False})
            fits = False
        finally:
            with contextlib.suppress(Exception):  # a step cut short by OOM may leave the hook half done
                variant.close()
            del variant
            gc.collect()
            torch.cuda.empty_cache()
        if fits:
            return batch, tried
    return 1, tried


# ------------------------------------------------------------------------------------ 2. syncs


def sync_check(
    base: torch.nn.Module,
    device: torch.device,
    seq: int,
    vocab: int,
    batch: int,
    paths: list[str],
    tmp: str,
    dry_run: bool = False,
) -> dict[str, Any]:
    """A saved step under set_sync_debug_mode("error"), its one copy to the host excepted; and the
    syncs of a saved step counted under "warn" against the plain loop's."""
    if device.type != "cuda" and not dry_run:
        return {"skipped": "not a CUDA device"}
    cuda = device.type == "cuda"  # a dry run on a CPU goes through the same steps, the modes left alone

    def set_mode(mode: str | int) -> None:
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)

    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    out: dict[str, Any] = {}
    original = StepStatistics._to_host
    copies = {"n": 0}

    def allowed_copy(self: StepStatistics, tensor: torch.Tensor):  # noqa: ANN202 - the step's one copy, allowed
        copies["n"] += 1
        mode = torch.cuda.get_sync_debug_mode() if cuda else 0
        set_mode(0)
        try:
            return original(self, tensor)
        finally:
            set_mode(mode)

    for name, collections, chosen in [("plain", None, None)] + [(f"full[{p}]", FULL, p) for p in paths]:
        variant = Variant(f"sync-{name}", base, collections, chosen, tmp)
        variant.attach()
        try:
            for _ in range(2):  # plans built, kernels compiled
                variant.step(tokens, device)
            variant.settle()
            _sync(device)
            StepStatistics._to_host = allowed_copy
            copies["n"] = 0
            result: dict[str, Any] = {}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    set_mode("error")
                    variant.step(tokens, device)
                    result["error_mode"] = "no sync"
                except RuntimeError as err:
                    result["error_mode"] = f"synced: {str(err).splitlines()[0]}"
                    result["where"] = traceback.format_exc()[-1500:]
                finally:
                    set_mode(0)
            # tensorlens never lets a failed statistic take the step down: a sync it caught is a warning
            caught_by_tensorlens = [str(w.message)[:300] for w in caught if str(w.message).startswith("tensorlens")]
            result["tensorlens_warnings"] = caught_by_tensorlens
            if result["error_mode"] == "no sync" and any("synchroniz" in m for m in caught_by_tensorlens):
                result["error_mode"] = "synced (caught by tensorlens: see tensorlens_warnings)"
            result["copies_in_step"] = copies["n"]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                set_mode("warn")
                try:
                    variant.step(tokens, device)
                except Exception as err:
                    result["warn_mode_error"] = f"{type(err).__name__}: {str(err)[:300]}"
                finally:
                    set_mode(0)
            result["syncs_counted_under_warn"] = sum("synchroniz" in str(w.message) for w in caught)
            out[name] = result
        finally:
            StepStatistics._to_host = original
            with contextlib.suppress(Exception):
                variant.close()
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------ 3. overhead


def overhead(
    base: torch.nn.Module,
    device: torch.device,
    seq: int,
    vocab: int,
    batch: int,
    paths: list[str],
    budget_s: float,
    block: int,
    warmup: int,
    tmp: str,
    min_rounds: int,
    on_round: Any = None,
) -> dict[str, Any]:
    """The interleaved rounds; ``on_round(summary)`` after each (a run stopped halfway keeps them)."""
    specs = [("baseline", None, None), ("baseline_control", None, None)]
    specs += [(f"weights_grads[{p}]", PARAMETERS, p) for p in paths]
    specs += [(f"full[{p}]", FULL, p) for p in paths]
    variants = [Variant(name, base, collections, chosen, tmp) for name, collections, chosen in specs]
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(4)]
    for v in variants:  # each hook is made right before its own warm-up
        v.attach()
        for k in range(warmup):
            v.step(batches[k % len(batches)], device)
        v.settle()
    _sync(device)
    start, rounds = time.perf_counter(), 0
    per_round: list[dict[str, float]] = []
    while rounds < min_rounds or time.perf_counter() - start < budget_s:
        order = variants[rounds % len(variants) :] + variants[: rounds % len(variants)]
        times = {}
        for v in order:
            _sync(device)
            t0 = time.perf_counter()
            for k in range(block):
                v.step(batches[k % len(batches)], device)
            _sync(device)
            v.settle()
            times[v.name] = (time.perf_counter() - t0) / block
        per_round.append(times)
        rounds += 1
        if on_round is not None:
            on_round(_summary(per_round, [v.name for v in variants], block, batch, seq))
    for v in variants:
        v.close()
    return _summary(per_round, [v.name for v in variants], block, batch, seq)


def _summary(per_round: list[dict[str, float]], names: list[str], block: int, batch: int, seq: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rounds": len(per_round), "block": block, "batch": batch, "seq": seq, "variants": {}}
    for name in names:
        ratios = [r[name] / r["baseline"] for r in per_round]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        result["variants"][name] = {
            "median_ratio": statistics.median(ratios),
            "mean_ratio": statistics.fmean(ratios),
            "round_iqr": [quartiles[0], quartiles[2]],
            "median_step_ms": 1000 * statistics.median(r[name] for r in per_round),
        }
    return result


# ------------------------------------------------------------------------------------ main


def environment(device: torch.device) -> dict[str, Any]:
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensorlens": tl.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
        found["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    with contextlib.suppress(Exception):
        import triton

        found["triton"] = triton.__version__
    with contextlib.suppress(Exception):
        import transformers

        found["transformers"] = transformers.__version__
    return found


def table(results: dict[str, Any]) -> list[str]:
    lines = [f"{k}: {v}" for k, v in results["environment"].items()]
    lines.append(f"exactness on the device: {json.dumps(results.get('exactness'))}")
    lines.append(
        f"syncs: {json.dumps({k: {f: v for f, v in r.items() if f != 'where'} if isinstance(r, dict) else r for k, r in results.get('syncs', {}).items()})}"
    )
    timing = results.get("overhead")
    if timing:
        lines.append(
            f"GPT-2 124M, bf16 autocast, batch {timing['batch']} x {timing['seq']}, {timing['rounds']} rounds of "
            f"{timing['block']} steps (median of per-round ratios to the plain loop; round IQR)"
        )
        for name, v in timing["variants"].items():
            lines.append(
                f"  {name:<24} {v['median_ratio']:.3f}x  (mean {v['mean_ratio']:.3f}x, IQR {v['round_iqr'][0]:.3f}-"
                f"{v['round_iqr'][1]:.3f}x)  {v['median_step_ms']:.1f} ms/step"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for gpu.json and gpu.txt")
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds of interleaved rounds (after warm-up)")
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-rounds", type=int, default=3)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=0, help="0: the largest that fits (probed)")
    p.add_argument(
        "--dry-run", action="store_true", help="a tiny GPT-2 on the CPU: checks the script, measures nothing"
    )
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    seq = 32 if args.dry_run else args.seq
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(device), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    paths = gpu_paths(device)
    results["paths"] = paths

    def save() -> None:
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)
        with open(os.path.join(args.out, "gpu.txt"), "w") as f:
            f.write("\n".join(table(results)) + "\n")

    def run_part(part: str, run: Any) -> None:
        """One part, its failure recorded instead of ending the run; results saved after each."""
        t0 = time.perf_counter()
        try:
            results[part] = run()
        except Exception:
            results[part] = {"failed": traceback.format_exc()[-3000:]}
        results[f"{part}_s"] = time.perf_counter() - t0
        save()
        print(f"{part} ({results[f'{part}_s']:.0f} s): {json.dumps(results[part], default=str)[:1500]}", flush=True)

    def partial(summary: dict[str, Any]) -> None:
        results["overhead"] = {**summary, "partial": True}
        save()

    with tempfile.TemporaryDirectory(prefix="tensorlens-gpu-") as tmp:
        run_part("exactness", lambda: exactness(device, paths))
        base = gpt2(device, args.dry_run)
        vocab = base.config.vocab_size
        try:  # PyTorch ops: the larger peak
            batch, tried = (
                (args.batch, []) if args.batch else pick_batch(base, device, seq, vocab, args.dry_run, tmp, "torch")
            )
        except Exception:
            batch, tried = 8, [{"failed": traceback.format_exc()[-2000:]}]
        results["batch_probe"] = tried
        print(f"batch {batch} (probed: {tried})", flush=True)
        run_part("syncs", lambda: sync_check(base, device, seq, vocab, batch, paths, tmp, args.dry_run))
        run_part(
            "overhead",
            lambda: overhead(
                base,
                device,
                seq,
                vocab,
                batch,
                paths,
                2.0 if args.dry_run else args.budget_s,
                1 if args.dry_run else args.block,
                1 if args.dry_run else args.warmup,
                tmp,
                1 if args.dry_run else args.min_rounds,
                on_round=partial,
            ),
        )
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
