"""Where two step records differ: which scalar of one is which of the other, which histogram bins
and edges face each other, what one record holds alone, and :func:`compare_records` over them.

Run comparison (:mod:`tensorlens.analysis.compare`) and the ``SimilarAcrossRuns`` rule both compare
records, so this sits below both (the rules and the analysis packages do not import each other).

The alignment of two layouts is worked out once, then every pair of records with those layouts is
compared with a few numpy operations over whole arrays. A stored run's records share their
layout's name tuples (the reader parses each layout once), so a run of thousands of steps and
tensors pairs its layouts once, not at every step and tensor: per-tensor Python work at every step
is what made comparing a large store take minutes.
"""

from __future__ import annotations

import re
import threading
from typing import NamedTuple

import numpy as np

from tensorlens.records import StepRecord

#: The statistic name under which histogram counts and raw tensor values are compared.
HISTOGRAM, VALUE = "histogram", "value"
_QUANTILE = re.compile(r"^p\d+(\.\d+)?$")


class Difference(NamedTuple):
    """Two records disagree on ``stat`` of ``tensor`` (``""`` for a plain scalar)."""

    tensor: str
    stat: str
    a: float
    b: float
    index: int | None = None  # the first differing bin or element, for histograms and raw values


def close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Element-wise ``|a - b| <= atol + rtol * max(|a|, |b|)`` (symmetric, unlike numpy's
    ``isclose``); NaN equals NaN and an infinity equals the same infinity."""
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        near = np.abs(a - b) <= atol + rtol * np.maximum(np.abs(a), np.abs(b))
    return same | (near & np.isfinite(a) & np.isfinite(b))


def _spans(starts: list[int], lengths: list[int]) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + lengths[i] - 1`` of every span, concatenated."""
    if not lengths:
        return np.zeros(0, dtype=np.intp)
    lengths_a = np.asarray(lengths, dtype=np.intp)
    ends = np.cumsum(lengths_a)
    offsets = np.repeat(np.asarray(starts, dtype=np.intp) - (ends - lengths_a), lengths_a)
    return np.arange(int(ends[-1]), dtype=np.intp) + offsets


def _offsets(names: tuple[tuple[str, int], ...]) -> dict[str, tuple[int, int, int]]:
    """``tensor -> (counts offset, edges offset, bins)`` of a record's histograms."""
    out, counts_at, edges_at = {}, 0, 0
    for tensor, bins in names:
        out[tensor] = (counts_at, edges_at, bins)
        counts_at += bins
        edges_at += bins + 1
    return out


