"""A registry with a champion (tasks/records/tracking/champion.py, registry.py ``crown``): every registered version
is a candidate; the ``champion`` alias moves only to a version with a higher held-out accuracy on the same
evaluation, never to a short run; retrain continues ``models:/<name>@champion`` (flows/retrain.py ``parent_model``).

The issue it answers: every run registered a version and the nightly retrain continued the newest, a 20-step smoke
model (0.567), not the 150-step one (0.623)."""

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from flows.retrain import parent_model
from tasks.config.load import load_config
from tasks.evaluation.heldout import EvalCell, EvalResult
from tasks.model.loading import build_tiny_model, build_tokenizer, load_policy, save_policy
from tasks.records.tracking import CHAMPION, MlflowTracker, champion_model
from tasks.records.tracking.champion import verdict
from tasks.report.registration import champion_tags, eval_fingerprint
from tasks.run import open_run
from tasks.training.step_records import TrainSummary

ROOT = Path(__file__).resolve().parents[2]
SAME = "f" * 64


def tags(acc: float, *, fingerprint: str = SAME, short: bool = False, steps: int = 150, start: float | None = None,
         parent: str | None = None) -> dict[str, str]:
    out = {"heldout_accuracy": f"{acc:.4f}", "eval_fingerprint": fingerprint, "eval_n": "300",
           "rlsift.short_run": str(short).lower(), "steps": str(steps)}
    if start is not None:
        out["heldout_accuracy_start"] = f"{start:.4f}"
    if parent is not None:
        out["parent_version"] = parent
    return out


def test_the_champion_rule():
    champ = tags(0.623)
    assert verdict("1", champ, None, {}).crown  # no champion yet: the first full run's version
    assert verdict("1", champ, "1", champ).crown  # already champion (a resend after a kill)
    better = verdict("2", tags(0.640), "1", champ)
    assert better.crown and better.reason == ("champion: held-out accuracy 0.6400 higher than champion version 1's "
                                              "0.6230 on the same evaluation (300 prompts)")
    worse = verdict("2", tags(0.567), "1", champ)
    assert not worse.crown and worse.reason.startswith("candidate: held-out accuracy 0.5670 not higher than")
    assert not verdict("2", tags(0.623), "1", champ).crown  # a tie stays with the champion
    short = verdict("3", tags(0.9, short=True, steps=20), "1", champ)
    assert not short.crown and short.reason == "candidate: a short run (20 steps), never champion"
    assert not verdict("3", tags(0.9, short=True), None, {}).crown  # not even as the first one
    other = tags(0.9, fingerprint="0" * 64)
    assert not verdict("4", other, "1", champ).crown  # other prompts: 0.9 there says nothing against 0.623 here
    assert "not comparable with champion version 1" in verdict("4", other, "1", champ).reason
    # a retrain from the champion: its own start evaluated the champion on its (grown) prompts
    assert verdict("5", tags(0.70, fingerprint="1" * 64, start=0.65, parent="1"), "1", champ).crown
    assert not verdict("5", tags(0.64, fingerprint="1" * 64, start=0.65, parent="1"), "1", champ).crown
    assert not verdict("6", {"rlsift.run_id": "r"}, None, {}).crown  # no evaluation recorded (an older version)


def evaluation(acc: float, n: int = 4, ids: tuple[str, ...] = ("a", "b", "c", "d")) -> EvalResult:
    cell = EvalCell(n=n, greedy_acc=acc)
    return EvalResult(overall=cell, by_level={1: cell}, by_source={"s": cell}, k=0, prompt_ids=ids,
                      greedy_correct=(1,) * n)


def test_a_short_run_says_so_in_its_version_tags(smoke_cfg):
    """conf/smoke.yaml's 20 steps are below ``tracking.champion_min_steps`` (100): a short run."""
    smoke = load_config(ROOT / "conf" / "smoke.yaml")
    assert smoke.train.steps < smoke.tracking.champion_min_steps
    run = open_run(smoke_cfg(), track=False)
    try:
        got = champion_tags(run, evaluation(0.25), evaluation(0.5), TrainSummary(steps=20))
        assert got["rlsift.short_run"] == "true" and got["heldout_accuracy_start"] == "0.2500"
        assert got["eval_n"] == "4" and got["eval_fingerprint"] == eval_fingerprint(evaluation(0.5), run.cfg)
        assert champion_tags(run, evaluation(0.25), evaluation(0.5), TrainSummary(steps=100))["rlsift.short_run"] == \
            "false"
    finally:
        run.close("completed", {})
    same = eval_fingerprint(evaluation(0.5, ids=("d", "c", "b", "a")), run.cfg)
    assert same == eval_fingerprint(evaluation(0.9), run.cfg)  # the prompts, not their order or the accuracy
    assert eval_fingerprint(evaluation(0.5, n=3, ids=("a", "b", "c")), run.cfg) != same


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny policies with different weights (seed 0 and 1), saved as transformers checkpoints."""
    root = tmp_path_factory.mktemp("champion")
    tok = build_tokenizer()
    return root, [save_policy(build_tiny_model(hidden=64, layers=1, heads=2, tokenizer=tok, seed=s), tok,
                              root / f"seed{s}") for s in (0, 1)]


def test_the_champion_moves_on_a_better_version_only_and_retrain_continues_it(checkpoints, tmp_path):
    """Versions registered through the run's tracker as the report stage does: v1 (0.623) becomes champion; v2 (a
    20-step smoke run, 0.9) and v3 (0.567) stay candidates; v4 (0.640, same evaluation) takes the alias. Retrain's
    parent is the champion's weights, not the newest version's."""
    root, (ckpt0, ckpt1) = checkpoints
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)

    def register(k: int, ckpt, version_tags: dict[str, str]) -> str:
        t = MlflowTracker(uri, "champion", tmp_path / f"run{k}", background=False)
        try:
            return t.register_model(ckpt, "rlsift-policy", version_tags)
        finally:
            t.finish()

    def champion() -> str:
        return str(client.get_model_version_by_alias("rlsift-policy", CHAMPION).version)

    assert champion_model(uri, "rlsift-policy") is None  # no model at all yet
    assert register(1, ckpt0, tags(0.623)) == "1" and champion() == "1"
    assert register(2, ckpt1, tags(0.9, short=True, steps=20)) == "2" and champion() == "1"
    assert register(3, ckpt1, tags(0.567)) == "3" and champion() == "1"
    said = {v: client.get_model_version("rlsift-policy", v).tags["rlsift.champion"] for v in ("1", "2", "3")}
    assert said["1"].startswith("champion") and said["2"].startswith("candidate: a short run")
    assert said["3"].startswith("candidate: held-out accuracy 0.5670 not higher")

    cfg = load_config(ROOT / "tests" / "fixtures" / "tiny.yaml",
                      [f"paths.root={tmp_path / 'root'}", f"tracking.uri={uri}"])
    version, folder = parent_model(cfg)  # what retrain starts from
    assert version == "1" and Path(folder) == tmp_path / "root" / "models" / "rlsift-policy" / "v1" / "model"
    ref, _ = load_policy(ckpt0)
    got, _ = load_policy(folder)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in ref.state_dict().items())  # v1's weights

    assert register(4, ckpt1, tags(0.640)) == "4" and champion() == "4"
    assert parent_model(cfg)[0] == "4"
