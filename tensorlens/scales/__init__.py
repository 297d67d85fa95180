"""Per-op scale tracking: the forward and backward scale of every op a model runs, as a
``torch.fx.Graph`` with unit_scaling's ``track_scales`` contract; pruning; the log2 plot against
low-precision formats; and ``ScaleCapture``, which records scales at the saved steps of a run."""

from tensorlens.scales.capture import ScaleCapture, ScaleStep
from tensorlens.scales.metrics import Metrics
from tensorlens.scales.plot import FormatRange, plot_scales, render_scales_png
from tensorlens.scales.prune import prune_non_float_tensors, prune_same_scale_tensors, prune_selected_nodes
from tensorlens.scales.trace import paused
from tensorlens.scales.track import ScaleTrackedModule, track_scales

__all__ = [
    "FormatRange",
    "Metrics",
    "ScaleCapture",
    "ScaleStep",
    "ScaleTrackedModule",
    "paused",
    "plot_scales",
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
    "render_scales_png",
    "track_scales",
]
