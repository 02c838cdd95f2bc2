"""The benchmark's parts: time-to-target arithmetic (``analysis``), the report with its tables and plots
(``report``) and the outside control, TRL's GRPOTrainer on identical work (``trl_control``).
"""
