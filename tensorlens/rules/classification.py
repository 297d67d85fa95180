"""Built-in rules on labels and predictions: ClassImbalance and Confusion (SageMaker Debugger's
names, parameters and defaults).

Both read raw tensors: save them each step from the training loop with raw saving on for their
collections, for example::

    for name in ("labels", "predictions"):
        hook.get_collection(name).reduction_config = tl.ReductionConfig(save_raw_tensor=True)
    ...
    hook.save_tensor("labels", y, collections_to_write="labels")
    hook.save_tensor("predictions", logits.argmax(1), collections_to_write="predictions")

Counts accumulate over every saved step (per worker), as SageMaker's rules accumulate over the
steps they read.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from tensorlens.findings import Finding
from tensorlens.records import StepRecord
from tensorlens.rules.base import Rule
from tensorlens.rules.params import collection_of, to_bool, to_float, to_int

_SAVE_HINT = ("save them with hook.save_tensor(name, tensor, collections_to_write=...) and "
              "hook.get_collection(...).reduction_config = tl.ReductionConfig(save_raw_tensor=True)")


def _classes(values: np.ndarray) -> np.ndarray | None:
    """Integer class ids from a raw tensor, or ``None`` if it does not hold them."""
    values = np.asarray(values).ravel()
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values < 0) or np.any(values != np.round(values)):
        return None
    return values.astype(np.int64)


def _grow(matrix: np.ndarray, size: int) -> np.ndarray:
    if matrix.shape[0] >= size:
        return matrix
    grown = np.zeros((size, size), dtype=np.int64)
    grown[: matrix.shape[0], : matrix.shape[1]] = matrix
    return grown


class _LabelsAndPredictions(Rule):
    """Finds the labels and predictions in a record and keeps a confusion matrix per worker
    (rows: labels, columns: predictions)."""

    argmax = False

    def reset(self) -> None:
        self._matrix: dict[str, np.ndarray] = {}
        self._seen = False

    def finish(self) -> list[Finding]:
        if not self._seen:
            self.note("missing", f"no labels and predictions were found in the records: {_SAVE_HINT}")
        return []

    def _is_labels(self, tensor: str) -> bool:
        raise NotImplementedError

    def _is_predictions(self, tensor: str) -> bool:
        raise NotImplementedError

    def _update(self, record: StepRecord) -> np.ndarray | None:
        """Add the record's pairs to the worker's matrix; the matrix, or ``None`` if the record holds none."""
        raw = {t.tensor: t.value for t in record.tensors}
        labels = [v for t, v in raw.items() if self._is_labels(t)]
        predictions = [v for t, v in raw.items() if self._is_predictions(t) and not self._is_labels(t)]
        if not labels or not predictions:
            if any(self._is_labels(t) or self._is_predictions(t) for t in record.tensor_names()):
                self.note("raw", f"found labels/predictions statistics but not their raw values: {_SAVE_HINT}")
            return None
        self._seen = True
        y, p = np.asarray(labels[0]), np.asarray(predictions[0])
        if p.ndim == y.ndim + 1:
            if not self.argmax and isinstance(self, ClassImbalance):
                self.note("argmax", f"predictions have shape {p.shape} and labels {y.shape}: pass argmax=True to take the class of highest score")
                return None
            p = p.argmax(axis=-1)
        y, p = _classes(y), _classes(p)
        if y is None or p is None or y.shape != p.shape:
            self.note("shape", "labels and predictions must be integer class ids of the same shape")
            return None
        size = int(max(y.max(), p.max())) + 1
        matrix = _grow(self._matrix.get(record.worker, np.zeros((0, 0), dtype=np.int64)), size)
        np.add.at(matrix, (y, p), 1)
        self._matrix[record.worker] = matrix
        return matrix


class ClassImbalance(_LabelsAndPredictions):
    """Fires once ``samples`` labels were seen when the most frequent class has more than
    ``threshold_imbalance`` times the samples of the least frequent one, or when more than
    ``threshold_misprediction`` of a class's samples are predicted wrong.

    Classes are ``0 .. largest id seen``: a class with no sample counts as infinitely rare.
    ``argmax=True`` takes the class of highest score from prediction vectors.
    """

    def __init__(self, threshold_imbalance: Any = 10, threshold_misprediction: Any = 0.7, samples: Any = 500,
                 argmax: Any = False, labels_regex: Any = ".*labels", predictions_regex: Any = ".*predictions",
                 **kwargs: Any) -> None:
        self.threshold_imbalance = to_float("threshold_imbalance", threshold_imbalance, minimum=1.0)
        self.threshold_misprediction = to_float("threshold_misprediction", threshold_misprediction, minimum=0.0, maximum=1.0)
        self.samples = to_int("samples", samples, minimum=1)
        self.argmax = to_bool("argmax", argmax)
        self.labels_regex, self.predictions_regex = str(labels_regex), str(predictions_regex)
        self._labels, self._predictions = re.compile(self.labels_regex), re.compile(self.predictions_regex)
        super().__init__(**kwargs)

    def _is_labels(self, tensor: str) -> bool:
        return self._labels.search(tensor) is not None

    def _is_predictions(self, tensor: str) -> bool:
        return self._predictions.search(tensor) is not None

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        matrix = self._update(record)
        if matrix is None:
            return []
        counts = matrix.sum(axis=1)
        total = int(counts.sum())
        if total < self.samples:
            return []
        out = []
        largest, smallest = int(counts.argmax()), int(counts.argmin())
        if counts[smallest] == 0 or counts[largest] / counts[smallest] > self.threshold_imbalance:
            ratio = float("inf") if counts[smallest] == 0 else counts[largest] / counts[smallest]
            out.append(self.finding(record, None, f"class {largest} has {counts[largest]} samples, class {smallest} {counts[smallest]} "
                                                  f"(ratio {ratio:.3g} > {self.threshold_imbalance:g}; {total} labels seen)", ratio))
        for c in np.flatnonzero(counts).tolist():
            wrong = 1.0 - matrix[c, c] / counts[c]
            if wrong > self.threshold_misprediction:
                out.append(self.finding(record, None, f"class {c}: {wrong:.1%} of its {counts[c]} samples mispredicted "
                                                      f"(> {self.threshold_misprediction:g})", wrong))
        return out


class Confusion(_LabelsAndPredictions):
    """Fires when the confusion matrix (rows: labels, columns: predictions, over every saved step)
    has, for a predicted class ``i``, ``C[i][i] / sum_j C[j][i] < min_diag`` or an off-diagonal
    ``C[j][i] / sum_j C[j][i] > max_off_diag``.

    Labels are the raw tensor named ``labels`` or in the collection ``labels_collection``;
    predictions likewise (class ids, or scores whose argmax is taken). ``category_no``: the number
    of classes (default: the largest id seen + 1).
    """

    def __init__(self, category_no: Any = None, labels: Any = "labels", predictions: Any = "predictions",
                 labels_collection: Any = "labels", predictions_collection: Any = "predictions", min_diag: Any = 0.9,
                 max_off_diag: Any = 0.1, **kwargs: Any) -> None:
        self.category_no = to_int("category_no", category_no, minimum=2, optional=True)
        self.labels, self.predictions = str(labels), str(predictions)
        self.labels_collection, self.predictions_collection = str(labels_collection), str(predictions_collection)
        self.min_diag = to_float("min_diag", min_diag, minimum=0.0, maximum=1.0)
        self.max_off_diag = to_float("max_off_diag", max_off_diag, minimum=0.0, maximum=1.0)
        super().__init__(**kwargs)

    def _is_labels(self, tensor: str) -> bool:
        return collection_of(tensor) == self.labels_collection or tensor.rsplit("/", 1)[-1] == self.labels

    def _is_predictions(self, tensor: str) -> bool:
        return collection_of(tensor) == self.predictions_collection or tensor.rsplit("/", 1)[-1] == self.predictions

    def invoke_at_step(self, record: StepRecord) -> list[Finding]:
        matrix = self._update(record)
        if matrix is None:
            return []
        if self.category_no is not None:
            if matrix.shape[0] > self.category_no:
                self.note("category_no", f"class ids reach {matrix.shape[0] - 1}, beyond category_no={self.category_no}; those are left out")
            matrix = _grow(matrix, self.category_no)[: self.category_no, : self.category_no]
        out = []
        columns = matrix.sum(axis=0)
        for i in np.flatnonzero(columns).tolist():
            diag = matrix[i, i] / columns[i]
            off = matrix[:, i].astype(np.float64) / columns[i]
            off[i] = 0.0
            j = int(off.argmax())
            if diag < self.min_diag:
                out.append(self.finding(record, None, f"predicted class {i}: {diag:.1%} correct (< min_diag {self.min_diag:g}); "
                                                      f"{off[j]:.1%} are class {j}", diag))
            elif off[j] > self.max_off_diag:
                out.append(self.finding(record, None, f"predicted class {i}: {off[j]:.1%} are class {j} (> max_off_diag {self.max_off_diag:g})", off[j]))
        return out
