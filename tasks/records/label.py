"""A run's readable name (the MLflow run's and ``rlsift ledger runs``' ``what`` column): what it trains, on what
data, with which seed. Light (the config only), so the ledger's command line names runs without importing torch.
"""

from __future__ import annotations

from pathlib import Path

from tasks.config import Config


def run_label(cfg: Config, choice: str | None = None) -> str:
    """A readable MLflow run name: the techniques switched on (``grpo`` when none; ``auto`` when the plan chooses,
    ``auto→<choice>`` once it has chosen ``choice``, also the ``rlsift.plan.choice`` tag), the data and the seed, e.g.
    ``dots+replay bundled:default s0``, ``auto→dots_screen bundled:default s0`` or ``grpo gsm8k s1``. The run id
    stays the ``rlsift.run_id`` tag."""
    on = [f"auto→{choice}" if choice else "auto"] if cfg.plan.auto else [name for name, enabled in (
        ("dots", cfg.select.method == "dots"), ("dynamic", cfg.dynamic.enabled), ("replay", cfg.replay.enabled),
        ("pods", cfg.pods.enabled), ("scalingrl", cfg.curriculum.enabled), ("gain", cfg.gain.enabled),
        ("drop-solved", cfg.select.drop_solved)) if enabled]
    data = ",".join(dict.fromkeys(  # each name once: GSM8K's train and test files are both ``gsm8k``
        f"bundled:{s.mix if isinstance(s.mix, str) else 'custom'}" if s.kind == "bundled"
        else (s.format or Path(s.path or "file").stem) for s in cfg.data.sources))
    return f"{'+'.join(on) or 'grpo'} {data} s{cfg.seed}"
