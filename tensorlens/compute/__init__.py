"""The batched statistics of a saved step and its one host copy: jobs in, host statistics out.

:class:`~tensorlens.compute.step.StepStatistics` takes a step's
:class:`~tensorlens.compute.jobs.TensorJob` s and gives back
:class:`~tensorlens.compute.host_statistics.HostStatistics`, through a plan built once and reused
while the jobs keep their shapes (:mod:`~tensorlens.compute.plan`), values of unusual layouts made
plain (:mod:`~tensorlens.compute.job_values`), ranks merged exactly
(:mod:`~tensorlens.compute.distributed`). It imports nothing of the recorder (``engine``), the
dispatcher (``dispatch``), the captures or the backends (``tests/test_layout.py`` checks).
"""
