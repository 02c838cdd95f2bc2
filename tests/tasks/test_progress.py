"""Visible progress on a terminal, none off it: ``show_progress`` decides, and third-party bars (transformers'
weight loading and saving) are switched off with ours."""

import os

import pytest

from tasks.records.progress import show_progress


@pytest.mark.parametrize("tty, ci, shown", [(True, None, True), (True, "true", False), (False, None, False)])
def test_progress_only_on_a_terminal_outside_ci(tty, ci, shown, monkeypatch, tmp_path):
    master, slave = os.openpty()
    stream = os.fdopen(slave, "w") if tty else open(tmp_path / "log", "w")  # a real terminal, or a file
    if not tty:
        os.close(slave)
    try:
        monkeypatch.setattr("sys.stderr", stream)
        if ci:
            monkeypatch.setenv("CI", ci)
        else:
            monkeypatch.delenv("CI", raising=False)
        assert show_progress() is shown
    finally:
        stream.close()
        os.close(master)


def test_no_progress_bar_noise_off_a_terminal(tmp_path, capfd):
    """Saving, loading and warm-starting a policy print no bars when stderr is not a terminal (as under pytest)."""
    import torch

    from tasks.data import arith
    from tasks.model.loading import build_tiny_model, build_tokenizer, load_policy, save_policy
    from tasks.model.warmstart import warm_start
    from tasks.records.progress import quiet_libraries

    torch.set_num_threads(1)
    assert not show_progress()
    quiet_libraries()
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=1, heads=2, tokenizer=tok, seed=0)
    save_policy(model, tok, tmp_path / "m")
    load_policy(tmp_path / "m", dtype=torch.float32, device="cpu")
    warm_start(arith.generate(1, 8, "train", "uniform"), tmp_path / "cache", hidden=64, layers=1, heads=2, steps=2,
               batch_size=4, lr=2e-3, seed=0, progress=show_progress())
    out, err = capfd.readouterr()
    for noise in ("\r", "%|", "it/s]"):
        assert noise not in out + err, f"progress-bar output {noise!r} off a terminal:\n{err[-2000:]}"


def test_off_a_terminal_progress_is_a_log_line_every_interval(caplog, monkeypatch):
    import logging

    from tasks.records.progress import LogProgress, progress_bar

    monkeypatch.setenv("CI", "true")
    assert isinstance(progress_bar(range(3), desc="x"), LogProgress)
    with caplog.at_level(logging.INFO, logger="rlsift.progress"):
        bar = LogProgress(range(4), desc="warm start", unit="step", every=0.0)
        for _ in bar:
            bar.set_postfix(loss="0.500")
        lines = [r.getMessage() for r in caplog.records if r.name == "rlsift.progress"]
        assert lines[0].startswith("warm start: 1/4 step (25%), ") and "s left; loss 0.500" in lines[0]
        assert lines[-1].startswith("warm start: 4/4 step (100%), ") and "left" not in lines[-1]
        caplog.clear()
        list(LogProgress(range(4), desc="quiet", every=3600.0))  # only the closing line
        assert [r.getMessage().split(",")[0] for r in caplog.records] == ["quiet: 4/4 it (100%)"]


def test_long_work_without_a_count_says_it_still_runs(monkeypatch):
    """tasks/records/progress.py: a line as each part starts; while one runs long, a line every ``every`` seconds
    naming it, from a thread that runs in the caller's context (where Prefect finds the flow run its log handler
    sends a line to); none once the work is done."""
    import contextvars
    import logging
    import time

    from tasks.records.progress import pulse

    flow_run = contextvars.ContextVar("flow_run", default=None)
    seen: list[tuple[str, str | None]] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.getMessage(), flow_run.get()))

    logger = logging.getLogger("rlsift.test-pulse")
    logger.addHandler(Grab())
    logger.setLevel(logging.INFO)
    flow_run.set("run-1")
    with pulse("plan", logger, every=0.1) as say:
        say("probe: generation")
        time.sleep(0.35)
        say("probe: the update")
    time.sleep(0.25)
    lines = [line for line, _ in seen]
    assert lines[0] == "plan: probe: generation" and lines[-1] == "plan: probe: the update", lines
    assert 2 <= sum(line.startswith("plan: probe: generation (still running, ") for line in lines) <= 4, lines
    assert all(run == "run-1" for _, run in seen)
