"""The run's logger: :class:`MlflowTracker` logs one MLflow run through a write-ahead outbox.

It logs by explicit run id through ``MlflowClient`` (MLflow's fluent "active run" is thread-local and Prefect may
run tasks on other threads).

Delivery (choices, see docs/operations.md "Tracking outages"):

* **Write-ahead outbox** (tasks/records/tracking/outbox.py). Every call (metrics, params, tags, artifacts, model
  registration, the final status) is appended as one JSON line to ``<run dir>/outbox.jsonl`` and returns at once;
  files are copied to ``<run dir>/outbox-artifacts/`` first, so later changes cannot alter them. A background
  thread sends the outbox every ``flush_s`` seconds, consecutive metric items merged into batches of up to 1000
  values, and removes what was sent. Training never waits on the tracking server; a killed process or a
  server that is away loses nothing: the next flush, a resumed run, or ``rlsift sync`` sends the rest.
* **At least once, without duplicates.** An item may be sent twice (killed between sending and removing
  it from the outbox; a timeout after the server stored it). Resending is harmless: metric items carry
  the timestamp of the original call and MLflow's SQL store drops exact (key, step, timestamp, value)
  repeats; params are re-logged with the same value; tags and artifacts overwrite; a registration first
  looks for the version this run already registered; setting the status twice is a no-op.
* **Transient vs. permanent errors.** Transport failures (refused connection, timeout, 5xx: MLflow's
  ``INTERNAL_ERROR``/``TEMPORARILY_UNAVAILABLE``) keep the outbox and retry with a warning while the server
  is away. An item the server rejects as invalid would block the queue forever, so it is moved to
  ``outbox-rejected.jsonl`` with an error log instead.
* **What an outage changes in the Description.** Each outage is recorded (``outbox-outages.json``,
  :class:`~tasks.records.tracking.outbox.OutageLog`); the run's Description is settled as it is sent
  (tasks/records/tracking/describe.py ``settled``): a registration that waited in the outbox is said registered,
  with its version, and a last line names the outages and who sent what they held (the run, or ``rlsift sync``).

The :class:`~tasks.records.tracking.protocol.Tracker` protocol it implements, its do-nothing stand-in
:class:`~tasks.records.tracking.protocol.NullTracker` and ``default_uri`` are in
tasks/records/tracking/protocol.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.records.commands import command
from tasks.records.files import write_text
from tasks.records.layout import mlflow_key, mlflow_layout
from tasks.records.tracking.describe import DESCRIPTION, PARENT_RUN, RUN_NAME, settled, source_tags
from tasks.records.tracking.outbox import OutageLog, Outbox, requests
from tasks.records.tracking.query import run_page, ui_hint
from tasks.records.tracking.registry import add_adapter, register_version, save_mlflow_model

log = logging.getLogger("rlsift.tracking")

#: MLflow error codes that mean "this item is invalid", not "the server is away".
PERMANENT = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "MALFORMED_REQUEST", "RESOURCE_DOES_NOT_EXIST",
                       "INVALID_STATE", "RESOURCE_ALREADY_EXISTS"})
#: The experiment's kind, model training: what earlier MLflow 3 UIs open an experiment on (its runs, not the GenAI
#: traces). MLflow 3.17's UI reads the page's ``workflowType`` instead, which rlsift's links set (query.py).
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


class MlflowTracker:
    """Logs one MLflow run through a write-ahead outbox (see the module docstring).

    Args:
        uri: MLflow tracking URI (``sqlite:///...`` or ``http://host:port``).
        experiment: experiment name (created when missing).
        run_dir: the run's folder; holds ``outbox.jsonl`` and ``outbox-artifacts/``.
        run_name: MLflow run name of a new run.
        run_id: reopen this MLflow run instead of creating one (``rlsift run --resume``).
        parent_run_id: nest a new run under this one.
        flush_s: seconds between background sends.
        final_wait_s: how long :meth:`finish` keeps retrying an unreachable server (default: the
            ``RLSIFT_TRACKING_FINAL_WAIT_S`` environment variable, else 30).
        background: start the sending thread (False for :func:`sync`).
        sender: who sends what an outage held, as the Description names it (``the run``; ``rlsift sync``).
        system_metrics_s: sample CPU, memory, disk, network (and GPU where present) every this many seconds
            with MLflow's own system-metrics monitor (metrics ``system/*``); None: off. Unlike everything
            else here it logs directly, not through the outbox: samples taken while the server is away are lost.

    A new run is tagged with the project's git commit (tasks/records/tracking/describe.py ``source_tags``).
    """

    def __init__(self, uri: str, experiment: str, run_dir: str | Path, *, run_name: str | None = None,
                 run_id: str | None = None, parent_run_id: str | None = None, flush_s: float = 2.0,
                 final_wait_s: float | None = None, background: bool = True,
                 system_metrics_s: float | None = None, sender: str = "the run"):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.outbox = Outbox(self.run_dir / "outbox.jsonl")
        self.outages = OutageLog(self.run_dir / "outbox-outages.json")
        self.sender = sender
        self.final_wait_s = float(os.environ.get("RLSIFT_TRACKING_FINAL_WAIT_S", "30")) if final_wait_s is None \
            else final_wait_s
        self.registered: dict[str, str] = {}
        self._tables: list[str] = []
        self.experiment_id: str | None = None
        self.name: str | None = run_name
        self._send_lock = threading.Lock()
        self._away_since: float | None = None
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                art = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri() \
                    if uri.startswith("sqlite:") else None
                exp_id = self.client.create_experiment(experiment, artifact_location=art,
                                                       tags=dict([EXPERIMENT_KIND]))
            else:
                exp_id = exp.experiment_id
                if EXPERIMENT_KIND[0] not in exp.tags:  # made by hand, or without the tag
                    self.client.set_experiment_tag(exp_id, *EXPERIMENT_KIND)
            tags = {RUN_NAME: run_name} if run_name else {}
            if parent_run_id:
                tags[PARENT_RUN] = parent_run_id
            run_id = self.client.create_run(exp_id, tags=tags | source_tags(), run_name=run_name).info.run_id
            self.experiment_id = exp_id
        elif background:
            self.client.update_run(run_id, status="RUNNING")
            info = self.client.get_run(run_id).info
            self.experiment_id, self.name = info.experiment_id, info.run_name
        self.run_id = run_id
        self._stop = threading.Event()
        self._thread = None
        self._monitor = None
        if system_metrics_s:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(run_id, sampling_interval=system_metrics_s, tracking_uri=uri)
            self._monitor.start()
        if background:
            self._thread = threading.Thread(target=self._loop, args=(flush_s,), daemon=True, name="mlflow-flush")
            self._thread.start()

    @property
    def url(self) -> str | None:
        """This run's page in the MLflow UI (None for a local store: no server to link to)."""
        if not self.uri.startswith(("http://", "https://")):
            return None
        if self.experiment_id is None:
            try:
                self.experiment_id = self.client.get_run(self.run_id).info.experiment_id
            except Exception:  # noqa: BLE001 -- away: no link this time
                return None
        return run_page(self.uri, self.experiment_id, self.run_id)

    @property
    def ui(self) -> str:
        """Where to see this run in MLflow's UI: its page on a tracking server, else the command that opens a UI
        on the local store and the run's page there (query.py ``ui_hint``)."""
        return self.url or ui_hint(self.uri, self.experiment_id, self.run_id)

    # ---- queueing (fast: one appended line) ---------------------------------------------------------
    def _put(self, item: dict[str, Any]) -> None:
        self.outbox.append(item)

    def log_params(self, params: dict[str, Any]) -> None:
        self._put({"kind": "params", "params": {mlflow_key(k): str(v)[:6000] for k, v in params.items()}})

    def log_metrics(self, metrics: dict[str, float], step: int, ts: int | None = None) -> None:
        """``ts``: the values' timestamp in ms (default now); resending with the same one adds no duplicate.
        Laid out by :func:`mlflow_layout`: some keys become run tags, per-stage cost is left to the cost table."""
        series, values = mlflow_layout(metrics)
        if values:
            self.set_tags(values)
        if series:
            self._put({"kind": "metrics", "step": int(step),
                       "ts": int(time.time() * 1000) if ts is None else int(ts),
                       "metrics": {mlflow_key(k): float(v) for k, v in series.items()}})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._put({"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def rename(self, name: str) -> None:
        """Give the run another name (the runs table's and the run page's title)."""
        self.name = name
        self.set_tags({RUN_NAME: name})

    def describe(self, text: str) -> None:
        """Set the run's Description (Markdown; the top of the run's Overview), replacing any earlier one."""
        self.set_tags({DESCRIPTION: text})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Queue a file or folder; it is copied first so later changes or deletion cannot lose it."""
        src = Path(path)
        keep = self.run_dir / "outbox-artifacts" / f"{time.time_ns()}" / src.name
        keep.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, keep)
        self._put({"kind": "artifact", "path": str(keep), "artifact_path": artifact_path})

    def log_dict(self, data: Any, name: str) -> None:
        path = self.run_dir / name
        path.write_text(json.dumps(data, indent=2, default=str))
        self.log_artifact(path)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """A table artifact ``name`` (a ``.json`` file in the layout of ``mlflow.log_table``: columns and rows),
        written to the run folder and sent through the outbox; logging it again replaces it (unlike
        ``MlflowClient.log_table``, which appends: a resent item would double the rows)."""
        columns = list(dict.fromkeys(k for r in rows for k in r))
        path = self.run_dir / name
        write_text(path, json.dumps({"columns": columns, "data": [[r.get(c) for c in columns] for r in rows]}))
        self.log_artifact(path)
        if name not in self._tables:
            self._tables.append(name)
        self.set_tags({"mlflow.loggedArtifacts": json.dumps([{"path": t, "type": "table"} for t in self._tables])})

    # ---- sending --------------------------------------------------------------------------------------
    def _send(self, items: list[dict[str, Any]]) -> None:
        """Send one request's worth of items: a merged metrics batch, or one other item."""
        kind = items[0]["kind"]
        if kind == "metrics":
            self.client.log_batch(self.run_id, metrics=[
                Metric(k, v, it["ts"], it["step"]) for it in items for k, v in it["metrics"].items()])
            return
        (item,) = items
        if kind == "params":
            params = [Param(k, v) for k, v in item["params"].items()]
            for i in range(0, len(params), 90):
                self.client.log_batch(self.run_id, params=params[i:i + 90])
        elif kind == "tags":
            tags = dict(item["tags"])
            if DESCRIPTION in tags:
                tags[DESCRIPTION] = self._settled(tags[DESCRIPTION])
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        elif kind == "artifact":
            p = Path(item["path"])
            if p.is_dir():
                self.client.log_artifacts(self.run_id, str(p), item["artifact_path"] or p.name)
            elif p.exists():
                self.client.log_artifact(self.run_id, str(p), item["artifact_path"])
            else:  # sent before, removed, then resent after a kill: nothing left to do
                log.debug("artifact copy %s already sent", p)
        elif kind == "register":
            self.registered[item["name"]] = register_version(self.client, self.run_id, item["name"], item["path"],
                                                             item["tags"], item.get("description"))
        elif kind == "status":
            self.client.set_terminated(self.run_id, status=item["status"])
        else:
            raise ValueError(f"unknown outbox item kind {kind!r}; allowed: metrics, params, tags, artifact, "
                             "register, status")

    def _settled(self, text: str) -> str:
        """The Description as it goes out now (describe.py ``settled``): an outage that lasts until this send ends
        with it, its items sent by :attr:`sender`."""
        now = time.time()
        outages = [o if o.until is not None else replace(o, until=now, sent_by=self.sender)
                   for o in self.outages.entries()]
        return settled(text, self.registered, outages, now)

    def _cleanup(self, items: list[dict[str, Any]]) -> None:
        for item in items:
            if item["kind"] == "artifact":
                shutil.rmtree(Path(item["path"]).parent, ignore_errors=True)

    def _reject(self, items: list[dict[str, Any]], err: Exception) -> None:
        log.error("MLflow rejected %d outbox item(s) (%s); kept in %s", len(items), err,
                  self.run_dir / "outbox-rejected.jsonl")
        with open(self.run_dir / "outbox-rejected.jsonl", "a") as f:
            f.writelines(json.dumps({**it, "error": str(err)[:500]}) + "\n" for it in items)

    def flush(self) -> bool:
        """Send the outbox. Returns True when everything queued before the call was sent."""
        with self._send_lock:
            items = self.outbox.peek()
            done = 0
            try:
                for req in requests(items):
                    try:
                        self._send(req)
                    except MlflowException as err:
                        if err.error_code not in PERMANENT:
                            raise
                        for one in req:  # isolate the invalid item(s) of a merged batch
                            try:
                                self._send([one])
                            except MlflowException as err1:
                                if err1.error_code not in PERMANENT:
                                    raise
                                self._reject([one], err1)
                    done += len(req)
                    self._cleanup(req)
            except Exception as err:  # noqa: BLE001 -- any transport error: keep the rest, retry later
                self.outbox.drop(done)
                if self._away_since is None:
                    self._away_since = time.time()
                    self.outages.began(self._away_since)
                    log.warning("MLflow at %s is not answering (%s); keeping %d items in %s and retrying",
                                self.uri, type(err).__name__, len(items) - done, self.outbox.path)
                return False
            self.outbox.drop(done)
            if self._away_since is not None:
                log.warning("MLflow is back after %.0f s; sent %d kept items", time.time() - self._away_since, done)
                self._away_since = None
            if done:
                self.outages.ended(time.time(), self.sender)
            return True

    def _loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self.flush()

    def register_model(self, local_dir: str | Path, name: str, tags: dict[str, str],
                       description: str | None = None, adapter: str | Path | None = None) -> str | None:
        """Save a transformers checkpoint folder as an MLflow Model (``save_mlflow_model``), log it as this run's
        logged model and register it as a new version of ``name`` with ``tags`` and ``description``
        (tasks/records/tracking/registry.py). ``adapter``: a LoRA run's adapter folder, registered with the version
        as its ``adapter/`` folder (``add_adapter``).

        Returns the version, or None when MLflow is away: the registration then stays queued and happens
        when MLflow answers again (or at ``rlsift sync``); the saved MLflow Model waits in the run folder.
        """
        model_dir = self.run_dir / "outbox-artifacts" / f"mlflow-model-{name}"
        if not (model_dir / "MLmodel").is_file():  # a resume after a kill reuses a complete one
            shutil.rmtree(model_dir, ignore_errors=True)
            save_mlflow_model(local_dir, model_dir)
            if adapter is not None:
                add_adapter(model_dir, adapter)
        self._put({"kind": "register", "name": name, "path": str(model_dir),
                   "tags": {k: str(v) for k, v in tags.items()}, "description": description})
        if not self.flush():
            log.warning("model %s not registered yet: MLflow unreachable; it is queued in %s", name, self.outbox.path)
            return None
        return self.registered.get(name)

    def finish(self, status: str = "FINISHED") -> None:
        """Queue the final status, stop the background thread and send everything (waits up to final_wait_s,
        saying so first: the terminal is not silent while it waits on an MLflow that does not answer)."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        self._put({"kind": "status", "status": status})
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            if self._thread.is_alive():  # its send is still waiting on MLflow
                log.warning("waiting up to 30 s for MLflow at %s to take what the run sent", self.uri)
                self._thread.join(timeout=28)
        deadline = time.time() + self.final_wait_s
        told = False
        while not self.flush():
            if not told:  # not 30 s of silence before the run's summary
                log.info("MLflow at %s does not answer; sending the run's last items again for up to %.0f s "
                         "(the outbox keeps them)", self.uri, self.final_wait_s)
                told = True
            if time.time() > deadline:
                log.warning("MLflow still unreachable: %s keeps the unsent items; `%s` sends them", self.outbox.path,
                            command("sync", self.run_dir, self.uri, self.run_id))
                return
            time.sleep(min(2.0, max(0.0, deadline - time.time())))


def sync(run_dir: str | Path, uri: str, run_id: str) -> bool:
    """Send a run folder's outbox (after an outage that outlived the run). True when all was sent. The run's
    Description, sent last, then says the model registered and names the outage (:meth:`MlflowTracker._settled`)."""
    return MlflowTracker(uri, "", run_dir, run_id=run_id, background=False, sender="`rlsift sync`").flush()
