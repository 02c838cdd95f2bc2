"""The registered policy is an MLflow Model (transformers flavour): pyfunc and transformers load it from the
registry, ``mlflow models serve`` serves it, and retraining still gets a plain transformers checkpoint."""

import json
import os
import sys
import urllib.request
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from tasks.model.loading import build_tiny_model, build_tokenizer, load_policy, save_policy
from tasks.records.tracking import MlflowTracker, latest_model
from tests.servers import free_port, start, stop, wait_http


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A tiny policy registered twice through the tracker's outbox, in an offline sqlite store."""
    root = tmp_path_factory.mktemp("mlflow-model")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=1, heads=2, tokenizer=tok, seed=0)
    ckpt = save_policy(model, tok, root / "final_model")
    versions = []
    for k in range(2):
        t = MlflowTracker(uri, "models", root / f"run{k}", background=False)
        versions.append(t.register_model(ckpt, "rlsift-policy", {"rlsift.run_id": f"r{k}"}))
        t.finish()
    return uri, ckpt, versions, root


def test_registered_versions_are_logged_mlflow_models(registered):
    uri, _, versions, _ = registered
    assert versions == ["1", "2"]
    client = MlflowClient(tracking_uri=uri)
    mv = client.get_model_version("rlsift-policy", "2")
    assert "/models/m-" in mv.source and mv.tags["rlsift.run_id"] == "r1"
    logged = client.get_logged_model(mv.source.split("/models/")[1].split("/")[0])
    assert logged.source_run_id == mv.run_id and logged.status == "READY"
    outputs = client.get_run(mv.run_id).outputs.model_outputs  # what the run page lists as "Logged models"
    assert [o.model_id for o in outputs] == [logged.model_id]
    mlflow.set_tracking_uri(uri)
    info = mlflow.models.get_model_info("models:/rlsift-policy/2")
    assert "transformers" in info.flavors and "python_function" in info.flavors
    assert info.signature.inputs.to_dict() == [{"type": "string", "required": True}]


def test_pyfunc_and_transformers_load_from_the_registry_and_generate(registered):
    uri, ckpt, _, _ = registered
    mlflow.set_tracking_uri(uri)
    pyfunc = mlflow.pyfunc.load_model("models:/rlsift-policy/1")
    out = pyfunc.predict(["Q: 1+2=?\nA: "], params={"max_new_tokens": 4, "do_sample": False})
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], str)
    pipe = mlflow.transformers.load_model("models:/rlsift-policy/1")
    ref, _ = load_policy(ckpt)
    for k, v in ref.state_dict().items():  # the very weights that were registered
        assert torch.equal(pipe.model.state_dict()[k].cpu(), v), k


def test_retrain_gets_a_plain_transformers_checkpoint(registered, tmp_path):
    uri, ckpt, _, _ = registered
    version, folder = latest_model(uri, "rlsift-policy", dst=tmp_path)
    assert version == "2" and Path(folder) == tmp_path / "v2" / "model"
    model, tok = load_policy(folder)  # from_pretrained on weights and tokenizer files, as before
    ref, _ = load_policy(ckpt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert latest_model(uri, "rlsift-policy", dst=tmp_path) == (version, folder)  # cached, not downloaded twice


def test_mlflow_models_serve_serves_it(registered):
    uri, _, _, root = registered
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri,  # as from an activated venv: uvicorn is on PATH
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = root / "serve.log"
    proc = start([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/rlsift-policy/1", "--env-manager",
                  "local", "--host", "127.0.0.1", "--port", str(port)], env, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/ping", proc, log, timeout=120)
        body = json.dumps({"inputs": ["Q: 1+2=?\nA: "], "params": {"max_new_tokens": 4, "do_sample": False}})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body.encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert isinstance(answer["predictions"], list) and isinstance(answer["predictions"][0], str)
    finally:
        stop(proc)
