"""Registered models: the trained policy as an MLflow Model in the model registry, and back.

Registered models are MLflow Models with the ``transformers`` flavour (task ``text-generation``, a string
in / string out signature), saved from the run's final checkpoint folder with
``mlflow.transformers.save_model`` and logged as an MLflow 3 *logged model* of the run (the run's "Logged
models" list), whose registry version points at that logged model's artifacts. So
``mlflow.pyfunc.load_model("models:/rlsift-policy/<version>")``, ``mlflow.transformers.load_model`` and
``mlflow models serve`` work, and the folder's ``model/`` subfolder is a plain transformers checkpoint
(weights and tokenizer: ``from_pretrained`` loads it; :func:`champion_model` returns it for retraining). A LoRA
run's version also holds its adapter folder as ``adapter/`` (:func:`add_adapter`).

A version carries what the registry's pages show of it: a description (what the run did) and tags (lineage,
held-out accuracy, whether it is a short run); once registered, the champion rule decides whether the ``champion``
alias moves to it (:func:`crown`; tasks/records/tracking/champion.py), and retrain continues
``models:/<name>@champion`` (:func:`champion_model`). The tracker (tasks/records/tracking/tracker.py) queues the
registration through its outbox and calls :func:`register_version` when it sends it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import mlflow
from mlflow.entities import LoggedModelOutput
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.records.tracking.champion import CHAMPION, VERDICT_TAG, Verdict, verdict

log = logging.getLogger("rlsift")


def register_version(client: MlflowClient, run_id: str, name: str, path: str | Path, tags: dict[str, str],
                     description: str | None = None) -> str:
    """Log the saved MLflow Model at ``path`` as run ``run_id``'s logged model and register it as a new version of
    ``name`` with ``tags`` and ``description``; the saved folder is removed once the server holds it.

    Idempotent: a resend after a kill finds the version this run already registered and returns it."""
    mine = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if mine:
        version = str(max(int(v.version) for v in mine))
        crown(client, name, version)  # a kill may have come between the registration and the alias
        return version
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name)
    run = client.get_run(run_id)
    model = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                       model_type="transformers")
    client.log_model_artifacts(model.model_id, str(path))
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])  # the run's "Logged models"
    version = client.create_model_version(name, model.artifact_location, run_id=run_id, tags=tags,
                                          description=description, model_id=model.model_id).version
    shutil.rmtree(path, ignore_errors=True)  # sent: the server holds it now
    crown(client, name, str(version))
    return str(version)


def crown(client: MlflowClient, name: str, version: str) -> Verdict:
    """Apply the champion rule (tasks/records/tracking/champion.py) to ``version`` of ``name``: move the
    ``champion`` alias to it when it wins, and tag it with the verdict in words (``rlsift.champion``). Idempotent.
    Returns the verdict (also logged)."""
    tags = dict(client.get_model_version(name, version).tags)
    try:
        held = client.get_model_version_by_alias(name, CHAMPION)
        champion, champion_tags = str(held.version), dict(held.tags)
    except MlflowException:  # no champion yet
        champion, champion_tags = None, {}
    said = verdict(version, tags, champion, champion_tags)
    if said.crown and champion != version:
        client.set_registered_model_alias(name, CHAMPION, version)
    if tags.get(VERDICT_TAG) != said.reason:
        client.set_model_version_tag(name, version, VERDICT_TAG, said.reason)
    log.info("%s version %s: %s", name, version, said.reason)
    return said


def save_mlflow_model(checkpoint: str | Path, path: str | Path) -> Path:
    """Save a transformers checkpoint folder (weights and tokenizer) as an MLflow Model at ``path``.

    The ``transformers`` flavour with task ``text-generation`` (pyfunc: a string or list of strings in, the
    generated text out; ``max_new_tokens``, ``do_sample`` and ``temperature`` as inference params), that
    signature written out, the requirements pinned to the versions running now
    (MLflow's own inference of them imports and probes the model), and a model card naming rlsift (MLflow
    would otherwise ask the Hugging Face Hub for one). The model and tokenizer are loaded and handed over as
    components (MLflow's local-checkpoint path fails with transformers 5); ``path/model`` gets the
    checkpoint's tokenizer files too, so it is a complete checkpoint that ``from_pretrained`` loads.
    """
    import huggingface_hub
    import torch
    import transformers
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    checkpoint, path = Path(checkpoint), Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    params = ParamSchema([ParamSpec("max_new_tokens", "long", 256), ParamSpec("do_sample", "boolean", False),
                          ParamSpec("temperature", "double", 1.0)])
    signature = ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]), params=params)
    card = huggingface_hub.ModelCard("---\nlibrary_name: transformers\n---\nA policy trained by rlsift.\n")
    requirements = [f"mlflow=={mlflow.__version__}", f"transformers=={transformers.__version__}",
                    f"torch=={torch.__version__.split('+')[0]}"]
    mlflow.transformers.save_model({"model": model, "tokenizer": tokenizer}, str(path), task="text-generation",
                                   signature=signature, model_card=card, pip_requirements=requirements)
    for f in checkpoint.iterdir():  # tokenizer (and any other small) files beside the weights
        if f.is_file() and not (path / "model" / f.name).exists():
            shutil.copy2(f, path / "model" / f.name)
    return path


#: where a LoRA run's adapter folder lies in its registered version's MLflow Model (beside ``model/``)
ADAPTER_DIR = "adapter"


def add_adapter(model_dir: str | Path, adapter: str | Path) -> Path:
    """Copy a LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``: tasks/model/lora.py
    ``save_adapter``) into the saved MLflow Model at ``model_dir`` as its ``adapter/`` folder, so the registered
    version carries it: ``mlflow.artifacts.download_artifacts("models:/<name>/<version>")`` brings ``adapter/``
    with ``model/``. Returns the copy."""
    out = Path(model_dir) / ADAPTER_DIR
    shutil.rmtree(out, ignore_errors=True)
    return Path(shutil.copytree(adapter, out))


def checkpoint_folder(folder: str | Path) -> Path:
    """The transformers checkpoint inside an MLflow Model folder (``model/``); any other folder as it is."""
    folder = Path(folder)
    return folder / "model" if (folder / "MLmodel").is_file() and (folder / "model").is_dir() else folder


def latest_model(uri: str, name: str, dst: str | Path | None = None) -> tuple[str, str] | None:
    """(version, local checkpoint folder) of the newest registered version of ``name``, or None (:func:`download`).
    """
    client = MlflowClient(tracking_uri=uri)
    versions = client.search_model_versions(f"name = '{name}'")
    if not versions:
        return None
    return download(uri, max(versions, key=lambda v: int(v.version)), dst)


def champion_model(uri: str, name: str, dst: str | Path | None = None) -> tuple[str, str] | None:
    """(version, local checkpoint folder) of ``models:/<name>@champion`` (:func:`crown`), or None when ``name`` has
    no champion (no version yet, or only short runs and versions without an evaluation) (:func:`download`)."""
    client = MlflowClient(tracking_uri=uri)
    try:
        mv = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    return download(uri, mv, dst)


def download(uri: str, mv, dst: str | Path | None = None) -> tuple[str, str]:
    """(version, local checkpoint folder) of the registered version ``mv``.

    The folder is the transformers checkpoint (:func:`checkpoint_folder`) of the downloaded MLflow Model.
    With ``dst``, the files are downloaded to ``dst/v<version>`` (reused when already there: a version's
    files never change); otherwise to a temporary folder.
    """
    if dst is None:
        folder = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, tracking_uri=uri)
        return str(mv.version), str(checkpoint_folder(folder))
    target = Path(dst) / f"v{mv.version}"
    if not target.is_dir():
        tmp = Path(dst) / f".v{mv.version}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(tmp), tracking_uri=uri)
        inner = tmp / Path(mv.source.rstrip("/")).name
        os.replace(inner if inner.is_dir() and not (tmp / "MLmodel").is_file() else tmp, target)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(mv.version), str(checkpoint_folder(target))


def model_version_tags(uri: str, name: str, version: str) -> dict[str, str]:
    return dict(MlflowClient(tracking_uri=uri).get_model_version(name, version).tags)
