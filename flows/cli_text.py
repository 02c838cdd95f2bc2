"""What the ``rlsift`` commands print: the text of a run's, a plan's and a deployment's summary (each from the
command's ``--json`` object), and :func:`emit`, which prints that object or its text."""

from __future__ import annotations

import json
import sys


def paired_text(paired: dict | None) -> str:
    """The held-out change prompt by prompt (turned right / wrong, exact McNemar p), or nothing."""
    if not paired:
        return ""
    return (f" ({paired['turned_right']} prompts turned right, {paired['turned_wrong']} turned wrong; "
            f"exact McNemar p = {paired['mcnemar_p']:.2g})")


def levels_text(start: dict, end: dict) -> str:
    """The held-out accuracy by difficulty level before and after, as a line; nothing where the prompts have no level
    (GSM8K, HumanEval: their one group is keyed ``None``) and the line would repeat the overall accuracy."""
    if set(start) | set(end) <= {"None"}:
        return ""

    def levels(by_level: dict) -> str:
        return ", ".join(f"{k}: {v:.3f}" for k, v in by_level.items())

    return f"  by level: {levels(start)} -> {levels(end)}\n"


def emit(obj: dict, as_json: bool, text: str) -> None:
    """``obj`` as one JSON line on stdout with ``--json``, else ``text``."""
    if as_json:
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
    else:
        print(text)


def run_text(summary: dict) -> str:
    """``rlsift run``'s summary of a completed run (its ``--json`` object, flows/summary.py ``RunSummary``): the
    accuracy, cost, overlap and plan, and where the run lives: the MLflow run with where to see it (its page, or the
    command that opens MLflow's UI on a local store), the ledger and the run folder."""
    return (f"run {summary['run_id']} ({summary['name']}) {summary['status']} in {summary['wall_s']:.0f} s, "
            f"{summary['steps']} steps\n"
            f"  held-out greedy accuracy {summary['eval_accuracy_start']:.3f} -> {summary['eval_accuracy_end']:.3f}"
            f"{paired_text(summary.get('eval_paired'))}\n"
            f"{levels_text(summary['eval_by_level_start'], summary['eval_by_level_end'])}"
            f"  device hours {summary['device_hours']:.4f} ({summary['device']}), ${summary['cost_usd']:.4f}\n"
            f"{overlap_text(summary.get('overlap'))}"
            f"{plan_text(summary.get('plan'))}"
            f"  MLflow run {summary['mlflow_run_id']}: {summary.get('mlflow_ui') or summary['tracking_uri']}\n"
            f"  ledger {summary['ledger']}\n  run folder {summary['run_dir']}")


def plan_text(p: dict | None) -> str:
    """What a ``plan.auto`` run chose, why and its predicted clock, in one line (flows/summary.py ``plan_summary``;
    empty otherwise)."""
    if not p:
        return ""
    return f"  plan: {p.get('line') or p['reason']}\n"


def overlap_text(o: dict | None) -> str:
    """The run's overlap: the lag and why, and overlapped, its totals in one line."""
    if not o:
        return ""
    out = f"  overlap {o['reason']}\n" if "reason" in o else ""
    if "update_s" not in o:
        return out
    return out + (f"  overlap: update {o['update_s']:.0f} s, next step's draw {o['draw_s']:.0f} s, at once "
                  f"{o['overlap_s']:.0f} s; idle: trainer {o['trainer_idle_s']:.0f} s, "
                  f"generator {o['generator_idle_s']:.0f} s\n")


def deploy_text(out: dict, rlsift: list[str]) -> str:
    """``rlsift deploy``'s summary (its ``--json`` object, flows/deploy.py ``deploy``): each deployment with its work
    pool and schedule, what was skipped, and the next step: the worker that runs them, as a command that works pasted
    in a new shell (``rlsift`` as this process was started, tasks/run.py ``launcher``; the server's URL with it)."""
    import shlex

    pools = ", ".join(f"{name} ({how})" for name, how in out["work_pools"].items())
    lines = [f"deployments on {out['api_url']}" + (f", work pool {pools}" if pools else "") + ":"]
    width = max((len(k) for k in out["deployments"]), default=0)
    for key, dep in out["deployments"].items():
        when = "; ".join(f"cron {s['cron']}{'' if s['active'] else ' (paused)'}" for s in dep["schedules"]
                         if s.get("cron")) or "on demand"
        lines.append(f"  {key:<{width}}  {when}")
    lines += [f"  {name} skipped: {why}" for name, why in out["skipped"].items()]
    if out["deployments"]:
        pool = next(iter(out["deployments"].values()))["work_pool"]
        worker = shlex.join(["env", f"PREFECT_API_URL={out['api_url']}", *rlsift, "worker", "--pool", pool])
        lines.append(f"next: start the worker that runs them (Ctrl-C stops it): {worker}")
    return "\n".join(lines)
