"""The plan: which composition of the techniques the run trains (``auto``), chosen from measurements.

``probe`` (what the work of a step costs on this device, timed before training) and ``planner`` (the pool's pass
rates, the candidates, the :class:`~tasks.plan.planner.Plan` record and the config the chosen candidate trains);
the prediction itself is pure, rlcore/plan.py.
"""
