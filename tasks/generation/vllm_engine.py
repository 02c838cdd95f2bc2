"""Rollout engine backed by a ``vllm serve`` process (OpenAI-compatible HTTP API, vLLM 0.32).

vLLM cannot live in the project's venv (its FastAPI pin conflicts with Prefect; docs/scale-out.md), so it
runs as a server from ``.venv-vllm`` (``infra/vllm-env.sh``, ``infra/vllm-serve.sh``) and this engine talks
to it with the standard library's ``urllib``:

- ``POST /v1/completions`` with the prompt as token ids (our tokenizer is the only one that tokenizes),
  ``n``, ``max_tokens``, ``temperature``/``top_p``/``top_k``, ``stop_token_ids`` (every end-of-turn id,
  ``tasks.generation.rollout.end_of_turn_ids``), a per-prompt ``seed``, ``logprobs: 0`` (the
  sampled token's log-prob only), ``return_token_ids: true`` (the completion's token ids in
  ``choices[i].token_ids``). One request per prompt, sent concurrently (vLLM batches them), so each prompt
  gets its own seed ``prompt_seed(seed, first + b)`` (``tasks.generation.rollout.prompt_seed``), b its index in the
  call and ``first`` the call's offset in a larger one, whichever
  server answers it (tasks/generation/server_pool.py spreads a call over several); vLLM gives the n children of a
  request ``seed + j``.
- Log-probs: ``infra/vllm-serve.sh`` starts the server with ``--logprobs-mode processed_logprobs`` so the
  returned values are after temperature (and top-k/top-p) scaling, i.e. the sampling distribution, which is
  what ``tasks.model.forward.token_logprobs(..., temperature)`` computes on the training side (equal when
  top_k=0 and top_p=1; the default ``raw_logprobs`` would ignore the temperature).
- Weight synchronisation (``sync_weights``, the :class:`tasks.generation.rollout.RolloutEngine` method): vLLM 0.32's
  in-place reload, ``Worker.reload_weights(weights_path=)``,
  called through the dev endpoint ``POST /collective_rpc`` (the server runs with ``VLLM_SERVER_DEV_MODE=1``),
  then ``POST /reset_prefix_cache`` so no KV block computed with the old weights is reused. The folder must
  hold the same architecture (written by :func:`tasks.generation.vllm_export.export_for_vllm`;
  :meth:`VLLMEngine.sync_weights` exports, then :meth:`VLLMEngine.reload_weights` loads).
  Choices: this disk round trip over the NCCL weight-transfer endpoints (``/init_weight_transfer_engine``,
  ``/update_weights``) because it works on CPU and across machines without a shared process group. Where
  dev mode is not allowed, the manual fallback is restarting the server on the new folder (about 30-50 s
  for the tiny model on a busy CPU).
- LoRA adapters instead of merged weights (``weight_sync="adapter"``: ``rollout.vllm_weight_sync``, by default under
  ``model.lora``): the server runs the frozen base model with ``--enable-lora --max-lora-rank R`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``VLLM_LORA_RANK=R bash infra/vllm-serve.sh BASE_DIR``); each sync writes
  the adapter folder (:func:`tasks.generation.vllm_export.export_adapter`: PEFT's files, the adapters the trainer
  computes with) and ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` loads it under a new name, which
  the completion requests then give as ``model``; the adapter it replaces is unloaded (``POST /v1/unload_lora_adapter``)
  (:meth:`VLLMEngine.load_adapter`). A new name each sync, not ``load_inplace``: vLLM keys its prefix cache by the
  adapter, so no KV block computed with the old one is reused, and no dev endpoint is needed. A sync then moves
  the adapters (r (in + out) numbers a target layer: about 1 % of a 1.5B model's weights at rank 16) instead of
  every weight; the price is vLLM's LoRA kernels in each decode step (docs/scale-out.md, "LoRA adapters").
- Tied embeddings: served and reloaded from copies with the head untied, since vLLM 0.32's in-place reload breaks
  the tie (tasks/generation/vllm_export.py, which writes the folders this engine loads).

The returned log-probs are the behaviour policy of the loss (``train.behaviour``, docs/algorithms.md section 8.2):
rollouts from weights synced at a round boundary (``overlap.lag=0``) or one step behind (``overlap.lag=1``) are
corrected by them, and so is the bf16 mismatch between server and trainer.

Errors: :class:`ServerDown` (a :class:`VLLMError`) when the server is gone or broken (connection refused or reset,
a timeout, an HTTP 5xx answer, an answer cut short), which a pool of servers answers by dropping it; any other
:class:`VLLMError` (an HTTP 4xx: a request the server refuses) is a bug every server would share.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tasks.generation.rollout import Generation, RolloutEngine, prompt_seed
from tasks.generation.vllm_export import export_adapter, export_for_vllm, prune_adapters
from tasks.model.forward import right_pad
from tasks.model.loading import add_special

__all__ = ["WEIGHT_SYNCS", "ServerDown", "VLLMEngine", "VLLMError", "prompt_seed"]

log = logging.getLogger("rlsift.rollout")

#: what a weight sync sends the server (``rollout.vllm_weight_sync`` resolved): every weight, or the LoRA adapter
WEIGHT_SYNCS = ("merged", "adapter")
NO_RUNTIME_LORA = ("start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank R "
                   "(VLLM_LORA_RANK=R bash infra/vllm-serve.sh BASE_DIR), or set rollout.vllm_weight_sync=merged")


class VLLMError(RuntimeError):
    """The vLLM server answered with an error or could not be reached."""


class ServerDown(VLLMError):
    """The server at ``url`` is gone or broken (``reason``: connection refused or reset, timed out, HTTP 5xx, an
    answer cut short): another server may take its requests."""

    def __init__(self, url: str, reason: str):
        self.url, self.reason = url, " ".join(reason.split())[:300]  # one line, whatever the server wrote
        super().__init__(f"vLLM server at {url} unreachable ({self.reason}); start it with infra/vllm-serve.sh "
                         "MODEL_DIR")


def prompt_token_ids(tokenizer, prompts: list[str]) -> list[torch.Tensor]:
    """The prompts as token ids, tokenized here (the server's tokenizer is never used)."""
    return [torch.tensor(tokenizer(p, add_special_tokens=add_special(tokenizer))["input_ids"], dtype=torch.long)
            for p in prompts]


def choices_to_generation(tokenizer, prompt_ids: list[torch.Tensor], per_prompt: list[list[dict]],
                          n: int) -> Generation:
    """The :class:`Generation` of the server's answers: ``per_prompt[b]``, the n choices of prompt b, laid out
    prompt-major; token ids and log-probs right-padded (vLLM stops after EOS, kept in ``token_ids``, or at
    ``max_tokens``), a missing log-prob as 0."""
    choices = [c for cs in per_prompt for c in cs]  # prompt-major, as Generation requires
    ids, mask = right_pad([c["token_ids"] for c in choices], tokenizer.pad_token_id)
    logp = torch.zeros(ids.shape, dtype=torch.float32)
    for i, c in enumerate(choices):
        lp = [x if x is not None else 0.0 for x in c["logprobs"]["token_logprobs"]]
        logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return Generation(prompt_ids=prompt_ids, completion_ids=ids, completion_mask=mask, texts=texts, n=n,
                      logprobs=logp)


class VLLMEngine(RolloutEngine):
    """Sampling through a running ``vllm serve`` (a :class:`tasks.generation.rollout.RolloutEngine`, like ``HFEngine``).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000``.
        tokenizer: the policy's tokenizer (tokenizes prompts, decodes completions, gives pad/eos ids).
        max_new_tokens, temperature, top_p, top_k: sampling settings (top_k 0: off).
        stop_ids: the tokens that end a turn (``tasks.generation.rollout.end_of_turn_ids``), sent as
            ``stop_token_ids``.
        timeout: seconds per HTTP request (past it the server counts as down: :class:`ServerDown`).
        concurrency: prompts in flight at once.
        weight_sync: what :meth:`sync_weights` sends (:data:`WEIGHT_SYNCS`): ``merged`` weights, reloaded in place,
            or the LoRA ``adapter``, loaded by name (module docstring).
    """

    def __init__(self, url: str, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, stop_ids: Sequence[int], timeout: float = 600.0, concurrency: int = 64,
                 weight_sync: str = "merged"):
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {', '.join(WEIGHT_SYNCS)}, got {weight_sync!r}")
        self.url = url.rstrip("/")
        self.tok = tokenizer
        self.stop_ids = tuple(int(i) for i in stop_ids)
        if not self.stop_ids:
            raise ValueError("VLLMEngine: stop_ids is empty; pass tasks.generation.rollout.end_of_turn_ids(model, tok)")
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.timeout, self.concurrency, self.weight_sync = timeout, concurrency, weight_sync
        self._model: str | None = None
        #: the LoRA adapter the requests name (:meth:`load_adapter`); None: the served model itself
        self.adapter: str | None = None

    # -- HTTP -------------------------------------------------------------------------------------------
    def _request(self, path: str, body: dict | None = None, timeout: float | None = None,
                 text: bool = False) -> dict | str | None:
        """``body`` POSTed to ``path`` (GET without one); the JSON answer, or with ``text`` the answer as text (the
        LoRA endpoints answer in plain text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            body = err.read().decode(errors="replace")[:2000]
            if err.code >= 500:
                raise ServerDown(self.url, f"{path}: HTTP {err.code}: {body}") from None
            raise VLLMError(f"vLLM {path}: HTTP {err.code}: {body}") from None
        except urllib.error.URLError as err:
            raise ServerDown(self.url, str(err.reason)) from None
        except (OSError, http.client.HTTPException) as err:  # reset, cut short, timed out
            raise ServerDown(self.url, f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        if text:
            return raw.decode(errors="replace")
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            raise ServerDown(self.url, f"{path}: not JSON: {raw[:200]!r}") from None

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
    def complete(self, prompt_ids: list[int], n: int, seed: int, greedy: bool) -> list[dict]:
        """One prompt's n choices (sorted by index), sampled with ``seed`` (:func:`prompt_seed`)."""
        body = {"model": self.adapter or self.model, "prompt": prompt_ids, "n": n, "max_tokens": self.max_new_tokens,
                "temperature": 0.0 if greedy else self.temperature, "top_p": 1.0 if greedy else self.top_p,
                "top_k": 0 if greedy else self.top_k, "stop_token_ids": list(self.stop_ids), "seed": seed % 2**31,
                "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": True}
        choices = sorted(self._request("/v1/completions", body)["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise VLLMError(f"vLLM returned {len(choices)} completions for n={n}")
        return choices

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False, *, first: int = 0) -> Generation:
        """n completions for each prompt (prompt-major rows), prompt b seeded ``prompt_seed(seed, first + b)``;
        ``logprobs`` are the server's (``--logprobs-mode processed_logprobs``: after temperature, top-k and top-p)."""
        prompt_ids = prompt_token_ids(self.tok, prompts)
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            per_prompt = list(pool.map(lambda b: self.complete(prompt_ids[b].tolist(), n,
                                                               prompt_seed(seed, first + b), greedy),
                                       range(len(prompts))))
        return choices_to_generation(self.tok, prompt_ids, per_prompt, n)

    # -- weights ----------------------------------------------------------------------------------------
    def reload_weights(self, model_dir: str | Path) -> float:
        """Load the weights saved in ``model_dir`` into the running server, in place. Returns seconds.

        Needs the server started with ``VLLM_SERVER_DEV_MODE=1`` (``infra/vllm-serve.sh`` does) and a folder
        the server can read (same machine or a shared file system).
        """
        path = Path(model_dir).resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a saved model folder (no config.json); "
                             "use tasks.model.loading.save_policy")
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

    def load_adapter(self, folder: str | Path, name: str) -> float:
        """Load the LoRA adapter folder ``folder`` (:func:`tasks.generation.vllm_export.export_adapter`) into the
        running server as ``name`` and name it in every request from now on; the adapter it replaces is unloaded.
        Returns seconds.

        Needs the server started on the adapters' base model with ``--enable-lora``, ``--max-lora-rank`` at least
        their rank and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``VLLM_LORA_RANK=R bash infra/vllm-serve.sh``),
        and a folder it can read (same machine or a shared file system).
        """
        from tasks.model.lora import ADAPTER_CONFIG

        path = Path(folder).resolve()
        if not (path / ADAPTER_CONFIG).is_file():
            raise ValueError(f"{path} is not a LoRA adapter folder (no {ADAPTER_CONFIG}); use "
                             "tasks.generation.vllm_export.export_adapter")
        t0 = time.perf_counter()
        try:
            self._request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, text=True)
        except ServerDown:
            raise
        except VLLMError as err:
            if "HTTP 404" in str(err):
                raise VLLMError(f"{err}: a vLLM server without runtime LoRA loading answers so; "
                                f"{NO_RUNTIME_LORA}") from None
            raise
        old, self.adapter = self.adapter, name
        if old is not None and old != name:
            try:
                self._request("/v1/unload_lora_adapter", {"lora_name": old}, text=True)
            except ServerDown:
                raise
            except VLLMError as err:  # already gone (a restarted server): nothing to free
                log.debug("unloading LoRA adapter %s from %s: %s", old, self.url, err)
        return time.perf_counter() - t0

    def sync_weights(self, model: torch.nn.Module, tokenizer, folder: str | Path) -> float:
        """Bring the server to ``model``'s weights through ``folder``; seconds. ``merged``: export the full model
        (:func:`tasks.generation.vllm_export.export_for_vllm`) and :meth:`reload_weights`; ``adapter``: export the
        LoRA adapter (:func:`tasks.generation.vllm_export.export_adapter`) and :meth:`load_adapter` it."""
        t0 = time.perf_counter()
        if self.weight_sync == "adapter":
            path = export_adapter(model, folder)
            self.load_adapter(path, path.name)
            prune_adapters(folder, path)
        else:
            self.reload_weights(export_for_vllm(model, tokenizer, folder))
        return time.perf_counter() - t0
