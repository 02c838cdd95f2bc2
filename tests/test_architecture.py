"""Import direction: flows -> tasks -> rlcore; rlcore stays pure; only the ledger package touches duckdb and
holds SQL, only the tracking package touches MLflow; tasks/ is packages by concern, not a flat folder."""

import ast
import re
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
    for f in sources("rlcore"):
        bad = {m for m in imports(f) - RLCORE_ALLOWED if m not in sys.stdlib_module_names}
        assert not bad, f"{f.name} imports {bad}"


LEDGER = ROOT / "tasks" / "records" / "ledger"
TRACKING = ROOT / "tasks" / "records" / "tracking"
#: A string literal that is a SQL statement (the start of one, in any case).
SQL = re.compile(r"^\s*(SELECT\s.+\sFROM\s|INSERT\s+INTO\s|DELETE\s+FROM\s|UPDATE\s+\w+\s+SET\s|"
                 r"CREATE\s+(TABLE|VIEW|INDEX)\s|DROP\s+TABLE\s)", re.I | re.S)


def sources(*folders: str) -> list[Path]:
    return sorted(f for d in folders for f in (ROOT / d).rglob("*.py"))


def test_tasks_never_import_flows_and_only_one_package_each_for_duckdb_mlflow():
    assert any("duckdb" in imports(f) for f in LEDGER.rglob("*.py")), \
        f"{LEDGER} should be the package that touches duckdb"
    for f in sources("tasks"):
        mods = imports(f)
        assert "flows" not in mods, f
        if LEDGER not in f.parents:
            assert "duckdb" not in mods, f
        if TRACKING not in f.parents:
            assert "mlflow" not in mods, f
    for f in sources("flows"):
        assert not {"duckdb", "mlflow"} & imports(f), f


def sql_literals(path: Path) -> list[tuple[int, str]]:
    """The string literals of ``path`` that are SQL statements: (line, text)."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.match(node.value)]


def test_sql_lives_only_in_the_ledger_package():
    assert any(sql_literals(f) for f in LEDGER.rglob("*.py")), f"{LEDGER} should hold the SQL"
    for f in sources("rlcore", "tasks", "flows"):
        if LEDGER in f.parents:
            continue
        for line, text in sql_literals(f):
            raise AssertionError(f"{f.relative_to(ROOT)}:{line} holds SQL: {text[:60]!r}")


def test_the_sql_check_sees_sql_outside_the_ledger_package(tmp_path, monkeypatch):
    """The check above fails on a module beside the ledger package that holds a SQL statement."""
    for folder in ("rlcore", "flows", "tasks/records/ledger"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "tasks" / "records" / "ledger" / "store.py").write_text('Q = "SELECT * FROM runs"\n')
    (tmp_path / "tasks" / "records" / "cost.py").write_text('Q = "DELETE FROM groups WHERE step > ?"\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "LEDGER", tmp_path / "tasks" / "records" / "ledger")
    try:
        test_sql_lives_only_in_the_ledger_package()
    except AssertionError as err:
        assert "tasks/records/cost.py:1 holds SQL" in str(err)
    else:
        raise AssertionError("SQL outside the ledger package went unseen")


def test_tasks_is_packages_by_concern_each_saying_what_lives_there():
    top = sorted(f.name for f in (ROOT / "tasks").glob("*.py"))
    assert len(top) <= 5, f"tasks/ should hold packages, not {len(top)} loose modules: {top}"
    for pkg in (ROOT / "tasks").iterdir():
        if pkg.is_dir() and pkg.name != "__pycache__":
            doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
            assert doc and len(doc) > 40, f"{pkg.name}/__init__.py should say what lives there"


def test_rlcore_imports_with_prefect_and_mlflow_blocked():
    code = ("import sys\nfor m in ('prefect','mlflow','duckdb','transformers'): sys.modules[m] = None\n"
            "import importlib, pkgutil, rlcore\n"
            "for m in pkgutil.iter_modules(rlcore.__path__): importlib.import_module('rlcore.' + m.name)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere (lazy imports in functions too): ``from a import b``
    counts as ``a.b`` when that is a module, else as ``a``; relative imports are resolved."""
    package = module_name(path).split(".")[: -1 if path.name != "__init__.py" else None]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return out & modules


def test_no_import_cycle_under_tasks():
    """No module under tasks/ reaches itself through its imports (e.g. two modules importing each other)."""
    files = {module_name(f): f for f in sources("tasks")}
    graph = {m: internal_imports(f, set(files)) for m, f in files.items()}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    cyclic = {m: sorted(i for i in graph[m] if m in reachable(i) | {i}) for m in graph if m in reachable(m)}
    assert not cyclic, f"import cycles under tasks/ (module: its imports that lead back to it): {cyclic}"


def unit_of(module: str) -> str:
    """The package or flat module directly under tasks/ that ``module`` belongs to (``tasks.update.memory_check`` ->
    ``tasks.update``)."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_the_packages_under_tasks():
    """The packages and flat modules under tasks/ form layers: none reaches itself through the others' imports,
    lazy imports in functions and imports under ``TYPE_CHECKING`` included (a type-only import is still a tie)."""
    files = {module_name(f): f for f in sources("tasks")}
    graph: dict[str, set[str]] = {}
    for m, f in files.items():
        graph.setdefault(unit_of(m), set()).update(
            unit_of(i) for i in internal_imports(f, set(files)) if unit_of(i) != unit_of(m))

    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            u = todo.pop()
            if u not in seen:
                seen.add(u)
                todo += graph.get(u, ())
        return seen

    cyclic = {u: sorted(v for v in graph[u] if u in reachable(v)) for u in graph if u in reachable(u)}
    assert not cyclic, f"import cycles between tasks/ packages (package: its imports that lead back to it): {cyclic}"


def test_the_package_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The check above fails on two packages that import each other, one of them only under TYPE_CHECKING."""
    for pkg, other in (("a", "b"), ("b", "a")):
        (tmp_path / "tasks" / pkg).mkdir(parents=True)
        (tmp_path / "tasks" / pkg / "__init__.py").write_text('"""x"""\n')
        guard = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    " if pkg == "b" else ""
        (tmp_path / "tasks" / pkg / "m.py").write_text(f"{guard}from tasks.{other}.m import X\n")
    (tmp_path / "tasks" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    try:
        test_no_import_cycle_between_the_packages_under_tasks()
    except AssertionError as err:
        assert "tasks.a" in str(err) and "tasks.b" in str(err)
    else:
        raise AssertionError("a cycle between two packages went unseen")
