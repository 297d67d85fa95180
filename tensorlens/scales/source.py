"""Per-op scales over a whole run: :class:`ScaleSource` drives a :class:`ScaleCapture` at the saved
steps of the ``scales`` collection and hands the step's metrics to the recorder.

The Hook starts the capture in its root forward pre-hook and stops it in the forward post-hook
(only on steps that save ``scales``: unsaved steps run the plain model), and the recorder asks
:meth:`ScaleSource.step_scalars` for the metrics when the train step ends, after backward. They
are recorded as ``scales/fwd/<node>`` and ``scales/bwd/<node>`` with unit_scaling's metric names
(``mean_abs``, ``abs_mean``, ``std``, ``abs_max``, ``abs_min``, ``numel``: note that there
``abs_mean`` is ``|mean(x)|`` and ``std`` has Bessel's correction, see docs/scales.md). Every
``plot_interval`` saved steps the log2 plot is drawn off the training thread into
``<run_dir>/scales/step-<step>.png``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tensorlens.records import ScalarEntry
from tensorlens.scales.capture import ScaleCapture
from tensorlens.scales.metrics import METRIC_NAMES
from tensorlens.scales.trace import paused

COLLECTION = "scales"


class ScaleSource:
    """The scales of the watched roots as a recorder source (no parameters, no module captures:
    the Hook starts and stops the op recording around the root's forward).

    >>> source = ScaleSource(run_dir="runs/exp1", plot_interval=10)   # doctest: +SKIP
    """

    def __init__(self, run_dir: str, plot_interval: int | None = None) -> None:
        self.capture = ScaleCapture(parameters=False)
        self.run_dir = run_dir
        self.plot_interval = plot_interval
        self._saved = 0
        self._plots: list[threading.Thread] = []
        self.plot_paths: list[str] = []

    # the TensorSource protocol: nothing of its own to read or attach
    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def attach(self, collections: list[Any]) -> None:
        pass

    def detach(self) -> None:
        pass

    def end_step(self) -> None:  # no module hooks to keep idle (see SourceHooks)
        pass

    def resume(self) -> None:
        pass

    @staticmethod
    def paused() -> Any:
        """A context in which tensorlens's own tensor work is not recorded as ops of the model."""
        return paused()

    def start(self, roots: Sequence[tuple[str, nn.Module]], root: nn.Module, args: Any, kwargs: Any) -> None:
        self.capture.start(list(roots), root=root, args=args, kwargs=kwargs)

    def stop(self, output: Any) -> None:
        self.capture.stop(output)

    def arm(self) -> None:
        self.capture.arm()

    def step_scalars(self, saving: frozenset[str], step: int) -> list[ScalarEntry]:
        """The step's metrics as scalars (one host copy of the ``[nodes, 6]`` table), after backward."""
        if COLLECTION not in saving and not self.capture.capturing:
            return []
        scale_step = self.capture.collect_step()
        if not scale_step.keys or COLLECTION not in saving:
            return []
        host = scale_step.table.detach().to(torch.float64).cpu().numpy()
        entries = [
            ScalarEntry(key, stat, float(host[i, j]))
            for i, key in enumerate(scale_step.keys)
            for j, stat in enumerate(METRIC_NAMES)
        ]
        self._saved += 1
        if self.plot_interval and (self._saved - 1) % self.plot_interval == 0:
            self._plot(scale_step, host, step)
        return entries

    def _plot(self, scale_step: Any, host: Any, step: int) -> None:
        path = os.path.join(self.run_dir, "scales", f"step-{step:09d}.png")

        def draw() -> None:
            try:
                from tensorlens.scales.plot import render_scales_png
                from tensorlens.scales.prune import prune_non_float_tensors, prune_same_scale_tensors

                graph = prune_same_scale_tensors(prune_non_float_tensors(scale_step.graph(host)))
                png = render_scales_png(graph)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(png)
                self.plot_paths.append(path)
            except ImportError:
                pass  # no matplotlib: the metrics are recorded, the picture is not
            except Exception:
                pass  # a picture must never cost training anything

        thread = threading.Thread(target=draw, name="tensorlens-scales-plot", daemon=True)
        thread.start()
        self._plots.append(thread)

    def close(self, timeout: float = 30.0) -> None:
        self.capture.close()
        for thread in self._plots:
            thread.join(timeout)
