"""infra/gpu-check.sh keeps its limits, and every tool under infra/ (and TRL's control arm) runs under the runs'
attention guard; infra/learning-check.py's CPU twin learns on massive-activation weights."""

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Calls that build a model a tool then runs passes through.
BUILDERS = re.compile(r"ForCausalLM\(|load_policy\(|build_tiny_model\(|from_pretrained\(|policy_of\(|"
                      r"build_updater\(|\bbuild\(|\.build\(")
#: Tools that build a model and do not take the runs' guard, and why.
EXEMPT = {
    "infra/attention-check.py": "it turns cuDNN SDPA on and off itself, per variant: the check of the bug",
    "infra/fits-table.py": "its models are on the meta device: no pass runs",
}


def _calls_guard(source: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "guard_attention"
               for n in ast.walk(ast.parse(source)))


def test_every_tool_that_builds_a_model_takes_the_attention_guard():
    """Each Python tool under infra/ that builds a model, TRL's control arm and gpu-run.sh's embedded benchmark
    call tasks.model.attention.guard_attention (cuDNN SDPA off on CUDA), as runs do; a process of its own (the
    overlap's sampler) calls it itself."""
    tools = sorted(ROOT.glob("infra/*.py")) + [ROOT / "tasks" / "bench" / "trl_control.py"]
    building = [p for p in tools if BUILDERS.search(p.read_text())]
    assert {"lora-speed.py", "gpu_bench_generation.py", "gpu-bench.py", "learning-check.py",
            "trl_control.py"} <= {p.name for p in building}
    unguarded = [str(p.relative_to(ROOT)) for p in building
                 if not _calls_guard(p.read_text()) and str(p.relative_to(ROOT)) not in EXEMPT]
    assert not unguarded, f"these build a model without guard_attention: {unguarded}"
    for path in ("infra/gpu_bench_overlap.py", "infra/gpu_bench_generation.py"):  # the sampler processes
        tree = ast.parse((ROOT / path).read_text())
        workers = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name.startswith("_sampler")]
        assert workers and all(_calls_guard(ast.unparse(f)) for f in workers), path
    heredoc = (ROOT / "infra" / "gpu-run.sh").read_text()
    assert "load_policy(" in heredoc and "guard_attention(device)" in heredoc


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``RLSIFT_CHECK_TAG=tag``."""
    out = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"RLSIFT_CHECK_TAG={tag}".encode() in env.read_bytes().split(b"\0"):
                out.append(int(env.parent.name))
        except OSError:
            pass
    return out


def test_a_part_that_hangs_is_killed_at_its_limit_and_the_others_results_are_kept(tmp_path):
    """``update`` hangs on purpose (it ignores SIGTERM and leaves a child in a session of its own) under a 4 s limit
    and a 2 s grace: the check ends it within limit + grace, kills the child too, writes its verdict line at once
    and goes on to ``attention``, whose result is kept after it."""
    env = {**os.environ, "CHECK_DEVICE": "cpu", "CHECK_HANG": "update", "LIMIT_update": "4", "GRACE": "2",
           "OUT": str(tmp_path), "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(ROOT / "infra" / "gpu-check.sh"), "update", "attention"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    took = time.monotonic() - t0
    assert proc.returncode == 1, out  # a part failed
    verdicts = (tmp_path / "verdicts.txt").read_text().splitlines()
    assert verdicts[0].startswith("== gpu-check on cpu")
    hung = re.fullmatch(r"update: KILLED at its limit in (\d+) s of 4 s \(1 stray process killed\): "
                        r"hanging on purpose", verdicts[1])
    assert hung and int(hung.group(1)) <= 4 + 2 + 2, verdicts  # the limit, the grace, a second of slack each
    assert verdicts[2].startswith("attention: ok in ") and "verdict" not in verdicts[2], verdicts
    assert "every variant finite" in verdicts[2]  # the part's own verdict line, after the killed one
    assert (tmp_path / "update.log").read_text().startswith("hanging on purpose")
    assert out.count("update: KILLED") == 1 and "== attention" in out
    assert not _tagged(f"rlsift-check-{proc.pid}-update"), "a process of the killed part outlived it"
    assert took < 300


def test_a_check_stopped_midway_takes_its_running_part_and_the_parts_strays_with_it(tmp_path):
    """SIGTERM to the check while ``update`` hangs (it ignores SIGTERM, its child sits in a session of its own):
    the check says it was interrupted, exits 130 at once, and leaves no process that carries the part's tag."""
    env = {**os.environ, "CHECK_DEVICE": "cpu", "CHECK_HANG": "update", "LIMIT_update": "120", "OUT": str(tmp_path),
           "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(["bash", str(ROOT / "infra" / "gpu-check.sh"), "update", "attention"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "update.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "hanging on purpose" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert (tmp_path / "verdicts.txt").read_text().splitlines()[-1] == "gpu-check: interrupted"
    assert "== attention" not in out
    tag, deadline = f"rlsift-check-{proc.pid}-update", time.monotonic() + 30
    while _tagged(tag) and time.monotonic() < deadline:  # a SIGKILLed process may take a moment to go
        time.sleep(0.2)
    assert not _tagged(tag), "a process of the stopped part outlived the check"


def test_reap_kills_every_tagged_process_and_counts_only_those_outside_the_parts_group(tmp_path):
    """gpu-check.sh's ``reap``, run on its own: two tagged processes, one still in the part's process group (as a
    member the group's SIGKILL reached but that has not finished exiting looks) and one in a session of its own.
    Both are killed; only the second is a stray (CI once saw "2 stray processes" for one)."""
    script = (ROOT / "infra" / "gpu-check.sh").read_text()
    reap = re.search(r"^reap\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    tag = f"rlsift-reap-test-{os.getpid()}"
    env = {**os.environ, "RLSIFT_CHECK_TAG": tag}
    member = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)  # the part: its group is its pid
    stray = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    try:
        out = subprocess.run(["bash", "-c", f"{reap}\nreap {tag} {member.pid}"], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items() if k != "RLSIFT_CHECK_TAG"})
        assert out.stdout.strip() == "1", out
        assert member.wait(timeout=10) == -9 and stray.wait(timeout=10) == -9
    finally:
        member.kill()
        stray.kill()


