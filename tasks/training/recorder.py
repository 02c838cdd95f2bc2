"""What the training stage records a step, in one place: the ledger's step rows (reference, selections, groups,
skipped updates), the step's metrics (to MLflow) and its line in ``metrics.jsonl``, with its rollout and update
throughput (:func:`throughput`). The ledger's rows and the MLflow metrics of a step are held until the checkpoint
that covers it (the rows written just before it, in one insert per table for every step it covers: a step's own
inserts took 6-9 ms of the trainer's core; the metrics sent just after it, tasks/run.py); ``metrics.jsonl`` gets its
line at once.

A resumed run continues from its checkpoint at step s (tasks/training/checkpoint.py ``restore``);
:meth:`Recorder.resume` then drops what the crashed process recorded past it, once for each record: the ledger's step
rows of steps >= s (written where the process died between the rows and the checkpoint, or flushed by a failing
run, :meth:`Recorder.flush`), the ``metrics.jsonl`` lines of those steps (a line torn by the kill with them), and it
holds MLflow metrics from step s on, sending again the held metrics the checkpoint kept (a kill may have come between
the checkpoint's write and their send; MLflow's SQL store drops exact repeats). :meth:`Recorder.checkpoint` writes
the held rows, then a checkpoint with the held metrics it covers, then sends them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from rlcore.types import RolloutGroup
from tasks.records.ledger import GroupRow, ReferenceRow, SelectionRow, SkippedUpdateRow, StepRows
from tasks.records.throughput import FlopModel, Peak, rates
from tasks.run import Run
from tasks.training.draw import FreshBatch

#: One held MLflow metric row as a checkpoint keeps it: (metrics, step, timestamp in ms).
HeldMetrics = list[tuple[dict[str, float], int, int]]
#: The overlap's per-step seconds that :meth:`Recorder.overlap_totals` sums (``overlap/<key>`` metrics).
OVERLAP_KEYS = ("update_s", "draw_s", "overlap_s", "trainer_idle_s", "generator_idle_s")


class Recorder:
    """The training stage's step records of ``run``: ledger rows, MLflow metrics and ``metrics.jsonl``."""

    def __init__(self, run: Run):
        self.run = run
        self.metrics_file: Path = run.dir / "metrics.jsonl"
        #: the ledger rows of the steps since the last checkpoint, not written yet (:meth:`flush`)
        self.held_rows: list[StepRows] = []

    def resume(self, step: int, held: HeldMetrics | None) -> None:
        """Training continues at ``step`` (0: a fresh start, or a crash before the first checkpoint): drop every
        record of steps >= ``step`` and hold MLflow metrics from it on; ``held``: the metrics the checkpoint kept
        (None without a checkpoint), sent again."""
        run = self.run
        run.ledger.truncate_after(run.run_id, step - 1)
        if self.metrics_file.exists():
            kept = [ln for ln in self.metrics_file.read_text().splitlines() if _step_of(ln) < step]
            self.metrics_file.write_text("".join(ln + "\n" for ln in kept))
        run.defer_metrics(step)
        if held is not None:
            run.commit_metrics(step, held=held)

    def rows(self, round_: int, step: int, references: Sequence[ReferenceRow], selections: Sequence[SelectionRow],
             groups: Sequence[RolloutGroup], skipped: Sequence[SkippedUpdateRow] = ()) -> None:
        """The ledger rows of one step, held until the next checkpoint (:meth:`flush`): the round start's reference
        rows (when it started one), a row per selected prompt, one per group it trained (:func:`group_row`) and one
        per minibatch its update skipped."""
        self.held_rows.append(StepRows(round_, step, tuple(references), tuple(selections),
                                       tuple(group_row(g, step) for g in groups), tuple(skipped)))

    def flush(self) -> None:
        """Write the held ledger rows (one insert per table, :meth:`~tasks.records.ledger.store.Ledger.add_steps`)."""
        if self.held_rows:
            self.run.ledger.add_steps(self.run.run_id, self.held_rows)
            self.held_rows = []

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics: to MLflow (held until a checkpoint covers the step) and a line of ``metrics.jsonl``."""
        self.run.log_metrics(metrics, step)
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def checkpoint(self, step: int, write: Callable[[HeldMetrics], object]) -> None:
        """A checkpoint at ``step``: the held ledger rows written (where the caller has not, :meth:`flush`), then the
        checkpoint (``write``) with the held metrics of the steps it covers (so a kill before their send loses none),
        then those sent."""
        self.flush()
        write(self.run.held_metrics(step))
        self.run.commit_metrics(step)

    def overlap_totals(self) -> dict[str, float]:
        """The run's overlap seconds summed over every step in ``metrics.jsonl`` (a resumed run's earlier steps
        too)."""
        totals = dict.fromkeys(OVERLAP_KEYS, 0.0)
        for line in self.metrics_file.read_text().splitlines():
            row = json.loads(line)
            for k in OVERLAP_KEYS:
                totals[k] += row.get(f"overlap/{k}", 0.0)
        return totals


def group_row(g: RolloutGroup, step: int) -> GroupRow:
    """The ledger row of group ``g`` trained at ``step``: successes over its n generated rollouts, the kept ones'
    mean reward, where a replayed group came from and how many updates its sampling weights trailed."""
    return GroupRow(prompt_id=g.prompt_id, n=g.n_generated, successes=int(round(g.success_rate * g.n_generated)),
                    mean_reward=g.success_rate, kept=g.size, kept_mean_reward=float(g.rewards.mean()),
                    replayed=g.replayed_from is not None,
                    from_step=g.replayed_from if g.replayed_from is not None else step,
                    policy_version=g.policy_version,
                    lag=None if g.policy_version is None else step - g.policy_version)


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; a line torn by a kill counts as past every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def throughput(shape: FlopModel, machine: Peak, fs: FreshBatch, upd_stats: dict[str, float],
               upd_s: float) -> dict[str, float]:
    """Tokens per second and MFU (tasks/records/throughput.py) of this step's rollout and update phases.

    The rollout phase's FLOPs are forward passes over every generated rollout's prompt and completion (the prompt
    is prefilled once per rollout, as ``generate`` does with ``num_return_sequences``), its time includes the
    verifiers; the update's are forward + backward over the real tokens of the rows it computed
    (``upd_stats``: the updater's ``train/update_tokens`` and ``train/update_rows``; rows of groups without a
    gradient are not computed, ``train.skip_zero_advantage``; the reference and pi_old passes of
    ``train.kl_coef`` / ``train.minibatches`` are not counted).
    """
    upd_tps, upd_mfu = rates(shape, machine, tokens=int(upd_stats["train/update_tokens"]),
                             sequences=int(upd_stats["train/update_rows"]), seconds=upd_s, backward=True)
    gen_tps, gen_mfu = rates(shape, machine, tokens=fs.prompt_tokens + fs.tokens, sequences=fs.generated,
                             seconds=fs.gen_s, backward=False)
    return {"perf/update_tokens_per_s": upd_tps, "perf/update_mfu": upd_mfu, "perf/rollout_tokens_per_s": gen_tps,
            "perf/rollout_mfu": gen_mfu, "perf/peak_tflops": machine.flops / 1e12}
