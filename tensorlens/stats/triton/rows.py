"""The fused Triton statistics path, host side: which tensors it takes, how they are laid out in
launches (planned once per set of sizes), and the calls that fill partial rows and histograms on
the device without the host waiting for it.

Layout. A tensor of up to :data:`CHUNK` values is one *item*; a larger one is cut into items of
:data:`CHUNK` values, each read by its own program (so a 124M-value gradient spreads over the GPU)
and merged in order afterwards. Items are launched by size class (:data:`CLASSES`): up to 16
values, 256 items share a program as a 256 x 16 tile; up to 64, 64 of them; up to 512, 8; larger
ones alone, 4096 values at a time. So 10,000 tiny tensors take a few dozen programs, not 10,000.

Addresses, not a buffer. Each launch reads a table of ``int64`` data pointers (one per item), made
on the host at every step and copied to the device from pinned memory without blocking (only when
the addresses changed: parameters and gradients usually stay put, activations move); the sizes,
classes and merge order are built once. Concatenating the tensors into one
buffer first (what the PyTorch path does for small ones) would write every value once more: the
table costs 8 bytes per item. Triton's interpreter (``TRITON_INTERPRET=1``) reads such addresses
on a CPU too (its loads are raw memory reads), which is how the path is tested without a GPU; it
cannot follow them into GPU memory, so under the interpreter only CPU tensors take this path.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tensorlens.stats import registry
from tensorlens.stats.torch_rows import to_device

PARTIALS = tuple(column.name for column in registry.COLUMNS)
COL = {name: i for i, name in enumerate(PARTIALS)}

#: The columns the kernels compute; a tensor that needs another one (a median, which needs a sort;
#: the product, whose custom reduction Triton's interpreter runs element by element; a column
#: declared with its own ``compute``) takes the PyTorch path, as with the compiled CPU kernel.
TRITON_COLUMNS = frozenset(
    {
        "count",
        "sum",
        "sumsq",
        "m2",
        "l1",
        "min",
        "max",
        "abs_min",
        "abs_m2",
        "nan_count",
        "inf_count",
        "zero_count",
    }
)
#: The dtypes the kernels read as they are (others fall back to PyTorch ops, see :func:`triton_reads`).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: Values per item of a large tensor: one program reads them, 4096 at a time.
CHUNK = 1 << 16
#: (longest item, items per program, values per row of the tile): small items share a program.
CLASSES = ((16, 256, 16), (64, 64, 64), (512, 8, 512), (CHUNK, 1, 4096))
#: Under Triton's interpreter every op costs Python time whatever its size, so large items are read
#: in tiles of 16384 values (4x fewer steps); the kernel's code is the same.
INTERPRETED_TILE = 16384
#: Tensors per program when items are merged into rows.
MERGE_ROWS = 512
_ABS = frozenset({"l1", "abs_min", "abs_m2"})


def _kernels() -> Any:
    from tensorlens.stats.triton import kernels  # triton itself: imported on first use only

    return kernels


def _triton_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {
        torch.float32: tl.float32,
        torch.float64: tl.float64,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
    }[dtype]


def _accumulator(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _tile(size_class: int) -> tuple[int, int]:
    """(items per program, values per row of the tile) of a size class."""
    _, per_program, cols = CLASSES[size_class]
    if per_program == 1 and os.environ.get("TRITON_INTERPRET") == "1":
        return 1, INTERPRETED_TILE
    return per_program, cols


@contextlib.contextmanager
def _quiet(device: torch.device) -> Iterator[None]:
    """Around a launch: Triton launches on the current CUDA device, so ``device`` is made current
    (a rank's tensors on ``cuda:1``); and Triton's interpreter computes with numpy, which warns
    where IEEE arithmetic gives NaN (``inf - inf``: numpy's own statistics of such a tensor are NaN
    too), where a GPU does not."""
    with np.errstate(all="ignore"), torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        yield


def _size_class(length: int) -> int:
    return next(k for k, (longest, _, _) in enumerate(CLASSES) if length <= longest)


def _pointer_table(addresses: np.ndarray, device: torch.device) -> torch.Tensor:
    """``int64`` addresses on ``device`` without the host waiting (see :func:`to_device`)."""
    host = torch.from_numpy(addresses)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class TritonRows:
    """Partial rows ``[len(numels), len(PARTIALS)]`` (float64, on ``device``) of flat tensors of the
    given sizes and dtypes (each one of :data:`DTYPES`, contiguous); ``columns[i]`` names the
    columns tensor ``i`` needs (a subset of :data:`TRITON_COLUMNS`), the others are NaN, as on the
    other paths. Two passes of launches: the items, then their merge; nothing read back.

    >>> rows = TritonRows([3], [torch.float32], [frozenset({"sum"})], torch.device("cpu"))  # doctest: +SKIP
    >>> rows.run([torch.ones(3)])[0, COL["sum"]]                                              # doctest: +SKIP
    """

    def __init__(
        self, numels: list[int], dtypes: list[torch.dtype], columns: list[frozenset[str]], device: torch.device
    ) -> None:
        self.k = len(numels)
        self.device = device
        launches: dict[tuple[torch.dtype, int], list[int]] = {}
        for i, n in enumerate(numels):
            launches.setdefault((dtypes[i], _size_class(min(n, CHUNK))), []).append(i)
        self.launches: list[
            tuple[torch.dtype, int, int, int, tuple[bool, bool]]
        ] = []  # dtype, class, first, count, wants
        item_tensor, item_offset, item_length = [], [], []
        first, count = [0] * self.k, [0] * self.k
        for (dtype, size_class), members in launches.items():
            start = len(item_tensor)
            for i in members:
                n = numels[i]
                pieces = max(1, -(-n // CHUNK))
                first[i], count[i] = len(item_tensor), pieces
                for p in range(pieces):
                    item_tensor.append(i)
                    item_offset.append(p * CHUNK * torch.empty((), dtype=dtype).element_size())
                    item_length.append(min(CHUNK, n - p * CHUNK))
            union = frozenset().union(*(columns[i] for i in members))
            wants = (bool(union & _ABS), "zero_count" in union)
            self.launches.append((dtype, size_class, start, len(item_tensor) - start, wants))
        self.n_items = len(item_tensor)
        self.item_tensor = np.array(item_tensor, dtype=np.intp)
        self.item_offset = np.array(item_offset, dtype=np.int64)
        self.lengths = to_device(item_length, torch.int64, device)
        self.first = to_device(first, torch.int64, device)
        self.count = to_device(count, torch.int64, device)
        mask = [[name in columns[i] or name in registry.ALWAYS_COMPUTED for name in PARTIALS] for i in range(self.k)]
        self.unrequested = ~to_device(mask, torch.bool, device) if self.k else None
        self._addresses: np.ndarray | None = None
        self._table: torch.Tensor | None = None
        self._value_bytes = sum(
            n * torch.empty((), dtype=d).element_size() for n, d in zip(numels, dtypes, strict=True)
        )

    def traffic(self) -> dict[str, int]:
        """Bytes a :meth:`run` moves through device memory, by the kernels' own loads and stores:
        ``values`` read once each; ``other_read`` (address and length tables, the items re-read by
        the merge, the rows by the mask) and ``written`` (items, rows) are per tensor or per item of
        :data:`CHUNK` values, never per value (``benchmarks/traffic.py``)."""
        p, items = len(PARTIALS), self.n_items
        return {
            "values": self._value_bytes,
            "other_read": items * 16 + items * 11 * 8 + self.k * 16 + self.k * p * (8 + 1),
            "written": items * 11 * 8 + self.k * p * 8 * 2,
        }

    def addresses(self, values: list[torch.Tensor]) -> np.ndarray:
        """Every item's address: its tensor's data pointer plus the item's offset."""
        bases = np.fromiter((v.data_ptr() for v in values), dtype=np.int64, count=self.k)
        return bases[self.item_tensor] + self.item_offset

    def run(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The rows of ``values`` (flat or not, contiguous, in the sizes and dtypes planned)."""
        rows = torch.empty((self.k, len(PARTIALS)), dtype=torch.float64, device=self.device)
        if not self.k:
            return rows
        kernels = _kernels()
        addresses = self.addresses(values)
        if self._table is None or not np.array_equal(addresses, self._addresses):
            # parameters and their gradients usually stay where they are: their table is copied once
            self._addresses, self._table = addresses, _pointer_table(addresses, self.device)
        table = self._table
        with _quiet(self.device):
            self._launch(kernels, table, rows)
        return rows.masked_fill_(self.unrequested, math.nan)

    def _launch(self, kernels: Any, table: torch.Tensor, rows: torch.Tensor) -> None:
        items = torch.empty((self.n_items, kernels.N_ITEM), dtype=torch.float64, device=self.device)
        for dtype, size_class, start, n, (want_abs, want_zeros) in self.launches:
            per_program, cols = _tile(size_class)
            kernels.item_partials[(-(-n // per_program),)](
                table[start:],
                self.lengths[start:],
                items[start:],
                n,
                ROWS=per_program,
                COLS=cols,
                DTYPE=_triton_dtype(dtype),
                ACC=_accumulator(dtype),
                WANT_ABS=want_abs,
                WANT_ZEROS=want_zeros,
            )
        kernels.merge_items[(-(-self.k // MERGE_ROWS),)](
            items,
            self.first,
            self.count,
            rows,
            self.k,
            P=len(PARTIALS),
            C_COUNT=COL["count"],
            C_SUM=COL["sum"],
            C_SUMSQ=COL["sumsq"],
            C_M2=COL["m2"],
            C_L1=COL["l1"],
            C_MIN=COL["min"],
            C_MAX=COL["max"],
            C_ABS_MIN=COL["abs_min"],
            C_ABS_M2=COL["abs_m2"],
            C_NAN=COL["nan_count"],
            C_INF=COL["inf_count"],
            C_ZERO=COL["zero_count"],
            ROWS=MERGE_ROWS,
        )


class SampleTable:
    """The histogram samples of a group: every ``strides[g]``-th value of flat tensor ``g``
    (``lengths[g]`` of them), read in place by the range and binning kernels."""

    def __init__(self, numels: list[int], strides: list[int], dtypes: list[torch.dtype], device: torch.device) -> None:
        self.g = len(numels)
        self.device = device
        lengths = [-(-n // s) if n else 0 for n, s in zip(numels, strides, strict=True)]
        by_class: dict[tuple[torch.dtype, int], list[int]] = {}
        for g, length in enumerate(lengths):
            by_class.setdefault((dtypes[g], _size_class(min(length, CHUNK))), []).append(g)
        self.launches = [(dtype, size_class, members) for (dtype, size_class), members in by_class.items()]
        self.order = np.array([g for _, _, members in self.launches for g in members], dtype=np.intp)
        self.at = to_device(self.order.tolist(), torch.int64, device)  # launch order -> group order
        self.inverse = to_device(np.argsort(self.order).tolist(), torch.int64, device)
        self.strides = to_device([strides[g] for g in self.order], torch.int64, device)
        self.lengths = to_device([lengths[g] for g in self.order], torch.int64, device)

    def _launches(self, values: list[torch.Tensor]):  # noqa: ANN202 - (table, first, count, dtype, class)
        table = _pointer_table(
            np.fromiter((values[g].data_ptr() for g in self.order), dtype=np.int64, count=self.g), self.device
        )
        first = 0
        for dtype, size_class, members in self.launches:
            yield table, first, len(members), dtype, size_class
            first += len(members)

    def finite_ranges(self, values: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(low, high)`` ``[G]`` (float64): each sample's finite range in ``dtype`` (``+inf``/``-inf``
        where it has no finite value), as :func:`~tensorlens.stats.torch_rows.finite_range_rows`."""
        kernels = _kernels()
        low = torch.empty(self.g, dtype=torch.float64, device=self.device)
        high = torch.empty(self.g, dtype=torch.float64, device=self.device)
        for table, first, n, source, size_class in self._launches(values):
            per_program, cols = _tile(size_class)
            with _quiet(self.device):
                kernels.sample_ranges[(-(-n // per_program),)](
                    table[first:],
                    self.strides[first:],
                    self.lengths[first:],
                    low[first:],
                    high[first:],
                    n,
                    ROWS=per_program,
                    COLS=cols,
                    DTYPE=_triton_dtype(source),
                    ACC=_accumulator(dtype),
                )
        return low[self.inverse], high[self.inverse]

    def counts(
        self,
        values: list[torch.Tensor],
        low: torch.Tensor,
        high: torch.Tensor,
        scale: torch.Tensor,
        bins: int,
        clip: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(counts [G, bins], below [G], above [G])`` (int64) of the samples binned over
        ``[low, high]`` with ``scale`` (all ``[G]`` in the binned dtype, on the device)."""
        kernels = _kernels()
        dtype = low.dtype
        counts = torch.zeros((self.g, bins), dtype=torch.int64, device=self.device)
        below = torch.empty(self.g, dtype=torch.int64, device=self.device)
        above = torch.empty(self.g, dtype=torch.int64, device=self.device)
        ordered = [t[self.at].contiguous() for t in (low, high, scale)]
        for table, first, n, source, size_class in self._launches(values):
            per_program, cols = _tile(size_class)
            with _quiet(self.device):
                kernels.bin_samples[(-(-n // per_program),)](
                    table[first:],
                    self.strides[first:],
                    self.lengths[first:],
                    ordered[0][first:],
                    ordered[1][first:],
                    ordered[2][first:],
                    counts[first:],
                    below[first:],
                    above[first:],
                    n,
                    BINS=bins,
                    CLIP=clip,
                    ROWS=per_program,
                    COLS=cols,
                    DTYPE=_triton_dtype(source),
                    ACC=_accumulator(dtype),
                )
        return counts[self.inverse], below[self.inverse], above[self.inverse]


def triton_reads(pieces: list[Any], name: str) -> bool:
    """Whether a job's values go to the Triton kernels: its tensors are floating point of a dtype
    they read (after conversion to the compute dtype, as the plan does, or as they are in a hook).
    Another dtype (integers, bool, complex, float8) takes PyTorch ops, with one warning per dtype."""
    from tensorlens.stats.path import warn_once

    for piece in pieces:
        if piece.dtype not in DTYPES:
            warn_once(
                f"dtype:{piece.dtype}",
                f"the Triton statistics kernels read {', '.join(str(d).removeprefix('torch.') for d in DTYPES)} "
                f"tensors: {name!r} ({str(piece.dtype).removeprefix('torch.')}) and any other "
                "tensor of that dtype use PyTorch ops",
            )
            return False
    return True


@functools.lru_cache(maxsize=512)  # one per captured module size and dtype
def _one(numel: int, dtype: torch.dtype, device: torch.device, columns: frozenset[str]) -> TritonRows:
    return TritonRows([numel], [dtype], [columns], device)


def one_row(values: torch.Tensor, columns: frozenset[str]) -> torch.Tensor:
    """The partial row ``[len(PARTIALS)]`` of one contiguous tensor of :data:`DTYPES`, read as it
    is (a bfloat16 activation in its hook: no float32 copy), on its device."""
    return _one(values.numel(), values.dtype, values.device, columns).run([values])[0]
