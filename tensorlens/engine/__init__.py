"""The training thread: what is recorded and when.

The :class:`~tensorlens.engine.recorder.Recorder` decides when a step begins and ends and holds
the objects that do the rest: what it is given (:mod:`~tensorlens.engine.inputs`, waiting in
:mod:`~tensorlens.engine.pending`), the collections and the save schedule
(:mod:`~tensorlens.engine.schedule`), its sources' hooks (:mod:`~tensorlens.engine.sources`), its
step counters (:mod:`~tensorlens.engine.counters`), training dynamics
(:mod:`~tensorlens.engine.dynamics`, read at the boundaries by :mod:`~tensorlens.engine.dynamics_steps`)
and a saved step's way out (:mod:`~tensorlens.engine.step_output`: the statistics of
:mod:`tensorlens.compute`, handed to :mod:`tensorlens.dispatch`).
"""
