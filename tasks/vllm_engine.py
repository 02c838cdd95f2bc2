"""Rollout engine backed by a ``vllm serve`` process (OpenAI-compatible HTTP API, vLLM 0.32).

vLLM cannot live in the project's venv (its FastAPI pin conflicts with Prefect; ``shared/docs/stack.md``
section 6), so it runs as a server from ``.venv-vllm`` (``infra/vllm-env.sh``, ``infra/vllm-serve.sh``) and
this engine talks to it with the standard library's ``urllib``:

- ``POST /v1/completions`` with the prompt as token ids (our tokenizer is the only one that tokenizes),
  ``n``, ``max_tokens``, ``temperature``/``top_p``/``top_k``, a per-prompt ``seed``, ``logprobs: 0`` (the
  sampled token's log-prob only), ``return_token_ids: true`` (the completion's token ids in
  ``choices[i].token_ids``). One request per prompt, sent concurrently (vLLM batches them), so each prompt
  gets its own seed ``derive_seed(seed, b)``; vLLM gives the n children of a request ``seed + j``.
- Log-probs: ``infra/vllm-serve.sh`` starts the server with ``--logprobs-mode processed_logprobs`` so the
  returned values are after temperature (and top-k/top-p) scaling, i.e. the sampling distribution, which is
  what ``tasks.forward.token_logprobs(..., temperature)`` computes on the training side (equal when
  top_k=0 and top_p=1; the default ``raw_logprobs`` would ignore the temperature).
- Weight synchronisation (``sync_weights``): vLLM 0.32's in-place reload, ``Worker.reload_weights(weights_path=)``,
  called through the dev endpoint ``POST /collective_rpc`` (the server runs with ``VLLM_SERVER_DEV_MODE=1``),
  then ``POST /reset_prefix_cache`` so no KV block computed with the old weights is reused. The folder must
  hold the same architecture (a ``save_pretrained`` of the policy). Choices: this disk round trip over the
  NCCL weight-transfer endpoints (``/init_weight_transfer_engine``, ``/update_weights``) because it works on
  CPU and across machines without a shared process group; restarting the server (about 20 s on CPU) is the
  fallback when dev mode is not allowed.

Deviation (documented in ``docs/scale-out.md``): with weights synced at round boundaries, rollouts within a
round come from the round-start policy, not the current one; the update still treats them as on-policy.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tasks.rollout import Generation, derive_seed


class VLLMError(RuntimeError):
    """The vLLM server answered with an error or could not be reached."""


class VLLMEngine:
    """Sampling through a running ``vllm serve`` (same ``generate`` as :class:`tasks.rollout.HFEngine`).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000``.
        tokenizer: the policy's tokenizer (tokenizes prompts, decodes completions, gives pad/eos ids).
        max_new_tokens, temperature, top_p, top_k: sampling settings (top_k 0: off).
        timeout: seconds per HTTP request.
        concurrency: prompts in flight at once.
    """

    def __init__(self, url: str, tokenizer, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, timeout: float = 600.0, concurrency: int = 64):
        self.url = url.rstrip("/")
        self.tok = tokenizer
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.timeout, self.concurrency = timeout, concurrency
        self._model: str | None = None

    # -- HTTP -------------------------------------------------------------------------------------------
    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict | None:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            raise VLLMError(f"vLLM {path}: HTTP {err.code}: {err.read().decode(errors='replace')[:2000]}") from None
        except (urllib.error.URLError, OSError) as err:
            raise VLLMError(f"vLLM server at {self.url} unreachable ({err}); start it with "
                            "infra/vllm-serve.sh MODEL_DIR") from None
        return json.loads(raw) if raw.strip() else None

    def wait_ready(self, timeout: float = 300.0, poll: float = 1.0) -> float:
        """Block until ``GET /health`` answers; returns the seconds waited."""
        t0 = time.perf_counter()
        while True:
            try:
                self._request("/health", timeout=5)
                return time.perf_counter() - t0
            except VLLMError:
                if time.perf_counter() - t0 > timeout:
                    raise
                time.sleep(poll)

    @property
    def model(self) -> str:
        """The served model name (``GET /v1/models``)."""
        if self._model is None:
            self._model = self._request("/v1/models")["data"][0]["id"]
        return self._model

    # -- generation -------------------------------------------------------------------------------------
    def _complete(self, prompt_ids: list[int], n: int, seed: int, greedy: bool) -> list[dict]:
        body = {"model": self.model, "prompt": prompt_ids, "n": n, "max_tokens": self.max_new_tokens,
                "temperature": 0.0 if greedy else self.temperature, "top_p": 1.0 if greedy else self.top_p,
                "top_k": 0 if greedy else self.top_k, "seed": seed % 2**31, "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": True}
        choices = sorted(self._request("/v1/completions", body)["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise VLLMError(f"vLLM returned {len(choices)} completions for n={n}")
        return choices

    def generate_with_logprobs(self, prompts: list[str], n: int, seed: int,
                               greedy: bool = False) -> tuple[Generation, torch.Tensor]:
        """Like :meth:`generate`, plus the sampler's log-probs [B*n, L] float32 (0 on padding)."""
        prompt_ids = [torch.tensor(self.tok(p, add_special_tokens=False)["input_ids"], dtype=torch.long)
                      for p in prompts]
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            per_prompt = list(pool.map(lambda b: self._complete(prompt_ids[b].tolist(), n, derive_seed(seed, b),
                                                                greedy), range(len(prompts))))
        choices = [c for cs in per_prompt for c in cs]  # prompt-major, as Generation requires
        width = max([len(c["token_ids"]) for c in choices] + [0])
        pad = self.tok.pad_token_id
        ids = torch.full((len(choices), width), pad, dtype=torch.long)
        mask = torch.zeros((len(choices), width), dtype=torch.bool)
        logp = torch.zeros((len(choices), width), dtype=torch.float32)
        for i, c in enumerate(choices):
            t = c["token_ids"]
            ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
            mask[i, :len(t)] = True  # vLLM stops after EOS (kept in token_ids) or at max_tokens
            lp = [x if x is not None else 0.0 for x in c["logprobs"]["token_logprobs"]]
            logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        texts = self.tok.batch_decode(ids, skip_special_tokens=True)
        return Generation(prompt_ids=prompt_ids, completion_ids=ids, completion_mask=mask, texts=texts, n=n), logp

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> Generation:
        """n completions for each prompt (prompt-major rows), seeded per prompt from ``seed``."""
        return self.generate_with_logprobs(prompts, n, seed, greedy)[0]

    # -- weights ----------------------------------------------------------------------------------------
    def sync_weights(self, model_dir: str | Path) -> float:
        """Load the weights saved in ``model_dir`` into the running server, in place. Returns seconds.

        Needs the server started with ``VLLM_SERVER_DEV_MODE=1`` (``infra/vllm-serve.sh`` does) and a folder
        the server can read (same machine or a shared file system).
        """
        path = Path(model_dir).resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a saved model folder (no config.json); use tasks.policy.save_policy")
        t0 = time.perf_counter()
        try:
            self._request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        except VLLMError as err:
            if "HTTP 404" in str(err):
                raise VLLMError("the vLLM server has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1 "
                                "(infra/vllm-serve.sh), or restart it on the new folder") from None
            raise
        self._request("/reset_prefix_cache", {})
        return time.perf_counter() - t0
