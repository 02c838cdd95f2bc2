"""The outside control of the benchmark: TRL's ``GRPOTrainer`` on the same model, data, reward and budget.

TRL (github.com/huggingface/trl, pinned 1.16.0 in requirements.txt) is the one
maintained GRPO trainer that runs end to end on a CPU without vLLM, which makes it a clean "plain GRPO"
arm that is not our code. What it shares with our runs:

- **Model**: the same warm-started folder (``tasks.model.loading.load_policy``); the tokenizer *object* is passed
  as ``processing_class`` (given a path, TRL may load another tokenizer class).
- **Data**: the configured sources through the same ingest code, train prompts formatted with
  ``tasks.model.loading.format_prompt`` (chat template and system prompt when the tokenizer has one). Prompts are
  tokenized exactly as ``tasks.generation.rollout.HFEngine`` does (``rollout.add_special``: BOS in the plain
  format, nothing added under a chat template): ``_ControlTrainer`` overrides TRL's ``_tokenize_prompts``.
- **Reward**: ``tasks.data.rewards.batch_rewards`` on the prompt's record (``arith_grade.verify`` for the bundled task).
- **Budget**: ``train.steps`` optimizer steps, each on ``train.prompts_per_step`` prompts x ``rollout.n``
  completions (one generation per step: ``steps_per_generation=1``, ``num_iterations=1``).
- **Loss and optimizer**: ``train.aggregation`` token -> ``loss_type="dapo"`` (token-level, normalised by
  active tokens), sequence -> ``"grpo"``; ``train.scale_std`` -> ``scale_rewards="group"`` else ``"none"``
  (Dr.-GRPO); clip ``epsilon``, ``beta`` = ``train.kl_coef``; AdamW with the same lr, betas, weight decay,
  gradient clipping and a constant learning rate (TRL's default is a linear decay; ours has no schedule).
- **Attention kernels**: the runs' (``tasks.model.attention.guard_attention``: cuDNN SDPA off on CUDA), which
  matters more here: TRL's passes carry a padding mask, pytorch/pytorch#196678's trigger.
- **Evaluation**: :class:`EvalClock` runs the project's ``tasks.evaluation.heldout.evaluate`` (greedy, HFEngine) on
  the same held-out prompts at step 0, every ``eval.every`` steps and at the last step, and keeps the clock
  like our runs do: training wall-clock excludes evaluation.

Deviations: ``train.minibatches`` must be 1 (ours would take several optimizer steps per batch), and with a KL term
``train.kl_rows`` must be ``all`` (TRL's ``beta`` applies to every completion); PODS,
replay, selection and curricula do not exist in TRL (that is the point of the control).

Per-step rows go to ``<run dir>/metrics.jsonl`` in our format (``time/<stage>_s`` cumulative via
``tasks.records.cost.CostMeter`` with stages ``rollout`` = generation + reward, ``tracking`` = our logging,
``update`` = the rest of the step, ``eval_during``; ``train/effective_ratio`` = 1 - TRL's
``frac_reward_zero_std``), so the benchmark reads TRL and our runs the same way.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.data.rewards import batch_rewards
from tasks.evaluation.heldout import EvalResult, evaluate
from tasks.generation.rollout import HFEngine
from tasks.model.attention import guard_attention
from tasks.model.loading import add_special, format_prompt, load_policy
from tasks.policy import Policy
from tasks.records.cost import CostMeter
from tasks.records.files import write_json
from tasks.records.progress import show_progress
from tasks.run import resolve_device
from tasks.update.precision import Precision, resolve_precision

log = logging.getLogger("rlsift.trl")


def grpo_args(cfg: Config, out_dir: Path, device: torch.device, precision: Precision | None):
    """TRL's ``GRPOConfig`` for the same budget, loss and optimizer as our plain GRPO configuration.

    ``model.precision`` in transformers' terms: ``bf16=True`` is bf16 autocast over the weights the model was loaded
    in (``precision.master``: float32 under ``bf16-mixed``, transformers' mixed precision with float32 master
    weights and AdamW state; bf16 under ``bf16-true``); None or ``fp32``: float32."""
    tc, rc = cfg.train, cfg.rollout
    if tc.minibatches != 1:
        raise ValueError(f"the TRL control supports train.minibatches=1 only, got {tc.minibatches}")
    if tc.warmup_steps or tc.lr_schedule != "constant":
        raise ValueError("the TRL control runs GRPO's constant learning rate: it needs train.warmup_steps=0 and "
                         f"train.lr_schedule=constant, got {tc.warmup_steps} and {tc.lr_schedule!r} (transformers' "
                         "schedules count their steps differently from tasks.update.updater.scheduled_lr)")
    if tc.kl_coef > 0 and tc.kl_rows != "all":
        raise ValueError(f"the TRL control's KL term covers every completion: train.kl_rows must be 'all' with "
                         f"train.kl_coef > 0, got {tc.kl_rows!r}")
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), max_steps=tc.steps, per_device_train_batch_size=tc.prompts_per_step * rc.n,
        num_generations=rc.n, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
        learning_rate=tc.lr, adam_beta1=tc.betas[0], adam_beta2=tc.betas[1], weight_decay=tc.weight_decay,
        max_grad_norm=tc.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        epsilon=tc.clip_eps, beta=tc.kl_coef, loss_type="dapo" if tc.aggregation == "token" else "grpo",
        scale_rewards="group" if tc.scale_std else "none",
        use_cpu=device.type == "cpu", bf16=precision is not None and precision.compute == torch.bfloat16,
        seed=cfg.seed, data_seed=cfg.seed, shuffle_dataset=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=not show_progress(), log_completions=False, dataloader_num_workers=0,
        gradient_checkpointing=False,  # ours recomputes nothing; TRL's default would trade speed for memory
    )


def _trainer_class():
    """``GRPOTrainer`` with generation timed and prompts tokenized like ``HFEngine`` (TRL imports lazily)."""
    from trl import GRPOTrainer

    class _ControlTrainer(GRPOTrainer):
        meter: CostMeter

        def _tokenize_prompts(self, prompts: list):
            if prompts and isinstance(prompts[0], str):
                special = add_special(self.processing_class)
                ids = self.processing_class(text=prompts, add_special_tokens=special)["input_ids"]
                return ids, None, {}
            return super()._tokenize_prompts(prompts)

        def _generate_and_score_completions(self, inputs):
            with self.meter.stage("rollout"):
                return super()._generate_and_score_completions(inputs)

    return _ControlTrainer


def reward_function(pool: list[PromptRecord], workers: int = 4):
    """TRL reward function: 1.0/0.0 per completion from our verifier, via the dataset's ``record_index``."""
    def rlsift_reward(completions, record_index, **_):
        return batch_rewards([pool[i] for i in record_index], list(completions), workers=workers)
    return rlsift_reward


