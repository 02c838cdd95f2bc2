"""Calibration: the reference set measured before training.

``reference`` (rollouts with verified rewards, and the reference rollouts that measure prompts' pass rates: the
calibrate stage's stratified set, and DOTS's per-round set) and ``record`` (:class:`~tasks.calibration.record.
Calibration`, what the calibrate stage hands the plan and the training stage).
"""
