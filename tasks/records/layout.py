"""How rlsift's metrics are laid out for MLflow's UI (docs/operations.md "What MLflow shows"): which keys are step
series, which are run tags, and which stay in ``metrics.jsonl`` only. Pure; tasks/records/tracking/ sends them.
"""

from __future__ import annotations

#: What MLflow's Model metrics tab shows first (docs/operations.md "What MLflow shows"). The tab groups charts
#: by the key up to its last ``/`` and sorts the groups by name, so the step series a user compares run against
#: run are also logged under ``0_progress/``, a group that sorts before every other (digits sort before
#: letters in both of the UI's orderings); their own keys stay where they are (``eval/``, ``train/``).
HEADLINE = {"eval/accuracy": "0_progress/heldout_accuracy", "train/reward_mean": "0_progress/reward_mean",
            "train/effective_ratio": "0_progress/effective_ratio"}
#: Single figures per run, sent as run tags (the run page's Tags; a column in the runs table), not as one-bar
#: charts: the calibration shares (tasks/calibration/record.py ``Calibration.metrics``) and the plan's pool shares,
#: unit costs and predictions (tasks/plan/record.py ``Plan.metrics``).
RUN_VALUES = ("calibrate/", "plan/")
#: The run's cost totals: the only ``cost/*`` step series. Per-stage cost is the ``cost_by_stage.json`` table
#: (tasks/run.py ``Run.log_cost_table``), not a chart per stage.
COST_TOTALS = ("cost/device_hours", "cost/usd")


def mlflow_layout(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """Split metrics into what MLflow gets as step series and as run tags (see :data:`HEADLINE`).

    Per-stage cost (``cost/<stage>_device_hours``, ``cost/<stage>_usd``) is left out: the cost table has it,
    and ``metrics.jsonl`` keeps every key as logged.
    """
    series: dict[str, float] = {}
    values: dict[str, str] = {}
    for k, v in metrics.items():
        if v is None:
            continue
        if k.startswith(RUN_VALUES):
            values[k] = f"{float(v):.4g}"
        elif k.startswith("cost/") and k not in COST_TOTALS:
            continue
        else:
            series[k] = v
            if k in HEADLINE:
                series[HEADLINE[k]] = v
    return series, values


def mlflow_key(key: str) -> str:
    """An MLflow-safe metric or param key (no ``@``: ``pass@k`` becomes ``pass_at_k``)."""
    return key.replace("@", "_at_")
