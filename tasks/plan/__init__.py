"""The plan: which composition of the techniques the run trains (``auto``), chosen from measurements.

``probe`` (what the work of a step costs on this device, timed before training), ``planner`` (the pool's pass
rates, the candidates, the choice and the config the chosen candidate trains) and ``record`` (the
:class:`~tasks.plan.record.Plan` it saves and shows); the prediction itself is pure, rlcore/plan.py.
"""
