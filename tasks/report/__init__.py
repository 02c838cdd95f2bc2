"""The report stage's decisions about the final model: whether it may be registered (the quality gate on held-out
accuracy), the registered version's tags and description, and what became of it in words (``registration``). The
plots and the evaluation's tables live with what they show (tasks/records/plots.py, tasks/evaluation/report.py).
"""
