"""Sampling the training rollouts (``rollout.*``): the engine (in-process or vLLM servers) and its sampling
settings (tasks/generation/rollout.py, tasks/generation/vllm_engine.py, tasks/generation/server_pool.py)."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from tasks.config.base import _Frozen


class RolloutConfig(_Frozen):
    """Sampling the training rollouts (tasks/generation/rollout.py, tasks/generation/vllm_engine.py)."""

    engine: Literal["hf", "vllm"] = Field("hf", description=(
        "hf: transformers generate() in process; vllm: a vLLM server over HTTP (docs/scale-out.md)."))
    vllm_url: tuple[str, ...] = Field(("http://127.0.0.1:8000",), description=(
        "Base URLs of the vLLM servers (engine=vllm): a list, or one URL for one server. Each generate call's prompts "
        "are spread over them, and a server that fails is dropped for the run (tasks/generation/server_pool.py). "
        "On the command line: rollout.vllm_url=[http://a:8000,http://b:8000]."))
    vllm_timeout: float = Field(600.0, gt=0, description=(
        "Seconds a vLLM request may take (engine=vllm); a server that does not answer within it counts as failed."))
    vllm_weight_sync: Literal["auto", "merged", "adapter"] = Field("auto", description=(
        "What the vLLM servers get of the policy at each weight sync (engine=vllm; docs/scale-out.md): merged: the "
        "full weights (adapters merged), reloaded in place; adapter: under model.lora, only the LoRA adapter, "
        "loaded through /v1/load_lora_adapter (the servers run the frozen base with --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING, infra/vllm-serve.sh) and named by each request; auto: adapter under "
        "model.lora, else merged."))
    n: int = Field(8, ge=2, description="Rollouts generated per prompt (PODS keeps pods.m of them).")
    max_new_tokens: int = Field(64, ge=1, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description=(
        "Sampling temperature of the rollouts (and of the log-probs the update computes for them)."))
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0: off).")
    chunk: int = Field(512, ge=1, description="Sequences per generate() call.")

    def weight_sync(self, lora: bool) -> Literal["merged", "adapter"]:
        """``vllm_weight_sync`` resolved for a run with (``lora``) or without LoRA adapters."""
        if self.vllm_weight_sync == "auto":
            return "adapter" if lora else "merged"
        return self.vllm_weight_sync

    @field_validator("vllm_url", mode="before")
    @classmethod
    def _url_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("vllm_url")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        if not urls:
            raise ValueError("give at least one vLLM server URL, e.g. [http://127.0.0.1:8000]")
        for url in urls:
            try:
                parts = urlsplit(url)
                ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
            except ValueError:  # a port that is not a number in 0-65535
                ok = False
            if not ok or any(c.isspace() for c in url):
                raise ValueError(f"{url!r} is not an http(s) URL such as http://127.0.0.1:8000")
        bare = [u.rstrip("/") for u in urls]
        twice = sorted({u for u in bare if bare.count(u) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} given more than once")
        return urls
