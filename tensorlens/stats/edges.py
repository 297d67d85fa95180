"""Exact histogram edges: the values at which :func:`~tensorlens.stats.histogram.histogram_counts`
changes bin, found by bisection over the ordered bit patterns of the binned dtype."""

from __future__ import annotations

import numpy as np

from tensorlens.stats import native


def _ordered_bits(x: np.ndarray) -> np.ndarray:
    """Floats as int64 keys whose order is the floats' order (an involution: it is its own inverse
    on the bit pattern), so a bisection over keys is a bisection over representable values."""
    signed = np.int32 if x.dtype == np.float32 else np.int64
    bits = x.view(signed).astype(np.int64)
    return np.where(bits < 0, bits ^ np.int64(np.iinfo(signed).max), bits)


def _from_ordered_bits(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    signed = np.int32 if dtype == np.float32 else np.int64
    bits = np.where(keys < 0, keys ^ np.int64(np.iinfo(signed).max), keys).astype(signed)
    return bits.view(dtype)


def exact_edges(low: np.ndarray, high: np.ndarray, scale: np.ndarray, bins: int, dtype: np.dtype) -> np.ndarray:
    """The edges ``[G, bins + 1]`` (float64) at which :func:`histogram_counts` changes bin: by the
    compiled kernel where it is built (0.1 ms for 53 x 64 bins), else by
    :func:`exact_edges_numpy` (1 ms, on the dispatcher thread); both are bit-identical."""
    found = native.edges(low, high, scale, bins, dtype)
    return found if found is not None else exact_edges_numpy(low, high, scale, bins, dtype)


def exact_edges_numpy(low: np.ndarray, high: np.ndarray, scale: np.ndarray, bins: int, dtype: np.dtype) -> np.ndarray:
    """The edges ``[G, bins + 1]`` (float64) at which :func:`histogram_counts` changes bin.

    Edge ``i`` of histogram ``g`` is the smallest value ``x`` of ``dtype`` in ``[low, high]`` with
    ``floor((x - low) * scale) >= i``, evaluated in exactly the arithmetic the device used. The
    bin is a monotone function of ``x``, so a bisection over the ordered bit patterns finds it.
    The bisection starts from a window of a few ulps around ``low + i / scale`` (two roundings
    away from the edge, so almost always inside it) and falls back to all of ``[low, high]`` for
    the edges the window misses (near zero an ulp is tiny). Edge 0 is ``low`` and the last is
    ``high`` (the last bin is closed); bins too narrow for ``dtype`` come out empty, with equal
    edges, which numpy accepts.
    """
    dtype = np.dtype(dtype)
    lo = np.asarray(low, dtype=np.float64).astype(dtype)[:, None]
    hi = np.asarray(high, dtype=np.float64).astype(dtype)[:, None]
    sc = np.asarray(scale, dtype=np.float64).astype(dtype)[:, None]
    shape = (lo.shape[0], bins - 1)
    target = np.broadcast_to(np.arange(1, bins, dtype=np.float64)[None, :], shape)
    floor_key = np.broadcast_to(_ordered_bits(lo), shape)
    ceil_key = np.broadcast_to(_ordered_bits(hi), shape)
    with np.errstate(all="ignore"):
        guess = (lo.astype(np.float64) + target / sc.astype(np.float64)).astype(dtype)
        guess_key = np.clip(_ordered_bits(np.nan_to_num(guess)), floor_key, ceil_key)
        lo_b, sc_b = np.broadcast_to(lo, shape), np.broadcast_to(sc, shape)
        # most edges are the guess or the next value: settled with three whole-array tests
        at_guess = _reached(guess_key, lo_b, sc_b, target, dtype)
        below, above = np.maximum(guess_key - 1, floor_key), np.minimum(guess_key + 1, ceil_key)
        down = at_guess & ((guess_key == floor_key) | ~_reached(below, lo_b, sc_b, target, dtype))
        up = ~at_guess & (above != guess_key) & _reached(above, lo_b, sc_b, target, dtype)
        edge = np.where(down, guess_key, above)
        rest = ~(down | up)
        if rest.any():  # the others by bisection, from a window of a few ulps
            edge[rest] = _bisect_window(guess_key[rest], floor_key[rest], ceil_key[rest], lo_b[rest], sc_b[rest], target[rest], dtype)
    inner = _from_ordered_bits(edge, dtype).astype(np.float64)
    edges = np.concatenate([lo.astype(np.float64), inner, hi.astype(np.float64)], axis=1)
    return np.maximum.accumulate(edges, axis=1)


def _bisect_window(
    guess_key: np.ndarray, floor_key: np.ndarray, ceil_key: np.ndarray, lo: np.ndarray, sc: np.ndarray,
    target: np.ndarray, dtype: np.dtype,
) -> np.ndarray:
    """The edges near ``guess_key`` by bisection: in a window of a few ulps where the edge lies
    in it, else over all of ``[floor_key, ceil_key]`` (near zero an ulp is tiny)."""
    left = np.maximum(guess_key - _WINDOW_ULPS, floor_key)
    right = np.minimum(guess_key + _WINDOW_ULPS, ceil_key)
    # the edge lies in (left, right] when right reaches the bin and left does not (or is low itself)
    inside = _reached(right, lo, sc, target, dtype) & ((left == floor_key) | ~_reached(left, lo, sc, target, dtype))
    left = np.where(inside & (left != floor_key), left + 1, np.where(inside, left, floor_key))
    right = np.where(inside, right, ceil_key)
    return _bisect(left, right, lo, sc, target, dtype)


#: Half-width of the first bisection window of :func:`exact_edges`, in ulps.
_WINDOW_ULPS = 8


def _reached(keys: np.ndarray, lo: np.ndarray, sc: np.ndarray, target: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Whether the value with ordered bits ``keys`` falls in bin ``target`` or above."""
    x = _from_ordered_bits(keys, dtype)
    return np.floor((x - lo) * sc) >= target  # float32 ops stay float32, as on the device


def _bisect(
    left: np.ndarray, right: np.ndarray, lo: np.ndarray, sc: np.ndarray, target: np.ndarray, dtype: np.dtype
) -> np.ndarray:
    """The smallest key in ``[left, right]`` that reaches ``target`` (``right`` if none does).

    The narrow windows are closed in a few whole-array rounds; the rare wide fallbacks are then
    bisected on their own, so they do not make every edge pay for 32 rounds.
    """
    left, right = left.copy(), right.copy()
    narrow = right <= left + 2 * _WINDOW_ULPS  # not right - left: that overflows across zero
    wide = np.flatnonzero(~narrow.reshape(-1))
    lo, sc, target = (np.broadcast_to(a, left.shape) for a in (lo, sc, target))
    # in the wide entries the whole-array rounds are harmless: they only shrink [left, right]
    for _ in range(int(2 * _WINDOW_ULPS + 1).bit_length()):
        middle = (left >> 1) + (right >> 1) + (left & right & 1)  # floor((l + r) / 2) without overflow
        reached = _reached(middle, lo, sc, target, dtype)
        right = np.where(reached, middle, right)
        left = np.where(reached, left, np.minimum(middle + 1, right))
    if wide.size:
        low_key, high_key = left.reshape(-1)[wide], right.reshape(-1)[wide]
        lo_w, sc_w, t_w = (a.reshape(-1)[wide] for a in (lo, sc, target))
        while np.any(low_key < high_key):
            middle = (low_key >> 1) + (high_key >> 1) + (low_key & high_key & 1)
            reached = _reached(middle, lo_w, sc_w, t_w, dtype)
            high_key = np.where(reached, middle, high_key)
            low_key = np.where(reached, low_key, np.minimum(middle + 1, high_key))
        right.reshape(-1)[wide] = high_key
    return right
