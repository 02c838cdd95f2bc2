"""Crash-safe resume: SIGKILL a run during training, resume it, and get what an uninterrupted run gets.

A run with DOTS, Rollout Replay, PODS, ScalingRL, GAIN-RL and the adaptive composition on (every piece of state a
checkpoint holds), overlapped (``overlap.lag=1``, set: the next step's rollouts are always in flight while
a step updates, and a checkpoint holds the drawn, untrained ones), trains 6 steps in rounds of 3 with checkpoints
every 2 steps (at steps 2, 3, 4 and 6). The test

1. runs it uninterrupted (root A);
2. runs it again in root B and SIGKILLs the whole process group once ``metrics.jsonl`` shows k finished
   steps, k drawn from 1..4 (``RLSIFT_TEST_KILL_AT`` fixes it): k = 1 usually dies before the first
   checkpoint (a resume from step 0), larger k mid-round or at a round boundary;
3. resumes it with ``rlsift run --resume RUN_ID``;

and checks that B's ledger has every step's selections, groups and reference rows exactly once and equal to
A's, that metrics.jsonl and the MLflow history hold each step once with A's values, that B continued the
same MLflow run, and that the final weights and evaluation equal A's bit for bit (CPU, one thread, every
random draw seeded from (seed, step, purpose) and the RNG states in the checkpoint). The cost figures count the
crashed process's stages once: no stage metric is logged twice at step 0, the ingest cost is in every later step's
totals (also after a kill before the first checkpoint), and the killed process's Prefect flow run ends Crashed.
The resume removes the multiprocessing folder (a listener socket) the killed generator left in the temporary
directory, and every step reports the peak-memory phases an uninterrupted run's does.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.config import ConfigError
from tasks.preflight import resume_config
from tasks.records.ledger import Ledger
from tasks.records.tracking import metric_history
from tasks.run import open_run
from tests.flows.conftest import ROOT, cli_env, easy_overrides, rlsift

STATEFUL = ["select.method=dots", "calibrate.k=8", "calibrate.g=4", "select.predictor.min_labels=8",
            "select.predictor.fit_steps=5", "replay.enabled=true", "replay.fresh_frac=0.5", "pods.enabled=true",
            "pods.m=2", "rollout.n=4", "rollout.max_new_tokens=32", "curriculum.enabled=true", "gain.enabled=true",
            "adapt.enabled=true", "adapt.low=0.0", "adapt.high=1.0", "adapt.momentum=0.5",
            "train.steps=6", "train.round_steps=3", "train.checkpoint_every=2", "train.prompts_per_step=6",
            "eval.every=2", "eval.samples=0", "model.threads=1", "overlap.lag=1",
            "seed=3"]  # the easy task's groups are mostly all right: seed 3's draws give replay informative groups
STEPS = 6
TINY = ROOT / "tests" / "fixtures" / "tiny.yaml"
#: metrics that depend on the clock, not on the computation
CLOCK = ("time/", "cost/", "rollout/tokens_per_s", "perf/", "overlap/", "memory/")


def args(root: Path, easy) -> list[str]:
    """``easy``: the easy task's (data folder, policy folder), then any further overrides."""
    return ["-c", str(TINY), *easy_overrides(*easy[:2]), *STATEFUL, *easy[2:], f"paths.root={root}"]


def ledger_rows(root: Path, table: str, order: str) -> list[dict]:
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        rows = led.query(f"SELECT * FROM {table} ORDER BY {order}")
    return [{k: v for k, v in r.items() if k not in ("run_id", "logged_at")} for r in rows]


def step_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in rows]


