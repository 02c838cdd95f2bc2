"""What a run imports before its first stage: the pipeline module (flows/pipeline.py, which ``rlsift run`` imports once
the config is checked) leaves out what only some runs or only later stages use: math-verify (math rewards), vLLM
and its engine (rollout.engine=vllm), DeepSpeed and PEFT (scale.backend, LoRA), datasets, matplotlib (the report
stage's plots), transformers and huggingface_hub (loaded with the policy, the second stage: its model modules took
3 of the 9 s of ``import flows.pipeline``) and scipy.stats (the McNemar p at the end; MLflow imports scipy.sparse).
The first stage needs Prefect, MLflow, duckdb and torch."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

LAZY = ("math_verify", "latex2sympy2_extended", "vllm", "deepspeed", "peft", "datasets", "matplotlib", "transformers",
        "scipy.stats", "huggingface_hub")


def test_the_pipeline_module_does_not_import_what_only_some_runs_use():
    code = ("import json, sys\nimport flows.pipeline\n"
            f"print(json.dumps(sorted(m for m in {LAZY!r} if m in sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [], p.stdout
