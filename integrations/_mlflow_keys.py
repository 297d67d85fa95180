"""Metric keys MLflow accepts, kept unique: :func:`mlflow_metric_key` makes a key acceptable (ASCII,
no ``:``, at most :data:`MAX_KEY_LENGTH` characters) and :class:`MetricKeyMapper` gives two
different tensors two different keys, with a short hash where cleaning or cutting made them meet.
"""

from __future__ import annotations

import hashlib
import re

from tensorlens.dispatch.epochs import AGGREGATES
from tensorlens.modes import ModeKeys
from tensorlens.stats.derived import GLOBAL_STATISTICS, PARAMETER_STATISTICS, UNDEFINED_COUNT, UNIT_STATISTICS
from tensorlens.stats.registry import STATISTICS

#: Quantile metrics sent for every histogram: ``(metric suffix, level)``.
QUANTILES: tuple[tuple[str, float], ...] = (
    ("p01", 0.01), ("p05", 0.05), ("p25", 0.25), ("p50", 0.50), ("p75", 0.75), ("p95", 0.95), ("p99", 0.99),
)
#: MLflow rejects longer metric keys (``MAX_ENTITY_KEY_LENGTH``).
MAX_KEY_LENGTH = 250
_HASH_LENGTH = 8
# MLflow allows ``[/\w.\- :]`` but ``\w`` is Unicode and ``:`` is refused on Windows clients;
# staying within ASCII and without ``:`` gives keys every client and server accepts.
_DISALLOWED = re.compile(r"[^A-Za-z0-9_.\- /]")


def mlflow_metric_key(key: str) -> str:
    """``key`` rewritten into a metric key MLflow accepts (length aside; see :class:`MetricKeyMapper`).

    Characters outside ``A-Z a-z 0-9 _ . - / space`` become ``_``; empty path segments
    (``a//b``, a leading or trailing ``/``) are dropped; segments made only of dots (``.``,
    ``..``) become underscores, because MLflow refuses keys that ``posixpath.normpath`` changes;
    so do the leading dots of a key that starts with ``..``. Valid keys come back unchanged.

    >>> mlflow_metric_key("gradients/fc1.weight/l2")
    'gradients/fc1.weight/l2'
    >>> mlflow_metric_key("activations/layers[0]//out:x/")
    'activations/layers_0_/out_x'
    >>> mlflow_metric_key("../a/./b")
    '__/a/_/b'
    """
    segments = []
    for segment in _DISALLOWED.sub("_", key).split("/"):
        if not segment:
            continue
        if segment.strip(".") == "":
            segment = "_" * len(segment)
        segments.append(segment)
    cleaned = "/".join(segments) or "_"
    if cleaned.startswith(".."):  # MLflow refuses any key starting with "..", even "..a"
        dots = len(cleaned) - len(cleaned.lstrip("."))
        cleaned = "_" * dots + cleaned[dots:]
    return cleaned


def _short_hash(identity: str, length: int = _HASH_LENGTH) -> str:
    # sha1, not hash(): the suffix must be the same in every process and every run
    return hashlib.sha1(identity.encode("utf-8")).hexdigest()[:length]


# A key ending like a hash suffix is never kept as it is, so no kept key can equal a hashed one.
_LOOKS_HASHED = re.compile(r"-[0-9a-f]{8,}$")


class MetricKeyMapper:
    """Maps keys to valid MLflow metric keys, injectively and without memory of other keys.

    A key is kept as it is when it is *canonical* (see :meth:`MLflowBackend.metric_key`), a valid
    MLflow key (:func:`mlflow_metric_key` leaves it unchanged), at most 250 characters, and does not
    end like a hash suffix (``-`` and 8 or more hex digits). Any other key becomes its cleaned form,
    cut to fit, plus ``-<8 hex digits>`` of the SHA-1 of its ``identity`` (default: the key).

    The decision depends on the key alone, never on which keys came first, so every process, run,
    mode and worker maps a key to the same metric, and two keys that clean to one string (``lin@1``
    and ``lin#1``, or ``lin_1`` and ``lin@1``) are two metrics in any order. Distinct identities can
    only share a metric through a SHA-1 prefix collision; the mapper remembers what it gave out
    and lengthens the suffix if that ever happens within a process.

    >>> mapper = MetricKeyMapper()
    >>> mapper("a_0_"), mapper("a[0]"), mapper("a(0)")
    ('a_0_', 'a_0_-b2fa95a4', 'a_0_-a4b7b84f')
    """

    def __init__(self) -> None:
        self._by_identity: dict[str, str] = {}
        self._owner: dict[str, str] = {}  # mapped key -> identity that holds it

    def __call__(self, key: str, identity: str | None = None, canonical: bool = True) -> str:
        identity = key if identity is None else identity
        mapped = self._by_identity.get(identity)
        if mapped is not None:
            return mapped
        keep = canonical and len(key) <= MAX_KEY_LENGTH and not _LOOKS_HASHED.search(key) and mlflow_metric_key(key) == key
        mapped = key if keep else _hashed(key, identity, _HASH_LENGTH)
        length = _HASH_LENGTH
        while self._owner.get(mapped, identity) != identity:  # a SHA-1 prefix collision (never seen)
            length += 4
            mapped = _hashed(key, identity, length)
        self._owner[mapped] = identity
        self._by_identity[identity] = mapped
        return mapped

    def __len__(self) -> int:
        return len(self._by_identity)


def _hashed(key: str, identity: str, length: int) -> str:
    suffix = "-" + _short_hash(identity, length)
    return mlflow_metric_key(key)[: MAX_KEY_LENGTH - len(suffix)] + suffix


#: Names that end a ``<tensor>/<name>`` series: every statistic the engine records (those of
#: :mod:`tensorlens.stats.registry` with their ``abs_`` forms, the quantile suffixes, the derived
#: statistics of :mod:`tensorlens.stats.derived`) and their epoch aggregates (``l2_mean``, ...). A
#: ``<tensor>/<stat>`` series keeps its readable key when its statistic is one of them; a plain
#: scalar of three or more parts that ends in one (``summarize_scalar("grad/l2")`` beside
#: ``summarize_tensor("grad")``'s ``l2``) is the one that gets a hash suffix (see
#: :meth:`MLflowBackend.metric_key`). Derived statistics were missing here once, which gave every
#: ``dynamics/global/grad_norm`` a suffix.
_BASE_STATISTICS = frozenset([
    *STATISTICS, *(suffix for suffix, _ in QUANTILES), *PARAMETER_STATISTICS, *GLOBAL_STATISTICS,
    *UNIT_STATISTICS, UNDEFINED_COUNT,
])
SERIES_SUFFIXES: frozenset[str] = _BASE_STATISTICS | frozenset(
    f"{stat}_{aggregate}" for stat in _BASE_STATISTICS for aggregate in AGGREGATES
)
MODE_NAMES = frozenset(str(mode) for mode in ModeKeys)
WORKER_INFIX = re.compile(r"^worker_\d+$")