def signal_during_training(root: Path, argv: list[str], env: dict, after_steps: int, sig: int = signal.SIGKILL,
                           group: bool = True, within_s: float = 300) -> tuple[subprocess.Popen, str, str, str]:
    """Start ``rlsift run ... --json`` in a session of its own, send ``sig`` once ``metrics.jsonl`` shows
    ``after_steps`` finished steps (to its process group, as a terminal's Ctrl-C does, or to it alone), wait up to
    ``within_s`` seconds for it to end (``subprocess.TimeoutExpired`` past that). Returns the process, the run id,
    and its stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", *argv, "--json"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            files = list((root / "runs").glob("*/metrics.jsonl")) if (root / "runs").exists() else []
            if files and len(files[0].read_text().splitlines()) >= after_steps:
                (os.killpg if group else os.kill)(proc.pid, sig)
                break
            assert proc.poll() is None, f"run ended before the signal: {proc.stderr.read().decode()[-3000:]}"
            time.sleep(0.02)
        else:
            raise TimeoutError("training did not start in time")
        out, err = proc.communicate(timeout=within_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, files[0].parent.name, out.decode(), err.decode()


def kill_during_training(root: Path, argv: list[str], env: dict, after_steps: int) -> str:
    proc, run_id, *_ = signal_during_training(root, argv, env, after_steps)
    assert proc.returncode == -signal.SIGKILL
    return run_id


def memory_phases(run_dir: Path) -> list[list[str]]:
    """Each step's ``memory/<phase>_peak_mb`` keys in metrics.jsonl (their values are the clock's, the keys not)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [sorted(k for k in r if k.startswith("memory/")) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, easy_task, lora):
    """Every weight trained, or LoRA adapters (``model.lora``: the checkpoint holds the adapters and their AdamW
    state; the final model is the merged one)."""
    (tmp_path / "tmp").mkdir()
    env = cli_env(tmp_path, TMPDIR=str(tmp_path / "tmp"))  # the kill leaves the generator's pymp-* folder there
    if lora:
        easy_task = (*easy_task, "model.lora.enabled=true", "model.lora.rank=4", "train.lr=1e-3")
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    plain = {k: v for k, v in env.items() if k != "CI"}  # the uninterrupted run: not a terminal, not CI
    done = rlsift("run", *args(root_a, easy_task), "--json", env=plain)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = json.loads(done.stdout)
    assert not any(noise in done.stderr for noise in ("\r", "%|", "it/s]")), "progress bars off a terminal"

    k = int(os.environ.get("RLSIFT_TEST_KILL_AT") or random.randint(1, 4))
    print(f"killing after {k} finished steps")
    run_id = kill_during_training(root_b, args(root_b, easy_task), env, k)
    run_dir = root_b / "runs" / run_id
    ckpt = (run_dir / "checkpoints" / "latest").read_text().strip() if (run_dir / "checkpoints" / "latest").exists() \
        else "none"
    print(f"killed run {run_id} with {len((run_dir / 'metrics.jsonl').read_text().splitlines())} steps logged, "
          f"checkpoint {ckpt}")
    with Ledger(root_b / "ledger.duckdb", read_only=True) as led:
        crashed = led.query("SELECT status, mlflow_run_id FROM runs WHERE run_id = ?", [run_id])[0]
    assert crashed["status"] == "running"
    # the SIGKILLed generator's temporary folder (on a GPU it holds the listener its replies' tensors are shared
    # through; a CPU's replies are copied, tasks/overlap/generator_process.py, so its folder is empty)
    assert list((tmp_path / "tmp").glob("pymp-*")), "the SIGKILLed generator's temporary folder"

    resumed = rlsift("run", "--resume", run_id, *args(root_b, easy_task), "--json", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not any(noise in resumed.stderr for noise in ("\r", "%|", "it/s]")), "progress bars in CI"
    res = json.loads(resumed.stdout)
    assert res["status"] == "completed" and res["resumed"] and res["run_id"] == run_id
    assert res["mlflow_run_id"] == crashed["mlflow_run_id"], "the resume must continue the same MLflow run"

    # ledger: every step exactly once, equal to the uninterrupted run
    for table, order in (("groups", "step, prompt_id, replayed, from_step"), ("selections", "step, prompt_id"),
                         ("reference", "step, prompt_id, round"), ("evals", "phase, step, grp")):
        a, b = ledger_rows(root_a, table, order), ledger_rows(root_b, table, order)
        assert a == b, f"{table} differs after resume"
    groups = ledger_rows(root_b, "groups", "step")
    assert sorted({g["step"] for g in groups}) == list(range(STEPS))
    assert any(g["replayed"] for g in groups), "the replay buffer should have been used"
    assert any(0 < g["successes"] < g["n"] for g in groups), "mixed rewards expected from the easy task"

    # metrics.jsonl and MLflow: each step once, with the uninterrupted run's values
    got, want = step_metrics(run_dir), step_metrics(root_a / "runs" / ref["run_id"])
    differ = [(m["step"], k) for m, w in zip(got, want, strict=True) for k in m.keys() | w.keys()
              if m.get(k) != w.get(k) and not (m.get(k) != m.get(k) and w.get(k) != w.get(k))]  # NaN equals NaN
    assert len(got) == len(want) and not differ, differ
    phases, want_phases = memory_phases(run_dir), memory_phases(root_a / "runs" / ref["run_id"])
    if ckpt == "none":  # step 0 holds the stages the resume redid; those it found on disk it did not measure again
        assert set(phases[0]) <= set(want_phases[0])
        phases, want_phases = phases[1:], want_phases[1:]
    assert phases == want_phases  # the resumed step's too: its checkpoint's peak, no redone stage's
    for key in ("train/reward_mean", "train/effective_ratio", "select/entropy", "replay/size", "eval/accuracy"):
        hist_a = metric_history(ref["tracking_uri"], ref["mlflow_run_id"], key)
        hist_b = metric_history(res["tracking_uri"], res["mlflow_run_id"], key)
        assert hist_a == hist_b, key
    steps = [s for s, _ in metric_history(res["tracking_uri"], res["mlflow_run_id"], "train/reward_mean")]
    assert steps == list(range(STEPS))
    assert not (run_dir / "outbox.jsonl").exists()
    assert not list((tmp_path / "tmp").glob("pymp-*")), "the resume removes what the killed run left"

    # the same final model and evaluation, bit for bit
    wa = load_file(Path(ref["model_path"]) / "model.safetensors")
    wb = load_file(Path(res["model_path"]) / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    assert ref["eval_by_level_end"] == res["eval_by_level_end"]
    assert ref["eval_accuracy_end"] == res["eval_accuracy_end"]

    # cost: the same MLflow points as the uninterrupted run (values are wall-clock), redone work counted once
    for key in ("time/prepare_s", "time/ingest_s", "cost/device_hours", "time/checkpoint_s"):
        steps_a = [s for s, _ in metric_history(ref["tracking_uri"], ref["mlflow_run_id"], key)]
        steps_b = [s for s, _ in metric_history(res["tracking_uri"], res["mlflow_run_id"], key)]
        assert steps_a == steps_b, key
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with Ledger(root_b / "ledger.duckdb", read_only=True) as led:
        stage_s = led.stage_seconds(run_id)
    assert rows[-1]["time/ingest_s"] == pytest.approx(stage_s["ingest"]) and stage_s["ingest"] > 0
    assert rows[-1]["time/prepare_s"] == pytest.approx(stage_s["prepare"])
    for key in ("cost/device_hours", "time/checkpoint_s"):
        values = [r.get(key, 0.0) for r in rows]
        assert values == sorted(values), f"{key} must not fall across the resume"
    assert res["stage_seconds"]["prepare"] == pytest.approx(stage_s["prepare"])

    # Prefect (A's runs and B's share its state): the killed process's flow run ended Crashed, the others Completed
    states = subprocess.run([sys.executable, "-c", FLOW_STATES], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert sorted(json.loads(states.stdout.splitlines()[-1])) == ["COMPLETED", "COMPLETED", "CRASHED"], \
        states.stderr[-2000:]


FLOW_STATES = """
import json
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    print(json.dumps([r.state_type.value for r in client.read_flow_runs()]))
"""


def test_a_resume_keeps_the_stored_config(smoke_cfg, tmp_path):
    """``--resume`` uses the run's config.json; overrides may only move paths or change how it runs."""
    run = open_run(smoke_cfg("train.steps=6", "select.method=dots"), track=False)
    run.close("failed", {})
    root = f"paths.root={tmp_path / 'root'}"
    cfg = resume_config(None, [root], run.run_id)  # no -c: the defaults differ, the stored config wins
    assert cfg.train.steps == 6 and cfg.select.method == "dots" and cfg.data.sources[0].n_train == 120
    cfg = resume_config(str(TINY), [root, "train.steps=6", "model.threads=1"], run.run_id)
    assert cfg.model.threads == 1 and cfg.train.steps == 6  # an equal value and an allowed change
    with pytest.raises(ConfigError, match="train.steps differ from the run's stored config"):
        resume_config(None, [root, "train.steps=8"], run.run_id)
    with pytest.raises(ConfigError, match="no run nope under"):
        resume_config(None, [root], "nope")


def test_a_resumed_flow_run_shows_the_runs_own_config_and_overrides(smoke_cfg, tmp_path):
    """The run keeps the config file and overrides it was started with (info.json); a resume's flow run parameters
    are those, then what the resume adds (allowed: paths, how it runs), not the resume command's defaults."""
    from flows.pipeline import resumed_parameters
    from tasks.run import RunInfo

    run = open_run(smoke_cfg(), track=False)
    run.info = replace(run.info, config="conf/smoke.yaml", overrides=("plan.auto=true", "paths.root=/tmp/x"))
    run.save_info()
    run.close("cancelled", {})
    info = RunInfo.load(run.dir / "info.json")
    assert (info.config, info.overrides) == ("conf/smoke.yaml", ("plan.auto=true", "paths.root=/tmp/x"))
    assert resumed_parameters(info, ["paths.root=/tmp/x", "model.threads=1"], run.run_id) == {
        "config": "conf/smoke.yaml", "overrides": ["plan.auto=true", "paths.root=/tmp/x", "model.threads=1"],
        "resume": run.run_id}
    assert resumed_parameters(RunInfo(), ["paths.root=/tmp/x"], run.run_id) is None  # an older run's: unknown
    older = tmp_path / "info.json"  # written before rlsift kept them
    older.write_text(json.dumps({"policy_path": "/m", "data_fingerprint": None, "flow": None, "parent_version": None,
                                 "parent_path": None, "flow_run_id": None}))
    assert RunInfo.load(older) == RunInfo(policy_path="/m")


def test_finished_rounds_stay_completed_when_the_train_stage_stops(prefect_harness):
    """A round task nested in the train stage's is by Prefect's default committed with its parent's transaction, so
    a stop rolls finished rounds back ("RolledBack" in the UI) though their checkpoints are kept. The train stage's
    runner (tasks/stages.py ``run_round``) commits each round as it ends: finished rounds stay Completed. The same
    rounds run as plain task runs roll back, which shows the API has recorded the rollbacks before it is read. The
    flow run's parameters are set to a resume's own (flows/pipeline.py ``show_parameters``)."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import show_parameters
    from tasks.stages import round_task, run_round

    ran = []

    @task(cache_policy=NO_CACHE, persist_result=False, task_run_name="train-{runner_name}")
    def train(runner, runner_name: str) -> None:
        for r in range(2):
            runner(r, lambda r=r: ran.append((runner_name, r)))
        raise KeyboardInterrupt  # what a Ctrl-C raises in round 2

    @flow
    def stopped(config: str = "conf/presets/auto.yaml", overrides: list[str] | None = None,
                resume: str | None = None) -> str:
        from prefect.runtime import flow_run

        show_parameters({"config": "conf/smoke.yaml", "overrides": ["plan.auto=true"], "resume": resume})
        for runner, name in ((run_round, "committed"), (round_task, "plain")):
            try:
                train(runner, name)
            except KeyboardInterrupt:
                pass
        return flow_run.get_id()

    flow_run_id = stopped(resume="abc")
    assert ran == [("committed", 0), ("committed", 1), ("plain", 0), ("plain", 1)]
    with get_client(sync_client=True) as client:
        params = client.read_flow_run(flow_run_id).parameters
        assert params == {"config": "conf/smoke.yaml", "overrides": ["plan.auto=true"], "resume": "abc"}
        deadline = time.time() + 60
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            parents = {r.id: r.name for r in runs if r.name.startswith("train-")}
            rounds = {}
            for r in runs:
                if r.name.startswith("round-"):
                    parent = next((parents[i.id] for ins in r.task_inputs.values() for i in ins
                                   if getattr(i, "id", None) in parents), None)
                    rounds[(parent, r.name)] = r.state.name if r.state is not None else None  # not yet written
            if [rounds.get(("train-plain", f"round-{i}")) for i in range(2)] == ["RolledBack"] * 2 \
                    or time.time() > deadline:
                break
            time.sleep(0.5)
    assert rounds == {("train-committed", "round-0"): "Completed", ("train-committed", "round-1"): "Completed",
                      ("train-plain", "round-0"): "RolledBack", ("train-plain", "round-1"): "RolledBack"}, rounds


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "failed"])
def test_the_printed_command_pasted_in_another_folder_finishes_the_run(tmp_path, how):
    """A user runs the README's ``.venv/bin/rlsift run`` without activating the venv, in their project folder, with a
    config that names its data, root and cache by relative paths; the run is stopped (SIGTERM) or fails (its overlap
    generator process killed after round 0: one line on the terminal, its cause and the command, no traceback). The
    command it printed, pasted as printed in another folder with no venv on the PATH, finishes the run, and the
    resumed run ends without the temporary Prefect server's shutdown tracebacks."""
    import psutil

    from tasks.data import arith
    from tests.test_cli import venv_script

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    venv_script(project)
    elsewhere.mkdir()
    (project / "data").mkdir()
    for split, n in (("train", 40), ("test", 8)):
        rows = arith.generate(0, n, split, {1: 0.5, 2: 0.5})
        (project / "data" / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": r.question, "answer": r.answer, "level": r.level}) + "\n" for r in rows))
    (project / "my.yaml").write_text(
        f"base: {TINY}\npaths: {{root: runs-root, cache: cache}}\ndata:\n  sources:\n"
        "    - {kind: file, path: data/train.jsonl, reward: arith}\n"
        "    - {kind: file, path: data/test.jsonl, reward: arith}\n")
    (tmp_path / "tmp").mkdir()
    env = {**cli_env(tmp_path, TMPDIR=str(tmp_path / "tmp")), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([".venv/bin/rlsift", "run", "-c", "my.yaml", "overlap.lag=1", "train.steps=4",
                                 "train.round_steps=2", "train.checkpoint_every=2", "model.threads=1"], cwd=project,
                                env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not list((project / "runs-root" / "runs").glob("*/checkpoints/latest")):  # round 0 is done
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.05)
        if how == "stopped":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            trainer = psutil.Process(proc.pid)  # the generator: forked (its cmdline the trainer's) or spawned
            (generator,) = [c for c in trainer.children(recursive=True)
                            if "spawn_main" in " ".join(c.cmdline()) or c.cmdline() == trainer.cmdline()]
            generator.kill()
        assert proc.wait(timeout=300) == (128 + signal.SIGTERM if how == "stopped" else 1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = (tmp_path / "stderr").read_text()
    lines = [x for x in said.splitlines() if " run --resume " in x]
    assert len(lines) == 1, said[-5000:]
    if how == "failed":
        assert "Traceback" not in said and "GeneratorDied: the generator process" in lines[0], said[-5000:]
    (command,) = re.findall(r"`([^`]+ run --resume [^`]+)` (?:finishes|continues) it", lines[0])
    assert command.startswith(f"{project / '.venv' / 'bin' / 'rlsift'} run --resume "), command

    resumed = subprocess.run(command, shell=True, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert " completed in " in resumed.stdout and "4 steps" in resumed.stdout, resumed.stdout
    for noise in ("Traceback", "sqlalchemy", "Exception during reset"):
        assert noise not in resumed.stderr, resumed.stderr[-3000:]
    assert not list(elsewhere.iterdir()), "the resume wrote nothing where it was pasted"
