"""What a run leaves behind: the selection ledger (``ledger/``, the only duckdb user and the only home of
SQL), experiment tracking (``tracking/``, the only MLflow user), what the Prefect UI shows of a run
(``artifacts``), device-hour and money accounting (``cost``), the training curves (``plots``), a
run's readable name (``label``), progress lines for long work without a count (``progress``), how a run stopped
by SIGINT or SIGTERM ends its records as cancelled and says how to resume it (``stopping``), and the commands rlsift
prints for pasting, by the full path of their program (``commands``).
"""
