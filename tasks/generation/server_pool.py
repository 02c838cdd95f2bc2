"""Rollouts from several ``vllm serve`` processes at once (``rollout.vllm_url`` with more than one URL).

:class:`ServerPool` is a :class:`tasks.generation.rollout.RolloutEngine` over one
:class:`tasks.generation.vllm_engine.VLLMEngine` per server:

- ``generate``: the call's prompts are cut into contiguous slices, one per live server, balanced by count (sizes
  differ by at most one), and the servers are asked at once. Prompt b of the call is sampled with
  ``prompt_seed(seed, b)`` whichever server answers it, and the rows come back prompt-major, so a call's
  :class:`Generation` does not depend on the number of servers (given the same weights on each).
- ``sync_weights``: the policy is exported once (``export_for_vllm``; with ``weight_sync="adapter"`` its LoRA
  adapter, ``export_adapter``), then every live server reloads that folder at once (so the folder must be readable
  by every server: one machine or a shared file system).
- Failure: a server that fails (:class:`ServerDown`: connection refused or reset, a timeout, HTTP 5xx) is dropped
  for the rest of the run, with one warning on the ``rlsift.rollout`` logger (the run's log), e.g. ``vLLM server
  http://10.0.0.2:8000 failed ([Errno 111] Connection refused); its 12 prompts go to the 1 other server; 1 of 2
  servers left``. The prompts it had not answered are sent again, same seeds, to the servers left; the answers it
  gave before failing are kept (a seed gives one answer). A failure in ``sync_weights`` drops the server the same
  way. With no server left, :class:`VLLMError` names every server and why it was dropped, and the training loop stops
  there, at its last checkpoint. Other errors (an HTTP 4xx: a request every server would refuse) are raised as
  they are, without dropping anyone.
- ``metrics``: ``rollout/servers_live`` and, per server i (its place in ``rollout.vllm_url``),
  ``rollout/server<i>_prompts``, the prompts it has answered so far.

Deviations: a dropped server is not asked again in this run, even when it comes back (it would sample older
weights until the next sync); ``rlsift run --resume`` with the same or other URLs (``rollout.vllm_url`` may change
on resume) uses every server given again. The split is by prompt count, not by the servers' speed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tasks.config import RolloutConfig
from tasks.generation.rollout import Generation, RolloutEngine
from tasks.generation.vllm_engine import (
    ServerDown,
    VLLMEngine,
    VLLMError,
    choices_to_generation,
    prompt_seed,
    prompt_token_ids,
)
from tasks.generation.vllm_export import export_adapter, export_for_vllm, prune_adapters

log = logging.getLogger("rlsift.rollout")


def spread(items: Sequence[int], parts: int) -> list[list[int]]:
    """``items`` cut into ``parts`` contiguous slices whose sizes differ by at most one (the first ones longer)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(list(items[start:end]))
        start = end
    return out


