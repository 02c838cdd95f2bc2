"""The data sections: the prompt pool and held-out set (``data.*``) and each of its sources (``data.sources``),
read by the ingest stage (tasks/data/ingest.py, tasks/data/sources.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import _Frozen


class SourceConfig(_Frozen):
    """One data source: the bundled generator or a local file/folder (tasks/data/sources.py)."""

    kind: Literal["bundled", "file"] = Field("bundled", description=(
        "bundled: the generated arithmetic task (tasks/data/arith.py); file: a local file or folder at 'path'."))
    # bundled generator
    mix: str | dict[int, float] = Field("default", description=(
        "Bundled only: level mix, 'default', 'balanced' (tasks/data/arith.py MIXES) or {level: weight}."))
    n_train: int = Field(2000, ge=1, description="Bundled only: prompts generated for the train split.")
    n_test: int = Field(1000, ge=0, description="Bundled only: prompts generated for the held-out test split.")
    seed: int = Field(0, description="Bundled only: generator seed (the problems depend on it alone).")
    # files
    path: str | None = Field(None, description="File only: local file or folder to read (required for kind=file).")
    format: Literal["gsm8k", "math", "math500", "humaneval", "jsonl", "parquet", "hf"] | None = Field(
        None, description="File only: row format (tasks/data/sources.py); None: guessed from the content.")
    split: Literal["train", "test"] | None = Field(None, description=(
        "File only: split of the rows; None: from the file name (train/test in it), else the format's default."))
    fields: dict[str, str] | None = Field(None, description=(
        "File only, generic formats (jsonl, parquet, hf): field mapping {question, answer, solution, level}."))
    reward: Literal["arith", "numeric", "math", "code"] | None = Field(None, description=(
        "Verifier (tasks/data/rewards.py); None: the format's own, math for generic formats. Bundled: arith (the "
        "default: the marked or boxed final integer, every worked line true) or numeric (the final number alone, "
        "for a real model that answers in prose; conf/real/smollm2.yaml)."))
    limit: int | None = Field(None, ge=1, description="Keep at most this many rows per split (after ingest).")

    @model_validator(mode="after")
    def _need_path(self) -> SourceConfig:
        if self.kind == "file" and not self.path:
            raise ValueError("a 'file' source needs 'path'")
        if self.kind == "bundled" and self.reward not in (None, "arith", "numeric"):
            raise ValueError(f"a 'bundled' source's reward is arith or numeric, got {self.reward!r}")
        return self


class DataConfig(_Frozen):
    """The prompt pool and held-out set (ingest stage, tasks/data/ingest.py)."""

    sources: tuple[SourceConfig, ...] = Field((SourceConfig(),), description=(
        "Data sources, ingested in order into one pool (exact duplicates dropped, bad rows quarantined)."))
    test_from_train: float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this share of train prompts as test when a source has no test split."
    )
