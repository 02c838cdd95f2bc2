"""The run context every stage receives: config, folders, ledger, tracker and cost meter of one run.

Metrics of training steps are *committed with checkpoints* (docs/operations.md "Resume"): once training
starts (:meth:`Run.defer_metrics`), metrics logged at a step at or past the last checkpoint are held in
memory and handed to the tracker only when the checkpoint that covers them is on disk
(:meth:`Run.commit_metrics`) or the run completes. A run killed between checkpoints therefore never
leaves metrics in MLflow for steps that its resume recomputes: each step's metrics reach MLflow once.
Everything logged before training (ingest, calibration, ...) goes to the tracker at once.

The run resolves once what its components share: its config's relative paths (against the folder it started in,
kept in ``info.json``), its device and its precision (:attr:`Run.device`, :attr:`Run.precision`). Its log lines, and
the traceback of a failure, go to ``<run>/run.log`` (:data:`RUN_LOG`); what it prints for a person to run again
(:meth:`Run.resume_command`) starts rlsift as the person did (:func:`launcher`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import traceback
import uuid
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from tasks.config import Config
from tasks.config.load import resolve_paths, to_json
from tasks.model.attention import guard_attention
from tasks.overlap.concurrent import SamplerHandover
from tasks.records.cost import CostMeter
from tasks.records.files import write_json
from tasks.records.label import run_label
from tasks.records.ledger import Ledger, StageRow
from tasks.records.memory import PeakMemory
from tasks.records.progress import quiet_libraries
from tasks.records.resume import launcher, note_stopped, resume_command  # noqa: F401 - launcher: also named here
from tasks.records.stopping import CANCELLED, TRACKER_STATUS, held_signals
from tasks.records.tracking import MlflowTracker, NullTracker, Tracker, default_uri
from tasks.update.precision import Precision, resolve_precision

log = logging.getLogger("rlsift")

#: The run's per-stage cost table in MLflow (:meth:`Run.log_cost_table`).
COST_TABLE = "cost_by_stage.json"
#: Where a run names the temporary folders its processes keep (:meth:`Run.note_temp`).
TEMP_RECORD = "temp.json"
#: The run's log file in its folder: its ``rlsift`` log lines and the traceback of a failure (:meth:`Run.failed`).
RUN_LOG = "run.log"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but no CUDA device is visible")
    return torch.device(name)


@dataclass(frozen=True)
class RunInfo:
    """What a run learns about itself while it runs, kept in ``<run>/info.json`` so a resume sees it.

    Attributes:
        policy_path: the folder of the model the run started from (the prepare stage).
        data_fingerprint: sha256 of the sorted train and test prompt ids (flows/pipeline.py).
        flow: ``retrain`` for runs of the retrain flow (flows/retrain.py), else None.
        parent_version: the registered model version a retrain continues ("" when there was none yet).
        parent_path: that version's local folder.
        flow_run_id: the Prefect flow run that last ran this run (a resume ends a killed one's, flows/pipeline.py).
        prefect_api: the Prefect API that flow run reports to (``PREFECT_API_URL``); None: a temporary server that
            ended with its process. A resume reports to it (flows/prefect_server.py ``resume_api``).
        started: when the run was first opened (seconds since the epoch; None in a run opened before rlsift kept
            it): a resumed run's Description gives its time from start to end, which MLflow's Duration shows.
        config, overrides: the YAML file and the dotted overrides the run was started with (``rlsift run -c CONFIG
            KEY=VALUE ...``, a deployment's parameters; None and () where the caller gave a config object, e.g. the
            benchmark); a resumed run's Prefect flow run shows them as its parameters (flows/pipeline.py
            ``resumed_parameters``).
        folder: the folder the run started in: the relative paths of its config point there (tasks/config/load.py
            ``resolve_paths``; None in a run opened before rlsift kept it).

    Set stage by stage with ``run.info = dataclasses.replace(run.info, ...)``; :meth:`Run.save_info` writes it.
    """

    policy_path: str | None = None
    data_fingerprint: str | None = None
    flow: str | None = None
    parent_version: str | None = None
    parent_path: str | None = None
    flow_run_id: str | None = None
    prefect_api: str | None = None
    started: float | None = None
    config: str | None = None
    overrides: tuple[str, ...] = ()
    folder: str | None = None

    @classmethod
    def load(cls, path: Path) -> RunInfo:
        d = json.loads(Path(path).read_text())
        return cls(**{**d, "overrides": tuple(d.get("overrides", ()))})


@dataclass
class Run:
    """One pipeline run. Created by :func:`open_run`; closed by :meth:`close`.

    ``device`` and ``precision``: ``model.device`` and ``model.precision`` resolved (``auto``: by what this machine
    has; tasks/update/precision.py), once, for every component of the run."""

    cfg: Config
    run_id: str
    root: Path
    dir: Path
    ledger: Ledger
    tracker: Tracker
    meter: CostMeter
    device: torch.device
    tracking_uri: str
    precision: Precision = None  # type: ignore[assignment]  # resolved from the config at construction
    info: RunInfo = field(default_factory=RunInfo)
    resumed: bool = False
    #: a resumed run's meter seconds carried over from the stages its crashed process recorded (the ledger's
    #: ``stages`` rows); what the resuming process adds on top is redone work (``checkpoint.restore``)
    carried: dict[str, float] = field(default_factory=dict)
    #: the overlap probe's generator process, kept for the training stage (tasks/overlap/concurrent.py); closed with
    #: the run where no training took it
    handover: SamplerHandover = field(default_factory=SamplerHandover, repr=False)
    _hold_from: int | None = field(default=None, repr=False)
    _held: list[tuple[dict[str, float], int, int]] = field(default_factory=list, repr=False)  # metrics, step, ts
    _log: logging.Handler | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.precision is None:
            self.precision = resolve_precision(self.cfg.model.precision, self.device)

    def resume_command(self) -> str:
        """The command that finishes this run from its last checkpoint (:func:`resume_command`)."""
        return resume_command(self.run_id, self.root)

    def failed(self, err: BaseException) -> Path:
        """Record a failure: its traceback goes to the run's log file (:data:`RUN_LOG`, returned), not the terminal:
        the run's summary says the failure in one line (flows/pipeline.py ``failed_note``)."""
        with open(self.dir / RUN_LOG, "a") as f:
            f.write("".join(traceback.format_exception(err)))
        return self.dir / RUN_LOG

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._hold_from is not None and step >= self._hold_from:
            self._held.append((dict(metrics), step, int(time.time() * 1000)))
        else:
            self.tracker.log_metrics(metrics, step)

    def defer_metrics(self, from_step: int) -> None:
        """From now on hold metrics of steps >= ``from_step`` until a checkpoint covers them."""
        self._hold_from = from_step

    def held_metrics(self, step: int) -> list[tuple[dict[str, float], int, int]]:
        """The held metrics a checkpoint at ``step`` covers (steps before it), with their timestamps: the
        checkpoint keeps them, so a kill between writing it and :meth:`commit_metrics` loses none."""
        return [h for h in self._held if h[1] < step]

    def commit_metrics(self, step: int, held: list[tuple[dict[str, float], int, int]] | None = None) -> None:
        """A checkpoint at ``step`` is on disk: send held metrics of earlier steps. ``held``: those a restored
        checkpoint kept (sent again with their own timestamps; MLflow drops exact repeats)."""
        keep = []
        for metrics, s, ts in [*(held or []), *self._held]:
            if s < step:
                self.tracker.log_metrics(metrics, s, ts)
            else:
                keep.append((metrics, s, ts))
        self._held = keep
        if self._hold_from is not None:
            self._hold_from = max(self._hold_from, step)

    def save_info(self) -> None:
        """Persist :attr:`info` (lineage of retrain runs) so a resumed run sees it."""
        write_json(self.dir / "info.json", asdict(self.info))

    def log_stage_cost(self, stage: str, step: int = 0, parts: tuple[str, ...] | None = None,
                       metrics: bool = True) -> None:
        """Record a finished stage's wall time, device hours and money in the ledger, as metrics and in the
        cost table (:meth:`log_cost_table`).

        ``parts``: the meter's names that make up the stage (the training loop is timed per phase);
        ``metrics``: also log them (a stage a resumed run redoes only updates its ledger row: its metrics at
        that step are already in MLflow, and the redone seconds reach the later steps' running totals).
        MLflow gets the ``time/*`` series and the ``cost/device_hours``, ``cost/usd`` totals; the per-stage
        ``cost/*`` keys reach ``metrics.jsonl`` only (tasks/records/layout.py ``mlflow_layout``).
        """
        names = parts or (stage,)
        s, hours, usd = self.meter.wall_seconds(names), self.meter.device_hours(names), self.meter.usd(names)
        self.ledger.add_stage(self.run_id, StageRow(stage=stage, wall_s=s, device=self.meter.device,
                                                    device_hours=hours, cost=usd))
        out = {k: v for k, v in self.meter.metrics().items()
               if k.startswith(tuple(f"{p}/{n}_" for n in names for p in ("time", "cost")))
               or k in ("cost/device_hours", "cost/usd")}
        if parts:
            out |= {f"time/{stage}_s": s, f"cost/{stage}_device_hours": hours, f"cost/{stage}_usd": usd}
        if metrics:
            self.log_metrics(out, step)
        self.log_cost_table()
        log.info("stage %s done in %.1f s (%.5f device hours, $%.5f; run total $%.5f)", stage, s, hours, usd,
                 self.meter.usd())

    def cost_table(self) -> list[dict[str, Any]]:
        """Time, device hours and money of every timed stage and training phase so far, and the total."""
        m = self.meter
        rows = [{"stage": name, "seconds": round(m.wall_seconds(name), 3),
                 "device_hours": round(m.device_hours(name), 6), "usd": round(m.usd(name), 6)} for name in m.seconds]
        rows.append({"stage": "total", "seconds": round(m.wall_seconds(), 3),
                     "device_hours": round(m.device_hours(), 6), "usd": round(m.usd(), 6)})
        return [{**r, "device": m.device} for r in rows]

    def log_cost_table(self) -> None:
        """Send :meth:`cost_table` as the run's ``cost_by_stage.json`` table (replaced at each stage's end)."""
        self.tracker.log_table(self.cost_table(), COST_TABLE)

    def note_temp(self, path: str, pid: int) -> None:
        """Record a temporary folder that process ``pid`` of this run keeps (the overlap's generator process: its
        multiprocessing folder, with a listener socket where its replies share their tensors) in
        ``<run>/temp.json``. A process that ends cleanly removes its own; :meth:`close` and a resume remove one whose
        process is gone (:func:`remove_leftovers`)."""
        record = self.dir / TEMP_RECORD
        noted = json.loads(record.read_text()) if record.is_file() else []
        write_json(record, [*noted, {"path": path, "pid": pid}])

    def close(self, status: str, summary: dict[str, Any], note: str = "") -> None:
        """Finish the run: ``completed`` and ``skipped`` send every held metric; any other status drops the
        metrics past the last checkpoint (a resume recomputes and logs them). One log line says how it ended
        (``note``: why, e.g. the signal that stopped it) and what was not sent. A ``cancelled`` run (stopped by a
        signal, tasks/records/stopping.py) marks its stores with SIGINT and SIGTERM held: a second Ctrl-C waits."""
        with held_signals() if status == CANCELLED else nullcontext():
            self._close(status, summary, note)

    def _close(self, status: str, summary: dict[str, Any], note: str) -> None:
        self.handover.close(now=status not in ("completed", "skipped", "planned"))
        dropped = 0
        if status in ("completed", "skipped"):
            self._hold_from = None
            self.commit_metrics(2**62)
        else:
            dropped, self._held = len(self._held), []
        if note or dropped:
            resume = "a resume" if note else f"`{self.resume_command()}`"  # a note names it
            unsent = (f"; {dropped} steps' metrics past the last checkpoint not sent (metrics.jsonl has them; "
                      f"{resume} logs them again)") if dropped else ""
            level = {CANCELLED: logging.WARNING, "failed": logging.ERROR}.get(status, logging.INFO)
            said = (": " if status == "failed" else " ") + note if note else ""  # failed: <cause>; cancelled by <sig>
            log.log(level, "run %s %s%s%s", self.run_id, status, said, unsent)
        # each store is marked whatever the others do; a run that already failed or stopped says what could not be
        # marked in a line each (a full disk fails them all) and keeps its own error, told above, as the one raised
        unmarked: list[Exception] = []
        for what, mark in (("MLflow's cost table", self.log_cost_table),
                           ("the ledger", lambda: self.ledger.finish_run(self.run_id, status, summary)),
                           ("the ledger", self.ledger.close),
                           ("MLflow", lambda: self.tracker.finish(TRACKER_STATUS.get(status, "FINISHED")))):
            try:
                mark()
            except Exception as err:
                cause = next(iter(str(err).strip().splitlines()), "")  # one line, as flows/pipeline.py failed_note
                log.error("run %s: %s not marked %s: %s%s", self.run_id, what, status, type(err).__name__,
                          ": " + cause if cause else "")
                unmarked.append(err)
        remove_leftovers(self.dir)
        if self._log is not None:
            logging.getLogger("rlsift").removeHandler(self._log)
            self._log.close()
        if unmarked and status in ("completed", "skipped", "planned"):
            raise unmarked[0]