def test_the_learning_check_learns_on_massive_activation_weights(capsys):
    """The CPU twin of infra/learning-check.py on the injected weights: the outlier channels reach the size asked
    for, one head's log-sum-exp is far below -88.7, every step is finite and the loss falls, rlsift's float32
    gradient is plain transformers' and its bf16 error is theirs."""
    import runpy

    import torch

    threads = torch.get_num_threads()
    check = runpy.run_path(str(ROOT / "infra" / "learning-check.py"), run_name="learning_check")
    try:
        rc = check["main"](["--toy", "--weights", "massive", "--rows", "8", "--compare-rows", "8", "--steps", "3",
                            "--completion", "24"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0, out
    injected = re.search(r"reach \|h\| ([\d,]+), lowest attention log-sum-exp (-[\d.]+)", out)
    assert float(injected.group(1).replace(",", "")) >= 0.9 * 3000 and float(injected.group(2)) < -100
    steps = [ln for ln in out.splitlines() if re.match(r"\| \d \| ", ln)]
    assert len(steps) == 3 and all("| yes |" in s for s in steps)
    losses = [float(s.split("|")[2]) for s in steps]
    assert losses[-1] < losses[0]
    same = float(re.search(r"float32 against plain transformers' \(a row at a time\) ([\d.e+-]+);", out).group(1))
    assert same < 1e-4
    assert out.strip().splitlines()[-1].startswith("verdict: learns: massive: loss ")


def test_the_prefix_part_runs_the_update_with_one_prompt_a_group(tmp_path):
    """``prefix`` (not in the default list): the update part's arm with train.shared_prefix on, its CPU twin."""
    env = {**os.environ, "CHECK_DEVICE": "cpu", "OUT": str(tmp_path), "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "infra" / "gpu-check.sh"), "prefix"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    verdict = (tmp_path / "verdicts.txt").read_text().splitlines()[1]
    assert verdict.startswith("prefix: ok in ") and "2 of 2 arms finite" in verdict, verdict
    rows = [line.split("|") for line in (tmp_path / "prefix.log").read_text().splitlines()
            if line.startswith("| toy")]
    assert len(rows) == 2 and all(r[5] == r[6] for r in rows)  # packed passes: no padded tokens beside the real
