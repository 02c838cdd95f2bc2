"""The benchmark's parts: time-to-target arithmetic (``analysis``), the verdicts of an arm against the baseline
(``comparison``), the report (``report``) with its tables (``tables``) and plots (``plots``), and the outside
control, TRL's GRPOTrainer on identical work (``trl_control``).
"""
