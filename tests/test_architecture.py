"""Import direction: flows -> tasks -> rlcore; rlcore stays pure; only ledger.py/tracking.py touch duckdb/MLflow."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RLCORE_ALLOWED = {"torch", "numpy", "rlcore", "__future__"}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_rlcore_imports_only_stdlib_numpy_torch():
    for f in (ROOT / "rlcore").glob("*.py"):
        bad = {m for m in imports(f) - RLCORE_ALLOWED if m not in sys.stdlib_module_names}
        assert not bad, f"{f.name} imports {bad}"


def test_tasks_never_import_flows_and_only_one_module_each_for_duckdb_mlflow():
    for f in (ROOT / "tasks").glob("*.py"):
        mods = imports(f)
        assert "flows" not in mods, f.name
        if f.name != "ledger.py":
            assert "duckdb" not in mods, f.name
        if f.name != "tracking.py":
            assert "mlflow" not in mods, f.name
    for f in (ROOT / "flows").glob("*.py"):
        assert not {"duckdb", "mlflow"} & imports(f), f.name


def test_rlcore_imports_with_prefect_and_mlflow_blocked():
    code = ("import sys\nfor m in ('prefect','mlflow','duckdb','transformers'): sys.modules[m] = None\n"
            "import importlib, pkgutil, rlcore\n"
            "for m in pkgutil.iter_modules(rlcore.__path__): importlib.import_module('rlcore.' + m.name)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
