"""The dispatcher thread: one record per saved step, epoch aggregates, and the fan-out.

- :mod:`~tensorlens.dispatch.fanout`: the :class:`Dispatcher` (the training thread's bounded queue,
  one bounded queue and thread per backend, flush and close within a deadline);
- :mod:`~tensorlens.dispatch.assemble`: a step's host statistics built into its one
  :class:`~tensorlens.records.StepRecord` (finalized statistics, exact edges);
- :mod:`~tensorlens.dispatch.epochs`: the aggregates of a train epoch's records.

``tensorlens.dispatch`` keeps the names it had as one module (``Dispatcher``, ``BackendStats``,
``CLOSE_TIMEOUT_S``, ``STALL_TIMEOUT_S``).
"""

from tensorlens.dispatch.fanout import CLOSE_TIMEOUT_S, STALL_TIMEOUT_S, BackendStats, Dispatcher

__all__ = ["CLOSE_TIMEOUT_S", "STALL_TIMEOUT_S", "BackendStats", "Dispatcher"]