def remove_leftovers(run_dir: Path) -> None:
    """Remove the temporary folders of this run's processes that are gone (:meth:`Run.note_temp`; a SIGKILL leaves
    them); those whose process still lives stay recorded."""
    record = run_dir / TEMP_RECORD
    if not record.is_file():
        return
    kept = []
    for noted in json.loads(record.read_text()):
        if not Path(noted["path"]).exists():
            continue
        if psutil.pid_exists(noted["pid"]):
            kept.append(noted)
            continue
        shutil.rmtree(noted["path"], ignore_errors=True)
        log.info("run %s: removed %s, left by its process %d", run_dir.name, noted["path"], noted["pid"])
    if kept:
        write_json(record, kept)
    else:
        record.unlink()


def open_run(cfg: Config, *, run_id: str | None = None, track: bool = True, parent_run_id: str | None = None,
             run_name: str | None = None) -> Run:
    """Create (or, given an existing ``run_id``, reopen) a run under ``cfg.paths.root``. The config's relative paths
    are resolved against the folder the run started in (the working folder; a resumed run's from its ``info.json``),
    and the run keeps them so (its ``config.json``, its MLflow params)."""
    resume = run_id is not None
    run_id = run_id or f"{uuid.uuid4().hex[:12]}"
    info_file = Path(cfg.paths.root).resolve() / "runs" / run_id / "info.json"
    info = RunInfo.load(info_file) if resume and info_file.exists() else RunInfo(started=time.time(),
                                                                                 folder=os.getcwd())
    cfg = resolve_paths(cfg, info.folder or os.getcwd())
    root = Path(cfg.paths.root).resolve()
    run_dir = root / "runs" / run_id
    if resume and not run_dir.exists():
        raise FileNotFoundError(f"no run {run_id} under {root / 'runs'}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        remove_leftovers(run_dir)
    ledger = Ledger(root / "ledger.duckdb")
    tracker: Tracker | None = None
    try:  # a failure here must not leave the ledger open (nor the MLflow run running)
        uri = cfg.tracking.uri or default_uri(root)
        mlflow_id = None
        if resume:
            mlflow_id = ledger.mlflow_run_id(run_id)
        tracker = (MlflowTracker(uri, cfg.tracking.experiment, run_dir, run_name=run_name or run_label(cfg),
                                 run_id=mlflow_id, parent_run_id=parent_run_id,
                                 system_metrics_s=cfg.tracking.system_metrics_s) if track else NullTracker())
        note_stopped(ledger, root, but=run_id)  # runs killed before: said, with their resume commands
        ledger.start_run(run_id, cfg.model_dump(mode="json"), tracker.run_id)
        (run_dir / "config.json").write_text(to_json(cfg))
        if not resume:
            tracker.log_params(cfg.flat())
            tracker.set_tags({"rlsift.run_id": run_id, "rlsift.root": str(root)})
            tracker.log_artifact(run_dir / "config.json")
        device = resolve_device(cfg.model.device)
        tracker.set_tags(guard_attention(device).tags())  # cuDNN SDPA off on CUDA (tasks/model/attention.py)
        meter = CostMeter(prices=dict(cfg.cost.prices), device=cfg.cost.device, memory=PeakMemory(device))
        carried = {}
        if resume:  # the crashed process's stages count once, also when it died before its first checkpoint
            carried = {k: v for k, v in ledger.stage_seconds(run_id).items() if k != "train"}
            for name, seconds in carried.items():
                meter.add(name, seconds)
        if cfg.model.threads:
            torch.set_num_threads(cfg.model.threads)
        run = Run(cfg=cfg, run_id=run_id, root=root, dir=run_dir, ledger=ledger, tracker=tracker, meter=meter,
                  device=device, tracking_uri=uri, info=info, resumed=resume, carried=carried)
        if not resume:
            run.save_info()
    except BaseException:
        ledger.close()
        if tracker is not None:
            tracker.finish("FAILED")
        raise
    run._log = run_log(run_dir / RUN_LOG)
    quiet_libraries()
    log.info("run %s: ledger %s, MLflow run %s (%s)", run_id, ledger.path, tracker.run_id, tracker.ui or uri)
    return run


def run_log(path: Path) -> logging.Handler:
    """A handler that appends the ``rlsift`` log lines (the stages' summaries, progress, warnings) to the run's log
    file ``path``, attached until the run closes."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.getLogger("rlsift").addHandler(handler)
    return handler