class ServerPool(RolloutEngine):
    """Sampling spread over several ``vllm serve`` processes, dropping those that fail (see the module docstring).

    Args:
        urls: the servers' base URLs (``rollout.vllm_url``), at least one, no duplicates.
        tokenizer, max_new_tokens, temperature, top_p, top_k, stop_ids, timeout, concurrency, weight_sync: every
            server's :class:`VLLMEngine` settings (``concurrency``: prompts in flight per server; ``weight_sync``:
            merged weights or the LoRA adapter at each sync).
    """

    def __init__(self, urls: Sequence[str], tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, stop_ids: Sequence[int], timeout: float = 600.0, concurrency: int = 64,
                 weight_sync: str = "merged"):
        if not urls:
            raise ValueError("ServerPool needs at least one server URL (rollout.vllm_url)")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError(f"ServerPool: duplicate server URLs in {list(urls)}")
        self.tok = tokenizer
        self.servers = [VLLMEngine(u, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k, stop_ids=stop_ids, timeout=timeout, concurrency=concurrency,
                                   weight_sync=weight_sync)
                        for u in urls]
        self.weight_sync = weight_sync
        self.dropped: dict[str, str] = {}  # url -> why it was dropped
        self.answered: dict[str, int] = {s.url: 0 for s in self.servers}  # prompts each server answered
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, rc: RolloutConfig, tokenizer, stop_ids: Sequence[int], lora: bool = False) -> ServerPool:
        """The pool of ``rollout.vllm_url`` with the run's sampling settings, the policy's end-of-turn ids and
        ``rollout.vllm_weight_sync`` resolved for a policy with (``lora``) or without adapters (tasks/stages.py
        ``prepare_stage``)."""
        return cls(rc.vllm_url, tokenizer, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature,
                   top_p=rc.top_p, top_k=rc.top_k, stop_ids=stop_ids, timeout=rc.vllm_timeout,
                   weight_sync=rc.weight_sync(lora))

    @property
    def live(self) -> list[VLLMEngine]:
        """The servers still in use, in ``rollout.vllm_url`` order."""
        return [s for s in self.servers if s.url not in self.dropped]

    def _drop(self, failed: list[tuple[VLLMEngine, str, int | None]]) -> None:
        """Take the ``failed`` servers (server, why, its unanswered prompts of this call, None in a weight sync) out
        of the pool, one warning line each; :class:`VLLMError` naming every server and why when none is left."""
        with self._lock:
            for server, reason, _ in failed:
                self.dropped[server.url] = reason
            left = len(self.live)
        for server, reason, unanswered in failed:
            where = " in the weight sync" if unanswered is None else ""
            if not left:
                log.warning("vLLM server %s failed%s (%s); no server left", server.url, where, reason)
                continue
            moved = "" if unanswered is None else \
                f"; its {unanswered} prompt{'s'[:unanswered != 1]} go to the {left} other server{'s'[:left != 1]}"
            log.warning("vLLM server %s failed%s (%s)%s; %d of %d servers left", server.url, where, reason, moved,
                        left, len(self.servers))
        if not left:
            raise VLLMError(self._none_left())

    def _none_left(self) -> str:
        return "every vLLM server failed: " + "; ".join(f"{u} ({r})" for u, r in self.dropped.items())

    # -- generation -------------------------------------------------------------------------------------
    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False, *, first: int = 0) -> Generation:
        """n completions for each prompt (prompt-major rows), prompt b seeded ``prompt_seed(seed, first + b)`` on
        whichever live server answers it; a server that fails is dropped and its unanswered prompts asked of the
        others."""
        prompt_ids = prompt_token_ids(self.tok, prompts)
        out: list[list[dict] | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:
            live = self.live
            if not live:  # a pool emptied by an earlier call
                raise VLLMError(self._none_left())
            shares = [s for s in zip(live, spread(todo, len(live)), strict=True) if s[1]]
            with ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="rlsift-pool") as pool:
                futures = [pool.submit(self._ask, server, [(b, prompt_ids[b].tolist(), prompt_seed(seed, first + b))
                                                           for b in share], n, greedy, out)
                           for server, share in shares]
                reasons = [f.result() for f in futures]  # an error that is not ServerDown is raised here
            failed = []
            for (server, share), reason in zip(shares, reasons, strict=True):
                done = sum(out[b] is not None for b in share)
                with self._lock:
                    self.answered[server.url] += done
                if reason is not None:
                    failed.append((server, reason, len(share) - done))
            self._drop(failed)
            todo = [b for b in todo if out[b] is None]
        return choices_to_generation(self.tok, prompt_ids, out, n)

    @staticmethod
    def _ask(server: VLLMEngine, items: list[tuple[int, list[int], int]], n: int, greedy: bool,
             out: list[list[dict] | None]) -> str | None:
        """Send ``items`` (index in the call, prompt ids, seed) to ``server``, up to its ``concurrency`` at once,
        filling ``out``; returns why the server failed (then the items not yet sent are left), else None."""
        failed: list[str] = []

        def one(item: tuple[int, list[int], int]) -> None:
            b, ids, s = item
            if failed:
                return
            try:
                out[b] = server.complete(ids, n, s, greedy)
            except ServerDown as err:
                failed.append(err.reason)

        with ThreadPoolExecutor(max_workers=max(1, min(server.concurrency, len(items)))) as pool:
            list(pool.map(one, items))
        return failed[0] if failed else None

    # -- weights ----------------------------------------------------------------------------------------
    def sync_weights(self, model: torch.nn.Module, tokenizer, folder: str | Path) -> float:
        """Export ``model`` to ``folder`` once (its merged weights, or its LoRA adapter), then every live server
        loads it (at once); seconds. A server that fails here is dropped (:class:`VLLMError` when none is left)."""
        t0 = time.perf_counter()
        live = self.live
        if not live:
            raise VLLMError(self._none_left())
        adapter = self.weight_sync == "adapter"
        path = export_adapter(model, folder) if adapter else export_for_vllm(model, tokenizer, folder)

        def reload(server: VLLMEngine) -> str | None:
            try:
                if adapter:
                    server.load_adapter(path, path.name)
                else:
                    server.reload_weights(path)
                return None
            except ServerDown as err:
                return err.reason

        with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="rlsift-pool") as pool:
            reasons = list(pool.map(reload, live))
        self._drop([(server, reason, None) for server, reason in zip(live, reasons, strict=True) if reason is not None])
        if adapter:
            prune_adapters(folder, path)
        return time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """``rollout/servers_live`` and ``rollout/server<i>_prompts`` (prompts answered so far, i: the server's
        place in ``rollout.vllm_url``)."""
        with self._lock:
            return {"rollout/servers_live": float(len(self.live))} | {
                f"rollout/server{i}_prompts": float(self.answered[s.url]) for i, s in enumerate(self.servers)}
