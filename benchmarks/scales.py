"""What per-op scale tracking costs: a plain training step, a saved step with ``ScaleCapture``, the
``track_scales`` snapshot, and drawing the plot.

Run it from the repository root::

    python benchmarks/scales.py                      # a 4-layer transformer LM, readable table
    python benchmarks/scales.py --layers 8 --width 256 --batch 16 --seq 128 --json

Method: the model is a small decoder-only LM written out op by op (embedding, pre-norm blocks with
qkv, heads, softmax attention, GELU MLP, residuals), so every op is a node. Each row is the median
of ``--repeats`` timed steps after ``--warmup`` untimed ones, on one thread unless ``--threads``
says otherwise (the machine may be shared: read medians, not single runs).

- ``plain step``: forward, backward, nothing recording. What unsaved steps cost with scales on,
  since nothing is instrumented outside a saved step.
- ``saved step``: the same step driven as the Hook drives it (``start`` in a root pre-hook,
  ``stop`` in the root hook, ``collect_table`` after backward) plus one host copy of all metrics.
- ``track_scales``: forward, backward and ``scales_graph()`` (one host copy, FX graph built).
- ``plot``: ``render_scales_png`` of the pruned graph.

Nothing asserts a time: this is a measuring tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tensorlens.scales as S  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        att = ((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, layers: int, d: int, vocab: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d, max(1, d // 32)) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), ids.flatten())


def _median_ms(step: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LM(args.layers, args.width)
    ids = torch.randint(0, 512, (args.batch, args.seq))
    capture = S.ScaleCapture()
    saving = {"on": False}

    def pre(module: nn.Module, a: tuple, kw: dict) -> None:
        if saving["on"]:
            capture.start(model, root=module, args=a, kwargs=kw)

    def post(module: nn.Module, a: tuple, kw: dict, out: object) -> None:
        if saving["on"]:
            capture.stop(out)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True, always_call=True)

    def plain() -> None:
        model(ids).backward()
        model.zero_grad()

    def saved() -> None:
        saving["on"] = True
        model(ids).backward()
        _, table = capture.collect_table()
        table.cpu()  # the engine's one host copy
        saving["on"] = False
        model.zero_grad()

    tracked = S.track_scales(model)

    def snapshot() -> None:
        tracked(ids).backward()
        tracked.scales_graph()
        model.zero_grad()

    rows = {
        "plain step": _median_ms(plain, args.warmup, args.repeats),
        "saved step (ScaleCapture)": _median_ms(saved, args.warmup, args.repeats),
        "track_scales + scales_graph": _median_ms(snapshot, args.warmup, args.repeats),
    }
    graph = S.prune_same_scale_tensors(S.prune_non_float_tensors(tracked.scales_graph()))
    nodes = sum(1 for n in tracked.scales_graph().nodes if "metrics" in n.meta)
    plotted = sum(1 for n in graph.nodes if "metrics" in n.meta)
    try:
        rows[f"plot ({plotted} nodes) to PNG"] = _median_ms(lambda: S.render_scales_png(graph), 1, 3)
    except ImportError:
        pass
    result = {"config": vars(args), "float_nodes": nodes, "plotted_nodes": plotted, "median_ms": rows,
              "torch": torch.__version__}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"LM: {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, "
          f"{nodes} float nodes, torch {torch.__version__}, {args.threads} thread(s)")
    for name, ms in rows.items():
        ratio = f"{ms / rows['plain step']:.2f}x" if "plot" not in name else ""
        print(f"  {name:34s} {ms:9.1f} ms  {ratio}")


if __name__ == "__main__":
    main()