class _Spans:
    """Facing spans of two concatenated arrays: gather indices, and which span each element is in."""

    def __init__(self, starts_a: list[int], starts_b: list[int], lengths: list[int]) -> None:
        self.a, self.b = _spans(starts_a, lengths), _spans(starts_b, lengths)
        self.group = np.repeat(np.arange(len(lengths), dtype=np.intp), np.asarray(lengths, dtype=np.intp))
        self.start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.intp) if lengths else self.a

    def first_bad(self, bad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(spans, positions)``: each span holding a ``True`` of ``bad``, and its first one's
        position within the span."""
        where = np.flatnonzero(bad)
        groups, first = np.unique(self.group[where], return_index=True)
        return groups, where[first] - self.start[groups]


class Reported:
    """What a comparison has reported already for one pairing (it wants each statistic's first
    difference only): later differences of those are not turned into objects at all."""

    def __init__(self, alignment: Alignment) -> None:
        self.scalars = np.zeros(len(alignment.scalar_names), dtype=bool)
        self.edges = np.zeros(len(alignment.histogram_tensors), dtype=bool)
        self.counts = np.zeros(len(alignment.histogram_tensors), dtype=bool)
        self.mismatched = False


class Alignment:
    """How records with ``a``'s layouts face records with ``b``'s (see the module docstring)."""

    def __init__(self, a: StepRecord, b: StepRecord, histograms: bool) -> None:
        # the layouts are held: the cache's keys are their ids
        self.layouts = (a.scalar_names, b.scalar_names, a.histogram_names, b.histogram_names)
        # the quantiles read off a histogram are histogram views: compared with the histograms
        index_a = {name: i for i, name in enumerate(a.scalar_names) if histograms or not _QUANTILE.match(name[1])}
        index_b = {name: i for i, name in enumerate(b.scalar_names) if histograms or not _QUANTILE.match(name[1])}
        self.scalar_names = [name for name in index_a if name in index_b]
        self.scalar_a = np.fromiter((index_a[n] for n in self.scalar_names), dtype=np.intp, count=len(self.scalar_names))
        self.scalar_b = np.fromiter((index_b[n] for n in self.scalar_names), dtype=np.intp, count=len(self.scalar_names))
        self.only_a = {n for n in index_a if n not in index_b}
        self.only_b = {n for n in index_b if n not in index_a}
        self.histograms = histograms
        self.histogram_tensors: list[str] = []
        self.mismatched_bins: list[Difference] = []  # histograms of different sizes: their counts' lengths
        if not histograms:
            return
        at_a, at_b = _offsets(a.histogram_names), _offsets(b.histogram_names)
        counts_a, counts_b, edges_a, edges_b, bins = [], [], [], [], []
        for tensor, (ca, ea, n) in at_a.items():
            found = at_b.get(tensor)
            if found is None:
                continue
            if found[2] != n:
                self.mismatched_bins.append(Difference(tensor, HISTOGRAM, float(n), float(found[2])))
                continue
            self.histogram_tensors.append(tensor)
            counts_a.append(ca)
            edges_a.append(ea)
            counts_b.append(found[0])
            edges_b.append(found[1])
            bins.append(n)
        self.counts = _Spans(counts_a, counts_b, bins)
        self.edges = _Spans(edges_a, edges_b, [n + 1 for n in bins])
        self.only_a |= {(t, HISTOGRAM) for t in at_a.keys() - at_b.keys()}
        self.only_b |= {(t, HISTOGRAM) for t in at_b.keys() - at_a.keys()}

    def differences(self, a: StepRecord, b: StepRecord, rtol: float, atol: float,
                    reported: Reported | None = None) -> list[Difference]:
        """The statistics and histograms on which ``a`` and ``b`` disagree (raw tensors aside);
        with ``reported``, only those not reported before (and they are marked reported)."""
        out: list[Difference] = []
        va, vb = a.scalar_values[self.scalar_a], b.scalar_values[self.scalar_b]
        bad = ~close(va, vb, rtol, atol)
        if reported is not None:
            bad &= ~reported.scalars
            reported.scalars |= bad
        for k in np.flatnonzero(bad).tolist():
            out.append(Difference(*self.scalar_names[k], float(va[k]), float(vb[k])))
        if not self.histograms:
            return out
        if reported is None or not reported.mismatched:
            out += self.mismatched_bins
            if reported is not None:
                reported.mismatched = True
        if not self.histogram_tensors:
            return out
        ea, eb = a.edges[self.edges.a], b.edges[self.edges.b]
        edges_bad = ~close(ea, eb, rtol, atol)
        ca, cb = a.counts[self.counts.a], b.counts[self.counts.b]
        counts_bad = ca != cb
        # a histogram whose edges differ is reported by its edges: its counts are not comparable
        broken = np.zeros(len(self.histogram_tensors), dtype=bool)
        groups, positions = self.edges.first_bad(edges_bad)
        broken[groups] = True
        counts_bad &= ~broken[self.counts.group]
        if reported is not None:
            fresh = ~reported.edges[groups]
            groups, positions = groups[fresh], positions[fresh]
            reported.edges[groups] = True
            counts_bad &= ~reported.counts[self.counts.group]
        for g, i in zip(groups.tolist(), positions.tolist(), strict=True):
            at = int(self.edges.start[g]) + i
            out.append(Difference(self.histogram_tensors[g], "histogram_edges", float(ea[at]), float(eb[at]), i))
        counted, count_positions = self.counts.first_bad(counts_bad)
        if reported is not None:
            reported.counts[counted] = True
        for g, i in zip(counted.tolist(), count_positions.tolist(), strict=True):
            at = int(self.counts.start[g]) + i
            out.append(Difference(self.histogram_tensors[g], HISTOGRAM, float(ca[at]), float(cb[at]), i))
        return out


_CACHE: dict[tuple[int, int, int, int, bool], Alignment] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 32  # layouts in use at once: a few per run, a few runs


def alignment(a: StepRecord, b: StepRecord, histograms: bool = True) -> Alignment:
    """The :class:`Alignment` of two records' layouts, made once and kept for their next records."""
    key = (id(a.scalar_names), id(b.scalar_names), id(a.histogram_names), id(b.histogram_names), histograms)
    found = _CACHE.get(key)
    # an id is reused once its tuple is gone: the alignment holds its tuples, so a hit is the same layouts
    if found is not None and found.layouts[0] is a.scalar_names and found.layouts[1] is b.scalar_names \
            and found.layouts[2] is a.histogram_names and found.layouts[3] is b.histogram_names:
        return found
    made = Alignment(a, b, histograms)
    with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = made
    return made


def compare_records(a: StepRecord, b: StepRecord, rtol: float = 1e-6, atol: float = 0.0, *,
                    histograms: bool = True, tensors: bool = True) -> tuple[list[Difference], set[tuple[str, str]], set[tuple[str, str]]]:
    """``(differences, only in a, only in b)`` between two records: each statistic both hold,
    each histogram (edges within tolerance, counts exactly) and each raw tensor both saved.
    The one-sided sets hold ``(tensor, stat)`` pairs.

    >>> diffs, only_a, only_b = compare_records(record_a, record_b, rtol=1e-6)   # doctest: +SKIP
    """
    return compare_aligned(alignment(a, b, histograms), a, b, rtol, atol, tensors, None)


def compare_aligned(aligned: Alignment, a: StepRecord, b: StepRecord, rtol: float, atol: float, tensors: bool,
                    reported: Reported | None) -> tuple[list[Difference], set[tuple[str, str]], set[tuple[str, str]]]:
    """:func:`compare_records` with the records' :func:`alignment` given, and each statistic's
    difference left out once ``reported`` holds it (a run comparison reports the first only)."""
    out = aligned.differences(a, b, rtol, atol, reported)
    only_a, only_b = aligned.only_a, aligned.only_b
    if tensors and (a.tensors or b.tensors):  # raw tensors are few (save_raw_tensor): one by one
        ta, tb = {t.tensor: t.value for t in a.tensors}, {t.tensor: t.value for t in b.tensors}
        for tensor in ta.keys() & tb.keys():
            x, y = np.asarray(ta[tensor], dtype=np.float64), np.asarray(tb[tensor], dtype=np.float64)
            if x.shape != y.shape:
                out.append(Difference(tensor, VALUE, float(x.size), float(y.size)))
                continue
            bad = np.flatnonzero(~close(x.ravel(), y.ravel(), rtol, atol))
            if bad.size:
                i = int(bad[0])
                out.append(Difference(tensor, VALUE, float(x.ravel()[i]), float(y.ravel()[i]), i))
        only_a = only_a | {(t, VALUE) for t in ta.keys() - tb.keys()}
        only_b = only_b | {(t, VALUE) for t in tb.keys() - ta.keys()}
    return out, only_a, only_b
