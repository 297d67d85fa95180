"""What ``tl.explain`` costs on a large stored run, next to reading the run once with ``Run.records()``.

Run it from the repository root::

    python benchmarks/explain_scale.py                              # 1,000 tensors x 500 steps
    python benchmarks/explain_scale.py --tensors 5000 --steps 2000
    python benchmarks/explain_scale.py --store /tmp/big --keep      # build once, time again later

Method: the synthetic healthy run of ``benchmarks/read_scale.py`` (default statistics for every
tensor, a histogram for every second one, a falling loss). Three timings, interleaved over
``--rounds`` rounds, medians reported: ``explain(run)`` (no event in a healthy run, so it reads
every step's scalars row and stops at the end), ``explain(run, at_step=<middle>)`` (reads only the
``window + lookback + 1`` saved steps before it) and one pass of ``Run.records()`` (every step's
scalars and histograms: what the rules, the report and compare read). A shared machine's noise moves
the numbers by tens of percent: compare within one run of this script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from read_scale import build  # noqa: E402

import tensorlens as tl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", default=None, help="folder of the synthetic run (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the store (and reuse it if it exists)")
    args = parser.parse_args()
    folder = args.store or tempfile.mkdtemp(prefix="tl_explain_")
    if not os.path.exists(os.path.join(folder, "tensorlens.sqlite")):
        print(f"built in {build(folder, args.tensors, args.steps):.1f} s: {folder}", file=sys.stderr)
    middle = args.steps // 2

    def whole() -> None:
        result = tl.explain(folder)
        assert result.event is None, result.message

    def at_step() -> None:
        assert tl.explain(folder, at_step=middle).event.step == middle

    def records() -> None:
        with tl.open_run(folder) as run:
            for _ in run.records():
                pass

    timings: dict[str, list[float]] = {"explain(run)": [], f"explain(run, at_step={middle})": [], "Run.records()": []}
    try:
        for _ in range(args.rounds):
            for name, fn in zip(timings, (whole, at_step, records), strict=True):
                started = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - started)
    finally:
        if not args.keep and args.store is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.tensors} tensors x {args.steps} steps, median of {args.rounds} rounds")
    for name, values in timings.items():
        print(f"  {name:32s} {statistics.median(values):8.3f} s")


if __name__ == "__main__":
    main()
