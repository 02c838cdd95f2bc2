"""The command line: `run --json` contract, `ingest --json` counts, config errors before any work (and before the
heavy imports), the ledger's commands, the resume command a stopped run prints."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "sources"


def rlsift(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "CI": "true"})


def test_run_json_contract(tmp_path):
    p = rlsift("run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={tmp_path}", "train.steps=2", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)  # exactly one JSON object on stdout
    for key in ("run_id", "mlflow_run_id", "status", "steps", "eval_accuracy_start", "eval_accuracy_end", "wall_s",
                "device_hours"):
        assert key in out, key
    assert out["status"] == "completed" and out["steps"] == 2
    assert Path(out["ledger"]).exists()
    assert "\r" not in p.stderr, "no progress bars outside a terminal"

    # the ledger answers as tables, with the figures a user compares, and tells its empty cases apart
    runs = rlsift("ledger", "runs", "--root", str(tmp_path))
    assert runs.returncode == 0, runs.stderr[-2000:]
    header, row = runs.stdout.splitlines()[:2]
    assert header.split() == ["run", "status", "started", "what", "steps", "accuracy", "usd", "version"]
    assert out["run_id"] in row and "grpo bundled:default s0" in row and "0.000 -> 0.000" in row
    unknown = rlsift("ledger", "why", "--root", str(tmp_path), "--run", out["run_id"], "--prompt", "zzzz")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert unknown.stderr.strip().startswith("no prompt id starts with 'zzzz'")
    unknown_json = rlsift("ledger", "why", "--root", str(tmp_path), "--run", out["run_id"], "--prompt", "zzzz",
                          "--json")
    assert unknown_json.returncode == 1 and json.loads(unknown_json.stdout) == []
    ledger_rows = json.loads(rlsift("ledger", "sql", "--root", str(tmp_path), "--json", "--sql",
                                    "SELECT prompt_id FROM prompts WHERE split = 'test' LIMIT 1").stdout)
    never = rlsift("ledger", "why", "--root", str(tmp_path), "--run", out["run_id"], "--prompt",
                   ledger_rows[0]["prompt_id"])
    assert never.returncode == 0 and "was never selected in run" in never.stdout
    # a uniform draw: no columns of signals it did not use, floats to three decimals in the table
    picked = json.loads(rlsift("ledger", "sql", "--root", str(tmp_path), "--json", "--sql",
                               "SELECT prompt_id FROM selections LIMIT 1").stdout)[0]["prompt_id"]
    for argv in (("why", "--prompt", picked), ("round", "--round", "0")):
        shown = rlsift("ledger", *argv, "--root", str(tmp_path), "--run", out["run_id"])
        assert shown.returncode == 0, shown.stderr[-2000:]
        header, first = shown.stdout.splitlines()[:2]
        assert "selector" in header and "weight" in header and "uniform" in first
        assert "angle_score" not in header and "gain_rank" not in header
        got = json.loads(rlsift("ledger", *argv, "--root", str(tmp_path), "--run", out["run_id"], "--json").stdout)
        assert got and not {"angle_score", "gain_rank"} & set(got[0]) and got[0]["selector"] == "uniform"
        weight = first.split()[header.split().index("weight")]  # 1/120 of the pool: 0.00833, not 0.008333333333
        assert weight == f"{got[0]['weight']:.3g}" and len(weight) <= 7, weight

    # resuming a completed run, or an unknown one, is refused before any work: one line, exit 2
    again = rlsift("run", "--resume", out["run_id"], f"paths.root={tmp_path}", "--json")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"run {out['run_id']} already completed: nothing to resume" in again.stderr
    assert json.loads(again.stdout)["status"] == "error"
    unknown = rlsift("run", "--resume", "nope", f"paths.root={tmp_path}")
    assert unknown.returncode == 2 and "no run nope under" in unknown.stderr and "Traceback" not in unknown.stderr


def test_ledger_questions_about_an_unknown_run_are_errors(tmp_path, capsys):
    """`ledger why` / `ledger round` of a run the ledger lacks: exit 1, naming the runs it has (the newest 10)."""
    from flows.cli import main
    from tasks.records.ledger import Ledger

    root = tmp_path / "root"
    asks = (("why", "--prompt", "ab"), ("round", "--round", "0"))
    Ledger(root / "ledger.duckdb").close()
    for argv in asks:
        assert main(["ledger", *argv, "--run", "nosuchrun", "--root", str(root)]) == 1
        out, err = capsys.readouterr()
        assert out == "" and "no run 'nosuchrun' in" in err and "it has no runs yet" in err
    with Ledger(root / "ledger.duckdb") as led:
        for i in range(12):
            led.start_run(f"run{i:02d}", {}, None)
    for argv in asks:
        assert main(["ledger", *argv, "--run", "nosuchrun", "--root", str(root)]) == 1
        out, err = capsys.readouterr()
        assert out == "" and "no run 'nosuchrun'" in err and "run11" in err and "and 2 older" in err, err
        assert "run02" in err and "run01" not in err and "run00" not in err  # the newest 10
        assert main(["ledger", *argv, "--run", "nosuchrun", "--root", str(root), "--json"]) == 1
        assert json.loads(capsys.readouterr().out) == []
    assert main(["ledger", "round", "--round", "0", "--run", "run03", "--root", str(root)]) == 0  # known, no rows
    assert "round 0 of run run03 (steps 0-" in (out := capsys.readouterr().out) and "is not committed yet" in out


def test_plan_prints_the_choice_and_trains_nothing(tmp_path):
    # overlap.lag=0: the overlap's split is not what this test checks (tests/tasks/test_plan_probe.py times it)
    args = ("-c", "tests/fixtures/tiny.yaml", f"paths.root={tmp_path}", "plan.candidates=[grpo_n4]", "overlap.lag=0")
    p = rlsift("plan", *args, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["plan"]["choice"] in {"grpo", "grpo_n4"} and out["plan"]["reason"].startswith(out["plan"]["choice"])
    assert [x["name"] for x in out["plan"]["predictions"]] == ["grpo_n4"]
    assert Path(out["run_dir"], "plan.md").is_file()
    text = rlsift("plan", *args)
    assert text.returncode == 0, text.stderr[-3000:]
    lines = text.stdout.splitlines()  # plain on a terminal: no Markdown, the table's columns aligned
    assert lines[0].startswith("plan: ") and "|" not in text.stdout and "**" not in text.stdout, text.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("composition  chosen  "))
    names = [line[:len("composition  ")] for line in lines[header + 1:header + 3]]
    assert names == ["grpo".ljust(13), "grpo_n4".ljust(13)], lines
    assert (Path(json.loads(p.stdout)["run_dir"]) / "plan.md").read_text().startswith("**Plan: ")  # files keep it
    bad = rlsift("plan", "-c", "tests/fixtures/tiny.yaml", f"paths.root={tmp_path}", "plan.min_signal=2")
    assert bad.returncode == 2 and "plan.min_signal" in bad.stderr


def test_config_error_names_key_and_does_no_work(tmp_path):
    p = rlsift("run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={tmp_path}", "train.stepz=2", "--json")
    assert p.returncode == 2
    assert "train.stepz: unknown key" in p.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written before the config is valid"


def test_ingest_json_counts(tmp_path):
    bad = tmp_path / "bad_train.jsonl"
    bad.write_text('{"question": "q?", "answer": "#### 3"}\n{oops\n{"question": "q?", "answer": "#### 3"}\n')
    p = rlsift("ingest", str(FIX / "gsm8k_train.jsonl"), str(bad), "--format", "gsm8k", "--set",
               f"paths.root={tmp_path / 'root'}", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["accepted"] + out["duplicates"] + out["quarantined"] == sum(s["rows"] for s in out["sources"].values())
    assert out["sources"][str(bad)] == {"rows": 3, "accepted": 1, "duplicates": 1, "quarantined": 1, "new": 1}
    # one override syntax for every command: positional key=value, or the root from RLSIFT_ROOT
    again = rlsift("ingest", str(bad), "--format", "gsm8k", f"paths.root={tmp_path / 'root'}", "--json")
    assert json.loads(again.stdout)["sources"][str(bad)]["new"] == 0  # the same ledger: nothing new
    text = rlsift("ingest", str(bad), "--format", "gsm8k", f"paths.root={tmp_path / 'root'}")
    assert f"{bad}: 3 rows, 1 accepted (0 new to the ledger), 1 duplicates, 1 quarantined" in text.stdout  # says so
    import os

    env = {**os.environ, "CI": "true", "RLSIFT_ROOT": str(tmp_path / "root")}
    runs = subprocess.run([sys.executable, "-m", "flows.cli", "ledger", "sql", "--json", "--sql",
                           "SELECT count(*) AS n FROM ingests"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert json.loads(runs.stdout) == [{"n": 4}], runs.stderr[-2000:]  # 2 sources, then 1, then 1


def test_ingest_missing_file(tmp_path):
    p = rlsift("ingest", str(tmp_path / "nope.jsonl"), "--set", f"paths.root={tmp_path}", "--json")
    assert p.returncode == 2 and "nope.jsonl" in p.stderr


def test_deepspeed_goes_to_the_cpu_only_without_a_gpu(monkeypatch):
    import torch

    from flows import cli_commands

    for cuda, expected in ((False, "cpu"), (True, None)):
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        cli_commands._accelerator()
        assert __import__("os").environ.get("DS_ACCELERATOR") == expected
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")  # the user's choice wins
    cli_commands._accelerator()
    assert __import__("os").environ["DS_ACCELERATOR"] == "xpu"


def test_gpu_run_script_on_the_cpu(tmp_path):
    """infra/gpu-run.sh (the GPU check) runs end to end; on the CPU it checks the script itself."""
    import os

    env = {**os.environ, "DEVICE": "cpu", "ROOT": str(tmp_path), "PY": sys.executable, "BENCH_PROMPTS": "4",
           "BENCH_N": "2", "BENCH_TOKENS": "8", "BENCH_STEPS": "1", "CI": "true"}
    p = subprocess.run(["bash", "infra/gpu-run.sh", "tests/fixtures/tiny.yaml", "train.steps=2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["rollout_tokens"] > 0 and result["update_step_s"] > 0


def test_problems_are_found_before_any_work(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    p = rlsift("run", "-c", str(empty), "--json")
    assert p.returncode == 2 and "the config file is empty" in p.stderr
    assert json.loads(p.stdout)["status"] == "error"
    root = tmp_path / "root"
    p = rlsift("run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={root}",
               "data.sources=[{kind: file, path: /nonexistent/x.jsonl}]", "--json")
    assert p.returncode == 2 and "data.sources[0].path: /nonexistent/x.jsonl does not exist" in p.stderr
    assert "Traceback" not in p.stderr and not root.exists()
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"question": "no answer"}\nnot json\n')
    for name, says in (("empty.jsonl", "is empty"), ("bad.jsonl", "has no usable row (2 rejected; the first, line 1")):
        p = rlsift("run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={root}",
                   f"data.sources=[{{kind: file, path: {tmp_path / name}}}]", "--json")
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert json.loads(p.stdout)["status"] == "error" and not root.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    p = rlsift("run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={blocker / 'root'}")
    assert p.returncode == 2 and "paths.root: cannot create or write" in p.stderr


def test_a_failed_run_says_so_in_one_line_and_exits_1_without_duckdb_noise(tmp_path):
    """A run that fails in a stage says so in one line on the terminal: its cause, what is kept, the command that
    continues it and where the traceback is (the run's run.log, not the terminal: Prefect's reports of the failed
    task and flow runs stay off it). It closes its ledger, and no duckdb connection outlives it to the exit (which
    would print duckdb's "nanobind: leaked ... instances!" dump after the error). The model: a saved one whose weights
    file is torn (the preflight finds the folder and its config.json; loading it fails in the prepare stage)."""
    import shutil

    shutil.copytree(ROOT / "assets" / "tiny-warmstart", tmp_path / "torn-model")
    (tmp_path / "torn-model" / "model.safetensors").write_text("torn")
    p = rlsift("run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={tmp_path}", "train.steps=2",
               f"model.path={tmp_path / 'torn-model'}", "--json")
    assert p.returncode == 1, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["status"] == "failed" and "Traceback" not in p.stderr, p.stderr[-3000:]
    (line,) = [x for x in p.stderr.splitlines() if "failed" in x or "Error" in x]  # the one line of the failure
    assert f"run {out['run_id']} failed: SafetensorError: Error while deserializing header" in line
    command = shlex.join([sys.executable, "-m", "flows.cli", "run", "--resume", out["run_id"],
                          f"paths.root={tmp_path}"])
    assert f"(no checkpoint yet; `{command}` continues it; traceback in " \
           f"{tmp_path / 'runs' / out['run_id'] / 'run.log'})" in line and out["reason"] in line  # as rlsift was run
    logged = (tmp_path / "runs" / out["run_id"] / "run.log").read_text()
    assert "Traceback (most recent call last)" in logged and "Error while deserializing header" in logged
    assert "stage ingest done" in logged  # the run's log lines too
    assert "nanobind" not in p.stderr and "leaked" not in p.stderr, p.stderr[-3000:]


#: What a refusal of bad input and a ledger question must not wait for.
HEAVY = ("torch", "transformers", "prefect", "mlflow")
#: ``rlsift ARGS`` in a fresh interpreter, then one last line: its exit code and the heavy modules it imported.
PROBE = f"""
import json, sys
from flows.cli import main
rc = main(sys.argv[1:])
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""


def probe(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
    p = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CI": "true"})
    assert p.stdout.strip(), p.stderr[-3000:]
    return p, json.loads(p.stdout.strip().splitlines()[-1])


def test_bad_input_is_refused_before_the_heavy_imports(tmp_path):
    """Unknown resume id, missing file, empty file, bad key: exit 2 with the reason, and neither torch nor Prefect nor
    MLflow imported by then (what made a refusal take 20 s: it came after them and Prefect's server)."""
    root = tmp_path / "root"
    (tmp_path / "empty.jsonl").write_text("")
    cases = {"no run nope under": ("--resume", "nope"),
             "data.sources[0].path: /nonexistent/x.jsonl does not exist": (
                 "data.sources=[{kind: file, path: /nonexistent/x.jsonl}]",),
             "is empty": (f"data.sources=[{{kind: file, path: {tmp_path / 'empty.jsonl'}}}]",),
             "train.stepz: unknown key": ("train.stepz=2",)}
    for says, argv in cases.items():
        p, seen = probe("run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={root}", *argv)
        assert seen == {"rc": 2, "heavy": []}, (argv, seen, p.stderr[-2000:])
        assert says in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    p, seen = probe("plan", "train.stepz=2")
    assert seen == {"rc": 2, "heavy": []} and "train.stepz: unknown key" in p.stderr
    assert not root.exists()


def _ledger_with_a_run(root: Path, run_id: str = "r1", *overrides: str) -> dict:
    """A ledger with one run of the tiny config (``overrides`` on it), as ``open_run`` starts it; its config."""
    from tasks.config.load import load_config
    from tasks.records.ledger import Ledger

    cfg = load_config(ROOT / "tests" / "fixtures" / "tiny.yaml", list(overrides)).model_dump(mode="json")
    with Ledger(root / "ledger.duckdb") as led:
        led.start_run(run_id, cfg, None)
    return cfg


def test_the_ledger_answers_without_the_heavy_imports(tmp_path):
    """`rlsift ledger runs` imports the config, duckdb and rich only (it took 7-22 s a call during a run under load,
    mostly torch and MLflow imported to name the runs); a root without a ledger is one line, not a traceback."""
    root = tmp_path / "root"
    _ledger_with_a_run(root)
    p, seen = probe("ledger", "runs", "--root", str(root))
    assert seen == {"rc": 0, "heavy": []}, p.stderr[-2000:]
    assert "r1" in p.stdout and "running" in p.stdout and "grpo bundled:default s0" in p.stdout
    p, seen = probe("ledger", "runs", "--root", str(tmp_path / "nothing-here"))
    assert seen["rc"] == 1 and "Traceback" not in p.stderr
    assert f"no ledger at {tmp_path / 'nothing-here' / 'ledger.duckdb'}" in p.stderr


def test_each_ledger_command_has_its_own_help(capsys):
    from flows.cli import main

    helps = {}
    for name, says in (("runs", "One row per run"), ("why", "--prompt"), ("round", "--round"), ("sql", "--sql")):
        with pytest.raises(SystemExit) as done:
            main(["ledger", name, "--help"])
        assert done.value.code == 0
        helps[name] = capsys.readouterr().out
        assert helps[name].startswith(f"usage: rlsift ledger {name}") and says in helps[name], helps[name]
        assert "--root" in helps[name] and "--json" in helps[name]
    assert "--round" not in helps["why"] and "--prompt" not in helps["round"] and "--run" not in helps["runs"]
    with pytest.raises(SystemExit) as done:
        main(["ledger", "--help"])
    listed = capsys.readouterr().out
    assert done.value.code == 0 and all(name in listed for name in helps)
    with pytest.raises(SystemExit) as done:  # what a command needs is its own parser's error
        main(["ledger", "round", "--run", "r1"])
    assert done.value.code == 2 and "rlsift ledger round: error: the following arguments are required: --round" in \
        capsys.readouterr().err


def test_a_round_not_committed_yet_says_so(tmp_path, capsys):
    """Mid-round (or before the round) `ledger round` says the round is not committed yet, not that it has no
    selections; past the run's last round, that there is none; a round of a finished run without rows, that."""
    from flows.cli import main
    from tasks.records.ledger import Ledger, SelectionRow

    root = tmp_path / "root"
    _ledger_with_a_run(root, "r1", "train.steps=4", "train.round_steps=2")  # rounds 0 (steps 0-1) and 1 (2-3)

    def ask(round_: int, *extra: str) -> tuple[int, str, str]:
        rc = main(["ledger", "round", "--run", "r1", "--round", str(round_), "--root", str(root), *extra])
        out, err = capsys.readouterr()
        return rc, out, err

    assert ask(0) == (0, "round 0 of run r1 (steps 0-1) is not committed yet: the run (running) has not trained a "
                         "step yet\n", "")
    with Ledger(root / "ledger.duckdb") as led:
        led.add_selections("r1", 0, 0, [SelectionRow(prompt_id="p1", selector="uniform", weight=0.5)])
    rc, out, err = ask(0)  # its first step's rows, with a note that more are to come
    assert rc == 0 and "p1" in out and "uniform" in out
    assert err == "round 0 of run r1 (steps 0-1) is not committed yet: the run (running) has written steps up to 0 " \
                  "of 0-3\n"
    assert ask(1)[1] == "round 1 of run r1 (steps 2-3) is not committed yet: the run (running) has written steps up " \
                        "to 0 of 0-3\n"
    assert ask(1, "--json")[:2] == (0, "[]\n")  # stdout stays the JSON list
    assert ask(2)[1] == "run r1 has no round 2: it trains rounds 0-1 (4 steps)\n"
    with Ledger(root / "ledger.duckdb") as led:
        led.add_selections("r1", 0, 1, [SelectionRow(prompt_id="p2", selector="uniform", weight=0.5)])
    rc, out, err = ask(0)  # both steps written: committed, no note
    assert rc == 0 and "p1" in out and "p2" in out and err == ""
    with Ledger(root / "ledger.duckdb") as led:
        led.finish_run("r1", "completed", {})
    assert ask(1)[1] == "no selections in round 1 of run r1\n"


@pytest.mark.parametrize("case", ["plain", "paths.root", "deployment", "relative data file", "config file's paths"])
def test_the_resume_command_of_a_stop_message_resumes_the_run(tmp_path, monkeypatch, case):
    """The command a stopped run prints, pasted as printed in another folder (and another shell: no RLSIFT_ROOT),
    finds the run and its stored config: a plain run (root ./rlsift-runs of where it ran), a run with a relative
    ``paths.root=``, a deployment's flow run (run in the repository, its root from RLSIFT_ROOT), a run whose override
    names a data file by a relative path (the run stored it resolved against the folder it ran in: no ``cd``), a run
    of a config file in another folder that names its data file relative to itself (stored resolved against it)."""
    from flows import cli, cli_commands
    from flows.pipeline import stopped_note
    from tasks.preflight import RunRequest, checked_config
    from tasks.run import open_run

    ran_in, elsewhere = tmp_path / "ran-in", tmp_path / "elsewhere"
    ran_in.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(ran_in)
    monkeypatch.delenv("RLSIFT_ROOT", raising=False)
    overrides = ["train.steps=3"]
    if case == "paths.root":
        overrides.append("paths.root=roots/mine")
    if case == "deployment":
        monkeypatch.setenv("RLSIFT_ROOT", "served/runs")
    if case == "relative data file":
        (ran_in / "data").mkdir()
        (ran_in / "data" / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
        overrides.append("data.sources=[{kind: file, path: data/train.jsonl, format: gsm8k}]")
    config = str(ROOT / "tests" / "fixtures" / "tiny.yaml")
    if case == "config file's paths":  # mine/user.yaml: its base and its data file relative to itself
        (ran_in / "mine" / "data").mkdir(parents=True)
        (ran_in / "mine" / "data" / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
        user = ran_in / "mine" / "user.yaml"
        user.write_text(f"base: {os.path.relpath(config, user.parent)}\n"
                        "data: {sources: [{kind: file, path: data/train.jsonl, format: gsm8k}]}\n")
        config = str(user)
    run = open_run(checked_config(RunRequest.here(config, overrides)), track=False)
    note = stopped_note(run, signal.SIGTERM)
    run.close("cancelled", {})
    command = re.search(r"`([^`]+ run --resume [^`]+)` finishes it", note).group(1)

    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("RLSIFT_ROOT", raising=False)
    argv = shlex.split(command)
    assert argv[1:4] == ["run", "--resume", run.run_id] and os.path.isabs(argv[0]), command  # the venv's rlsift
    cfg = cli_commands.run_config(cli.parser().parse_args(argv[1:]))
    assert Path(cfg.paths.root) == run.root and cfg.train.steps == 3  # the stored config, not auto.yaml's
    if case == "relative data file":
        assert cfg.data.sources[0].path == str(ran_in / "data" / "train.jsonl")
    if case == "config file's paths":
        assert cfg.data.sources[0].path == str(ran_in / "mine" / "data" / "train.jsonl")
    os.chdir(elsewhere)
    with pytest.raises(ConfigError, match=f"no run {run.run_id} under"):  # the hint without the root did not
        cli_commands.run_config(cli.parser().parse_args(["run", "--resume", run.run_id]))


#: A stand-in for the console script pip writes into a venv's bin/ (pyproject.toml ``[project.scripts]``).
SCRIPT = """#!{python}
import sys
from flows.cli import main
if __name__ == "__main__":
    sys.exit(main())
"""


def venv_script(folder: Path) -> Path:
    """``folder/.venv/bin/rlsift``: this Python running rlsift's command line, as an installed venv's script does."""
    script = folder / ".venv" / "bin" / "rlsift"
    script.parent.mkdir(parents=True)
    script.write_text(SCRIPT.format(python=sys.executable))
    script.chmod(0o755)
    return script


def test_printed_commands_start_rlsift_as_the_user_did(tmp_path, monkeypatch):
    """``.venv/bin/rlsift`` run by a relative path, with no venv on the PATH: the printed command names the script by
    its absolute path (the bare ``rlsift`` was `command not found` there); ``python -m flows.cli``: this Python."""
    import types

    from tasks.run import launcher

    script = venv_script(tmp_path)
    script.write_text(f"#!{sys.executable}\nfrom tasks.run import resume_command\nprint(resume_command('abc', 'r'))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    p = subprocess.run([".venv/bin/rlsift"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert shlex.split(p.stdout) == [str(script), "run", "--resume", "abc", f"paths.root={tmp_path / 'r'}"]

    # pytest runs this process: the rlsift script of this Python's environment, by its full path
    assert launcher() == [str(Path(os.path.abspath(sys.executable)).with_name("rlsift"))]
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", types.SimpleNamespace(name="flows.cli"))
    assert launcher() == [sys.executable, "-m", "flows.cli"]


SHUTDOWN_NOISE = """
import asyncio, logging
from prefect.logging.configuration import setup_logging
setup_logging(incremental=False)  # as the server's process configures its logging (prefect/server/api/server.py)

def cancelled_write():
    try:
        raise asyncio.CancelledError("shutdown")
    except asyncio.CancelledError:
        raise RuntimeError("rollback failed")

for name in ("sqlalchemy.pool.impl.AsyncAdaptedQueuePool", "prefect.server.services.task_run_recorder"):
    try:
        cancelled_write()
    except RuntimeError:
        logging.getLogger(name).error("Exception during reset or similar", exc_info=True)
try:
    raise OSError("disk full")
except OSError:
    logging.getLogger("prefect.server").error("a real server error", exc_info=True)
"""


def test_the_temporary_servers_shutdown_noise_is_dropped_and_its_errors_kept(tmp_path):
    """The temporary Prefect server's logging (flows/prefect_server.py ``server_logging``): Prefect's own config with a
    filter on its terminal handler that drops the records a cancellation caused (the server's shutdown cancelling its
    services mid-write: ``sqlalchemy.pool ... Exception during reset or similar``), and keeps every other error."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_LOGGING_SETTINGS_PATH", None)
    made = subprocess.run([sys.executable, "-c", "import os; from flows.prefect_server import server_logging; "
                           "server_logging(); print(os.environ['PREFECT_LOGGING_SETTINGS_PATH'])"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert made.stdout.strip() == str(tmp_path / "home" / "rlsift-server-logging.yml"), made.stderr[-3000:]
    env["PREFECT_LOGGING_SETTINGS_PATH"] = made.stdout.strip()  # what the server's process inherits
    p = subprocess.run([sys.executable, "-c", SHUTDOWN_NOISE], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Exception during reset" not in p.stderr and "CancelledError" not in p.stderr, p.stderr
    assert "a real server error" in p.stderr and "OSError: disk full" in p.stderr


#: ``rlsift ARGS`` in a fresh interpreter that notes, at rlsift's first log line, its text and the heavy modules
#: imported by then; its last stdout line: those and the exit code.
FIRST_LINE = f"""
import json, logging, sys
seen = {{}}
class First(logging.Handler):
    def emit(self, record):
        if not seen:
            seen.update(first=record.getMessage(), heavy=sorted(m for m in {HEAVY!r} if m in sys.modules))
logging.getLogger("rlsift").addHandler(First())
from flows.cli import main
rc = main(sys.argv[1:])
print(json.dumps({{"rc": rc, **seen}}))
"""
#: A line of the terminal's log (flows/cli.py ``setup_logging``) from one of rlsift's own loggers.
OWN_LINE = re.compile(r"\d\d:\d\d:\d\d (rlsift|tasks|flows|rlcore)(\.\w+)* \S")


def test_a_run_says_what_it_loads_first_and_prints_only_its_own_lines_once(tmp_path):
    """A successful `rlsift run` (an auto run whose candidates include the baseline): its first line is rlsift's,
    naming what it loads, before torch, Prefect or MLflow is imported; every line on the terminal is rlsift's own
    (no MLflow "Creating initial MLflow database tables...", "Stopping system metrics monitoring", Prefect or
    DeepSpeed line, no Python warning: those only with -v), and none is printed twice (`plan: candidate grpo` was)."""
    p = subprocess.run([sys.executable, "-c", FIRST_LINE, "run", "-c", "tests/fixtures/tiny.yaml",
                        f"paths.root={tmp_path}", "train.steps=2", "eval.samples=0", "plan.auto=true",
                        "plan.candidates=[grpo,grpo_n4]"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "CI": "true"})
    *summary, last = p.stdout.splitlines()
    seen = json.loads(last)
    assert seen["rc"] == 0, p.stderr[-3000:]
    assert seen["first"] == "loading torch, Prefect and MLflow ..." and seen["heavy"] == [], seen
    logged = p.stderr.splitlines()
    assert logged[0].endswith(" rlsift loading torch, Prefect and MLflow ..."), logged[:3]
    foreign = [line for line in logged if not OWN_LINE.match(line)]
    assert not foreign, foreign
    said = [line[len("00:00:00 "):] for line in logged] + [line.strip() for line in summary]
    twice = sorted({line for line in said if said.count(line) > 1})
    assert not twice, twice
    assert any(line.startswith("plan: grpo") for line in said)  # the plan said once in the summary, one line
    assert not any(line.startswith("plan clock:") for line in said)
    assert sum("candidate grpo:" in line for line in said) == 1


LOG_LINES = """
import logging, sys, warnings
from flows.cli import setup_logging
setup_logging(verbose=sys.argv[1] == "-v", as_json=False)
logging.getLogger("rlsift.train").info("own info")
logging.getLogger("tasks.model.attention").warning("own warning")
logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
logging.getLogger("prefect.flow_runs").warning("a Prefect warning")
warnings.warn("a library's warning", UserWarning)
logging.getLogger("prefect.server").error("a Prefect error")
"""


@pytest.mark.parametrize("flag", ["", "-v"])
def test_other_libraries_lines_only_with_v(flag):
    """Without -v the terminal shows rlsift's lines at any level and other libraries' errors only; with -v their INFO
    and WARNING lines (and Python warnings) too."""
    p = subprocess.run([sys.executable, "-c", LOG_LINES, flag], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    said = [line.split(" ", 2)[-1] for line in p.stderr.splitlines()]  # HH:MM:SS logger message
    mine, errors = ["own info", "own warning"], ["a Prefect error"]
    foreign = ["Creating initial MLflow database tables...", "a Prefect warning"]
    assert [s for s in said if s in mine + errors + foreign] == (mine + foreign + errors if flag else mine + errors)
    assert ("a library's warning" in p.stderr) == bool(flag), p.stderr


def test_v_goes_before_or_after_the_command():
    from flows.cli import parser

    for argv in (["-v", "run"], ["run", "-v"], ["run", "--verbose", "train.steps=2"], ["-v", "ledger", "runs"]):
        assert parser().parse_known_args(argv)[0].verbose is True, argv
    assert parser().parse_known_args(["run"])[0].verbose is False


def test_deploy_prints_each_deployment_its_schedule_and_the_worker_to_start():
    """`rlsift deploy` (not 42 lines of JSON): a line per deployment with its schedule, then the next step, the worker
    command as pasted in a new shell (the server's URL and rlsift's full path with it)."""
    from flows.cli_text import deploy_text

    out = {"api_url": "http://127.0.0.1:4200/api", "work_pools": {"rlsift-process": "created"}, "skipped": {},
           "deployments": {
               "pipeline/pipeline": {"id": "1", "entrypoint": "flows/pipeline.py:pipeline",
                                     "work_pool": "rlsift-process", "schedules": [], "parameters": {}},
               "retrain/retrain": {"id": "2", "entrypoint": "flows/retrain.py:retrain", "work_pool": "rlsift-process",
                                   "schedules": [{"cron": "0 3 * * *", "active": True}], "parameters": {}}}}
    assert deploy_text(out, ["/abs/.venv/bin/rlsift"]).splitlines() == [
        "deployments on http://127.0.0.1:4200/api, work pool rlsift-process (created):",
        "  pipeline/pipeline  on demand",
        "  retrain/retrain    cron 0 3 * * *",
        "next: start the worker that runs them (Ctrl-C stops it): env PREFECT_API_URL=http://127.0.0.1:4200/api "
        "/abs/.venv/bin/rlsift worker --pool rlsift-process"]
