"""``rlsift deploy``: register the deployments of ``infra/prefect.yaml`` with the configured Prefect server.

Steps: check that ``PREFECT_API_URL`` names a server that answers (deployments on Prefect's temporary
ephemeral server would vanish with it), create the process work pool the file names when it is missing,
then run Prefect's own ``prefect --no-prompt deploy --prefect-file infra/prefect.yaml --name ...`` from
the repository root with ``RLSIFT_PROJECT_DIR`` set (the file's pull step), and read the registered
deployments back from the API.

Choices: the Prefect CLI does the registering, so the YAML stays the single description of the
deployments (schedules, parameters, job variables) and ``rlsift deploy`` does exactly what the
documented manual command does. A deployment whose entrypoint file does not exist is reported under
``skipped`` instead of failing the others (Prefect's ``--all`` stops at the first failure).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tasks.config.load import ENV_KEYS
from tasks.records.progress import pulse

log = logging.getLogger("rlsift.deploy")

PROJECT = Path(__file__).resolve().parents[1]
PREFECT_FILE = PROJECT / "infra" / "prefect.yaml"


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise RuntimeError("PREFECT_API_URL is not set: start a server (bash infra/prefect-server.sh) and "
                           "export PREFECT_API_URL=http://127.0.0.1:4200/api")
    return url


def ensure_work_pool(name: str, pool_type: str = "process") -> bool:
    """Create work pool ``name`` (of ``pool_type``, Prefect's default job template) when missing.

    Returns True when it was created.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            if pool_type != "process":
                raise ValueError(
                    f"work pool {name!r}: only 'process' pools are created here; got {pool_type!r}") from None
            client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
            log.info("created work pool %s (process)", name)
            return True
        if pool.type != pool_type:
            raise ValueError(f"work pool {name!r} exists with type {pool.type!r}; the deployments need "
                             f"{pool_type!r}")
        return False


def deploy(prefect_file: str | Path = PREFECT_FILE, names: list[str] | None = None,
           timeout_s: float = 600) -> dict[str, Any]:
    """Register the deployments of ``prefect_file`` (all, or those in ``names``) with the Prefect server.

    Returns:
        ``{"api_url", "work_pools": {name: "created" | "existing"}, "deployments": {flow/name: {"id",
        "entrypoint", "work_pool", "schedules", "parameters"}}, "skipped": {name: reason}}``.

    Raises:
        RuntimeError: no server configured, or ``prefect deploy`` failed (its output is in the message).
        ValueError: an unknown name in ``names``.
    """
    from prefect.client.orchestration import get_client

    prefect_file = Path(prefect_file).resolve()
    spec = yaml.safe_load(prefect_file.read_text())
    specs = {d["name"]: d for d in spec.get("deployments") or []}
    unknown = sorted(set(names or []) - set(specs))
    if unknown:
        raise ValueError(f"unknown deployment(s) {', '.join(unknown)}; {prefect_file} has {', '.join(specs)}")
    url = _api_url()
    log.info("deploy: checking the Prefect server at %s", url)
    with get_client(sync_client=True) as client:
        if client.api_healthcheck() is not None:
            raise RuntimeError(f"the Prefect server at {url} does not answer; start it (infra/prefect-server.sh)")
    chosen, skipped = [], {}
    for name, d in specs.items():
        if names and name not in names:
            continue
        source = PROJECT / d["entrypoint"].split(":")[0]
        if source.is_file():
            chosen.append(name)
        else:
            skipped[name] = f"entrypoint file {source} not found"
    pools: dict[str, str] = {}
    for name in chosen:
        pool = specs[name]["work_pool"]["name"]
        if pool not in pools:
            pools[pool] = "created" if ensure_work_pool(pool) else "existing"
            log.info("deploy: work pool %s (%s)", pool, pools[pool])
    for name, why in skipped.items():
        log.info("deploy: %s skipped: %s", name, why)
    out: dict[str, Any] = {"api_url": url, "work_pools": pools, "deployments": {}, "skipped": skipped}
    if not chosen:
        return out
    cmd = [str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deploy", "--prefect-file",
           str(prefect_file)]
    for name in chosen:
        cmd += ["--name", name]
    env = dict(os.environ, RLSIFT_PROJECT_DIR=str(PROJECT), PREFECT_API_URL=url)
    for var in ENV_KEYS:  # the job variables' placeholders: empty (= the flow's config decides) when not set
        env.setdefault(var, "")
    with pulse("deploy", log) as say:  # Prefect's CLI imports each flow's module (torch and all): tens of seconds
        say(f"registering {', '.join(chosen)} with `prefect deploy` (it imports each flow's code)")
        proc = subprocess.run(cmd, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"prefect deploy failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        for dep in client.read_deployments():
            if dep.name in chosen and specs[dep.name]["entrypoint"] == dep.entrypoint:
                out["deployments"][f"{flows.get(dep.flow_id, '?')}/{dep.name}"] = {
                    "id": str(dep.id), "entrypoint": dep.entrypoint, "work_pool": dep.work_pool_name,
                    "schedules": [{"cron": getattr(s.schedule, "cron", None), "active": s.active}
                                  for s in dep.schedules],
                    "parameters": dep.parameters}
    missing = set(chosen) - {k.split("/", 1)[1] for k in out["deployments"]}
    if missing:
        raise RuntimeError(f"prefect deploy succeeded but {', '.join(sorted(missing))} is not on {url}")
    return out
