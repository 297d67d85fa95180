"""Small models for the scale tests, and the float64 references the recorded metrics are checked against."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

METRICS = ("mean_abs", "abs_mean", "std", "abs_max", "abs_min", "numel")


def numpy_metrics(t: torch.Tensor) -> dict[str, float]:
    """unit_scaling's metrics of ``t`` in numpy float64 (``std`` with Bessel's correction, as ``Tensor.std``)."""
    a = t.detach().to(torch.float64).cpu().numpy().ravel()
    if a.size == 0:
        return dict.fromkeys(METRICS[:-1], math.nan) | {"numel": 0}
    with np.errstate(all="ignore"):
        return {
            "mean_abs": float(np.abs(a).mean()),
            "abs_mean": float(abs(a.mean())),
            "std": float(a.std(ddof=1)) if a.size > 1 else math.nan,
            "abs_max": float(np.abs(a).max()),
            "abs_min": float(np.abs(a).min()),
            "numel": int(a.size),
        }


def assert_data_close(data, expected: dict[str, float], rtol: float = 1e-10, where: str = "") -> None:
    """A ``Metrics.Data`` equals ``expected`` within ``rtol`` (NaN equals NaN)."""
    assert data is not None, f"{where}: no metrics"
    for name in METRICS:
        got, want = getattr(data, name), expected[name]
        if name == "numel":
            assert got == want and isinstance(got, int), f"{where} numel: {got} != {want}"
        elif math.isnan(want):
            assert math.isnan(got), f"{where} {name}: {got} is not NaN"
        else:
            assert math.isclose(got, want, rel_tol=rtol, abs_tol=1e-300), f"{where} {name}: {got} != {want}"


class FunctionalMLP(nn.Module):
    """Modules and functional ops: F.gelu, x * y, operator +, torch.matmul, a reshape."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        gate = torch.sigmoid(h)
        h = self.norm(h * gate) + h
        h = h.reshape(-1, h.shape[-1])
        return torch.matmul(h, self.fc2.weight.t()) + self.fc2.bias

    def reference(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The same forward written out, every intermediate kept with ``retain_grad``: name -> tensor."""
        t: dict[str, torch.Tensor] = {}
        t["fc1.linear"] = F.linear(x, self.fc1.weight, self.fc1.bias)
        t["gelu"] = F.gelu(t["fc1.linear"])
        t["sigmoid"] = torch.sigmoid(t["gelu"])
        t["mul"] = t["gelu"] * t["sigmoid"]
        t["norm.layer_norm"] = F.layer_norm(t["mul"], (16,), self.norm.weight, self.norm.bias)
        t["add"] = t["norm.layer_norm"] + t["gelu"]
        t["reshape"] = t["add"].reshape(-1, 16)
        t["t"] = self.fc2.weight.t()
        t["matmul"] = torch.matmul(t["reshape"], t["t"])
        t["add_1"] = t["matmul"] + self.fc2.bias
        for v in t.values():
            v.retain_grad()
        return t, t["add_1"]


class Block(nn.Module):
    """A pre-norm transformer block written out: qkv, heads, softmax attention, MLP, residuals."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Embedding, ``layers`` blocks, a head: the names read ``layers.0.fc1.linear``."""

    def __init__(self, layers: int = 2, d: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class InPlaceNet(nn.Module):
    """In-place ops as ResNets write them: ``out += identity``, ``mul_``, ``x[i] = v``, ReLU(inplace=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.fc1(x))
        out += x
        out.mul_(0.5)
        out[:, 0] = 0.0
        return self.fc2(self.relu(out))

    def reference(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Out of place, each value the in-place version holds right after its op."""
        t: dict[str, torch.Tensor] = {}
        t["fc1.linear"] = F.linear(x, self.fc1.weight, self.fc1.bias)
        t["bn.batch_norm"] = F.batch_norm(t["fc1.linear"], None, None, self.bn.weight, self.bn.bias, training=True)
        t["add_"] = t["bn.batch_norm"] + x
        t["mul_"] = t["add_"] * 0.5
        t["setitem"] = torch.cat([torch.zeros_like(t["mul_"][:, :1]), t["mul_"][:, 1:]], dim=1)
        t["relu.relu"] = F.relu(t["setitem"])
        t["fc2.linear"] = F.linear(t["relu.relu"], self.fc2.weight, self.fc2.bias)
        for v in t.values():
            v.retain_grad()
        return t, t["fc2.linear"]


class BranchNet(nn.Module):
    """A data-dependent branch and an explicit graph break: dynamo splits the forward in pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if h.sum() > 0:
            h = h * 2.0
        else:
            h = h - 1.0
        h = torch.tanh(self.fc2(h))
        torch._dynamo.graph_break()
        return self.fc3(h)