class EvalClock(TrainerCallback):
    """Held-out evaluation on our schedule, a training clock that excludes it, and per-step metric rows.

    Args:
        policy: a ``Policy`` whose engine is bound to the model TRL trains (evaluated in place).
        records: the held-out prompts (already limited to ``eval.limit``).
        every: evaluate every this many steps (and at the last step); 0: only at the start and the end.
        seed: evaluation seed (greedy decoding does not use it).
        meter: shared with the trainer (``rollout`` is timed there).
        rows_path: where the metric rows go (``metrics.jsonl``).
        tracker: any ``tasks.records.tracking.Tracker``; each row is logged to it.
        rollouts_per_step: completions generated per step (B x n).
    """

    def __init__(self, policy: Policy, records: list[PromptRecord], every: int, seed: int, meter: CostMeter,
                 rows_path: Path, tracker, rollouts_per_step: int):
        self.policy, self.records, self.every, self.seed, self.meter = policy, records, every, seed, meter
        self.rows_path, self.tracker, self.rollouts_per_step = rows_path, tracker, rollouts_per_step
        self.t0 = 0.0
        self.pending: dict[int, dict] = {}
        self.start: EvalResult | None = None
        self.last: EvalResult | None = None

    def _evaluate(self, stage: str = "eval_during") -> EvalResult:
        with self.meter.stage(stage):
            return evaluate(self.policy, self.records, samples=0, seed=self.seed)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self._evaluate("eval_start")
        self.rows_path.write_text("")
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        # the clock: time since training began, less evaluation; what rollout and tracking did not take is update
        clock = time.perf_counter() - self.t0 - self.meter.seconds.get("eval_during", 0.0)
        timed = sum(v for k, v in self.meter.seconds.items() if k not in ("update", "prepare") and k[:4] != "eval")
        self.meter.add("update", max(0.0, clock - timed - self.meter.seconds.get("update", 0.0)))
        row = {"step": step - 1, "rollout/generated": float(self.rollouts_per_step), **self.meter.metrics()}
        if (self.every and step % self.every == 0) or step == state.max_steps:
            self.last = self._evaluate()
            row["eval/accuracy"] = self.last.overall.greedy_acc
        self.pending[step] = row

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        row = self.pending.pop(state.global_step, None)
        if row is None or "frac_reward_zero_std" not in logs:
            if row is not None:
                self.pending[state.global_step] = row
            return
        with self.meter.stage("tracking"):
            row |= {"train/effective_ratio": 1.0 - float(logs["frac_reward_zero_std"]),
                    "train/reward_mean": float(logs.get("reward", float("nan"))),
                    "trl/step_time_s": float(logs.get("step_time", float("nan"))),
                    "train/loss": float(logs.get("loss", float("nan")))}
            self._write(row)

    def on_train_end(self, args, state, control, **kwargs):
        for step in sorted(self.pending):
            self._write(self.pending.pop(step))

    def _write(self, row: dict) -> None:
        self.tracker.log_metrics({k: v for k, v in row.items() if k != "step"}, int(row["step"]))
        with open(self.rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")


def run_trl_control(cfg: Config, policy_path: str | Path, train: list[PromptRecord], test: list[PromptRecord],
                    run_dir: Path, tracker) -> dict:
    """Train the warm-started model with TRL's GRPOTrainer and evaluate it on our schedule.

    Args:
        cfg: the plain-GRPO configuration of the benchmark (budget, sampling, optimizer, eval, seed).
        policy_path: the warm-started model folder our runs started from.
        train, test: the ingested train and held-out prompts (same order as the pipeline's).
        run_dir: folder for ``metrics.jsonl``, ``eval_start.json``/``eval_end.json`` and ``summary.json``.
        tracker: a ``tasks.records.tracking.Tracker`` (a nested MLflow run in the benchmark).

    Returns:
        A summary with the keys the benchmark reads from our runs: ``run_dir``, ``steps``,
        ``eval_accuracy_start``, ``eval_accuracy_end``, ``effective_ratio``, ``wall_s``, ``device``,
        ``device_hours``, ``cost_usd``, ``stage_seconds``, ``mlflow_run_id``.
    """
    from datasets import Dataset

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.model.device)
    guard_attention(device)  # the runs' kernel choice: TRL's masked passes are pytorch#196678's trigger on CUDA
    precision = resolve_precision(cfg.model.precision, device)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    meter = CostMeter(prices=dict(cfg.cost.prices), device=cfg.cost.device)
    t_all = time.perf_counter()
    with meter.stage("prepare"):
        model, tok = load_policy(policy_path, dtype=precision.master, device=device)  # autocast computes bf16
        system = cfg.model.system_prompt if getattr(tok, "chat_template", None) else None
        dataset = Dataset.from_dict({"prompt": [format_prompt(tok, r.question, system) for r in train],
                                     "record_index": list(range(len(train)))})
        args = grpo_args(cfg, run_dir / "trl", device, precision)
        trainer_cls = _trainer_class()
        trainer = trainer_cls(model=model, reward_funcs=reward_function(train), args=args, train_dataset=dataset,
                              processing_class=tok)
        trainer.meter = meter
    engine = HFEngine.from_config(trainer.model, tok, cfg.rollout, device)
    held_out = test[: cfg.eval.limit] if cfg.eval.limit else test
    clock = EvalClock(Policy(trainer.model, tok, engine, system), held_out, cfg.eval.every, cfg.seed, meter,
                      run_dir / "metrics.jsonl", tracker, cfg.train.prompts_per_step * cfg.rollout.n)
    trainer.add_callback(clock)
    tracker.log_params({f"trl.{k}": v for k, v in args.to_dict().items()
                        if k in _LOGGED_ARGS} | {"rlsift.control": "trl", "policy_path": str(policy_path),
                                                 "seed": cfg.seed})
    trainer.train()
    start, end = clock.start, clock.last
    start.save(run_dir / "eval_start.json")
    end.save(run_dir / "eval_end.json")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = {
        "run_id": run_dir.name, "mlflow_run_id": tracker.run_id, "status": "completed", "control": "trl",
        "steps": trainer.state.global_step, "policy_path": str(policy_path),
        "eval_accuracy_start": start.overall.greedy_acc, "eval_accuracy_end": end.overall.greedy_acc,
        "effective_ratio": rows[-1].get("train/effective_ratio") if rows else None,
        "wall_s": time.perf_counter() - t_all, "device": meter.device, "device_hours": meter.device_hours(),
        "cost_usd": meter.usd(), "stage_seconds": dict(meter.seconds), "run_dir": str(run_dir),
    }
    write_json(run_dir / "summary.json", summary)
    tracker.log_metrics({"eval_start/accuracy": summary["eval_accuracy_start"],
                         "eval_end/accuracy": summary["eval_accuracy_end"]}, summary["steps"])
    for name in ("metrics.jsonl", "eval_start.json", "eval_end.json", "summary.json"):
        tracker.log_artifact(run_dir / name)
    del trainer, model
    return summary


_LOGGED_ARGS = ("max_steps", "per_device_train_batch_size", "num_generations", "max_completion_length",
                "temperature", "top_p", "top_k", "learning_rate", "adam_beta1", "adam_beta2", "weight_decay",
                "max_grad_norm", "lr_scheduler_type", "epsilon", "beta", "loss_type", "scale_rewards", "seed",
                "steps_per_generation", "num_iterations", "use_cpu", "bf16")
