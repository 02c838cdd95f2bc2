"""A scripted ``vllm serve`` for the default test tier: a real HTTP server (stdlib ``ThreadingHTTPServer`` in a thread,
on a free loopback port) that answers the endpoints :class:`tasks.generation.vllm_engine.VLLMEngine` uses, by sampling
with the tiny HF model in this process.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (token-id prompt, ``n``, ``max_tokens``,
``temperature`` (0: arg-max), ``top_p``, ``top_k``, ``stop_token_ids`` (decoding stops at any of them
or the EOS, as vLLM's), ``seed``, ``logprobs: 0``, ``return_token_ids``), ``POST
/collective_rpc`` with ``reload_weights`` (loads the safetensors of ``weights_path`` into its own copy, as vLLM's
in-place reload) and ``POST /reset_prefix_cache``. Started with ``enable_lora`` (vLLM's ``--enable-lora`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), also ``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``: plain PEFT
loads the adapter folder over a copy of the served weights; a name already loaded is refused with 400, as vLLM
without ``load_inplace``) and ``POST /v1/unload_lora_adapter`` (``lora_name``; 404 when not loaded), both answering
in plain text as vLLM does; a completion request naming a loaded adapter as its ``model`` samples from it, and
``/v1/models`` lists the adapters after the served model. Without ``enable_lora`` both endpoints answer 404.

Sampling: one request is its prompt with ``n`` rollouts through :func:`tasks.generation.rollout.decode` with the
request's settings (:meth:`HFEngine.sampling`), the noise keyed by the request's ``seed``; a process-wide lock
serialises every scripted server's sampling and reloads, so a request's answer depends on its prompt, n, seed and the
loaded weights alone, whichever server and thread answers it. Deviation from vLLM: its n children are seeded
``seed + j``; here rollout j's noise is keyed by ``(seed, j)`` (either way a seed gives one answer).

Failures on demand (:meth:`ScriptedVLLM.fail_after`): after k answered completions the server goes ``down`` (stops
listening: connection refused), answers ``500``, ``close``s the connection without an answer, ``hang``s past the
client's timeout, or answers ``400`` (a request it refuses: not a server failure).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import load_file

from tasks.generation.rollout import HFEngine, decode
from tasks.model.loading import load_policy

#: one sampling (or reload) at a time across every scripted server of the process.
_SAMPLING = threading.Lock()
FAILURES = ("down", "500", "close", "hang", "400")


class ScriptedVLLM:
    """One scripted server, serving the model folder ``model_dir`` (an ``export_for_vllm`` copy, as vLLM serves).

    Attributes:
        url: its base URL; model: its own copy of the weights; completions: completion requests answered;
        reloads: weight reloads done; prompts: the prompt ids it answered, in order; requests: the completion
        requests' bodies, in order; adapters: the LoRA adapters loaded now, by name; adapter_loads: adapter loads
        done; events: adapter loads and completions, in order.
    """

    def __init__(self, model_dir: str | Path, enable_lora: bool = False):
        self.model_dir = str(Path(model_dir).resolve())
        self.model, self.tok = load_policy(model_dir)
        self.model.eval().requires_grad_(False)
        self.enable_lora = enable_lora
        self.adapters: dict[str, torch.nn.Module] = {}  # loaded LoRA adapters by name: PEFT over a copy
        self.adapter_loads = 0
        self.events: list[tuple[str, str]] = []  # ("load", adapter) and ("sample", the request's model), in order
        self.completions = self.reloads = 0
        self.prompts: list[list[int]] = []
        self.requests: list[dict] = []
        self._fail_after: int | None = None
        self._failure = "down"
        self._release = threading.Event()  # lets hanging handlers go at close
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name=f"scripted-vllm-{self.url}",
                                        daemon=True)
        self._thread.start()
        self._listening = True

    def fail_after(self, k: int, failure: str = "down") -> None:
        """Answer ``k`` more completion requests, then fail every request as ``failure`` (:data:`FAILURES`)."""
        if failure not in FAILURES:
            raise ValueError(f"failure {failure!r}: one of {FAILURES}")
        with self._lock:
            self._fail_after, self._failure = self.completions + k, failure

    def failing(self, completion: bool) -> str | None:
        """The failure to act out for this request once the server is past its ``fail_after``, else None (a
        completion request is then counted: it will be answered)."""
        with self._lock:
            if self._fail_after is not None and self.completions >= self._fail_after:
                return self._failure
            self.completions += completion
            return None

    def stop_listening(self) -> None:
        """Stop accepting connections (a crashed server: connection refused from now on)."""
        with self._lock:
            if not self._listening:
                return
            self._listening = False
        self.httpd.shutdown()
        self.httpd.server_close()

    def close(self) -> None:
        self._release.set()
        self.stop_listening()
        self._thread.join(timeout=10)

    # -- what the endpoints do ----------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> tuple[int, str]:
        """``/v1/load_lora_adapter``: (HTTP status, plain-text answer)."""
        from peft import PeftModel

        with self._lock:
            if name in self.adapters:
                return 400, f"The lora adapter '{name}' has already been loaded."
        with _SAMPLING:
            adapted = PeftModel.from_pretrained(copy.deepcopy(self.model), path).eval().requires_grad_(False)
        with self._lock:
            self.adapters[name] = adapted
            self.adapter_loads += 1
            self.events.append(("load", name))
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, name: str) -> tuple[int, str]:
        """``/v1/unload_lora_adapter``: (HTTP status, plain-text answer)."""
        with self._lock:
            if self.adapters.pop(name, None) is None:
                return 404, f"The lora adapter '{name}' cannot be found."
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def served(self, name: str | None) -> torch.nn.Module | None:
        """The model a request's ``model`` names: the served one, a loaded adapter, or None (unknown)."""
        with self._lock:
            return self.model if name == self.model_dir else self.adapters.get(name)

    def complete(self, body: dict) -> dict:
        model = self.served(body.get("model"))
        prompt, n = list(body["prompt"]), int(body["n"])
        temperature = float(body.get("temperature", 1.0))
        engine = HFEngine(model, self.tok, max_new_tokens=int(body["max_tokens"]),
                          temperature=temperature or 1.0, top_p=float(body.get("top_p", 1.0)),
                          top_k=max(0, int(body.get("top_k", 0))), chunk=n)
        ids = torch.tensor([prompt], dtype=torch.long)
        stops = tuple(dict.fromkeys([self.tok.eos_token_id, *body.get("stop_token_ids", [])]))
        with _SAMPLING:
            out, logp = decode(model, ids, torch.ones_like(ids), n=n, max_new_tokens=engine.max_new_tokens,
                               sampling=engine.sampling() if temperature > 0 else None, stop_ids=stops,
                               pad_id=self.tok.pad_token_id, seeds=torch.tensor([int(body["seed"])]))
        choices = []
        for j in range(n):
            row = out[j].tolist()
            ends = [t for t, x in enumerate(row) if x in stops]
            stopped = bool(ends)
            end = ends[0] + 1 if stopped else len(row)  # vLLM keeps the stop token
            choices.append({"index": j, "text": self.tok.decode(row[:end], skip_special_tokens=True),
                            "token_ids": row[:end], "logprobs": {"token_logprobs": logp[j, :end].tolist()},
                            "finish_reason": "stop" if stopped else "length"})
        with self._lock:
            self.prompts.append(prompt)
            self.requests.append(body)
            self.events.append(("sample", body["model"]))
        return {"id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "model": self.model_dir,
                "choices": choices}

    @torch.no_grad()
    def reload(self, weights_path: str) -> None:
        """vLLM's ``reload_weights(weights_path=)``: every safetensors file of the folder into this copy, strictly."""
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(weights_path).glob("*.safetensors")):
            state |= load_file(str(f))
        with _SAMPLING:
            self.model.load_state_dict(state, strict=True)
        with self._lock:
            self.reloads += 1


def _handler(server: ScriptedVLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - quiet
            pass

        def _send(self, code: int, payload: dict | None = None) -> None:
            raw = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _send_text(self, code: int, text: str) -> None:
            raw = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _act(self, completion: bool) -> bool:
            """Act out the scripted failure; True when the request must not be answered normally."""
            how = server.failing(completion)
            if how is None:
                return False
            if how in ("500", "400"):
                self._send(int(how), {"error": "scripted failure\nsecond line"})
            elif how == "hang":
                server._release.wait(60)
                self.close_connection = True
            else:  # close, down: no answer at all
                self.close_connection = True
                if how == "down":
                    threading.Thread(target=server.stop_listening, daemon=True).start()
            return True

        def do_GET(self):  # noqa: N802 - http.server's name
            if self._act(False):
                return
            if self.path == "/health":
                self._send(200)
            elif self.path == "/v1/models":
                adapters = [{"id": a, "object": "model", "parent": server.model_dir} for a in list(server.adapters)]
                self._send(200, {"object": "list", "data": [{"id": server.model_dir, "object": "model"}, *adapters]})
            else:
                self._send(404, {"error": f"no {self.path}"})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self._act(self.path == "/v1/completions"):
                return
            if self.path == "/v1/completions":
                if server.served(body.get("model")) is None:
                    self._send(404, {"error": f"model {body.get('model')!r} does not exist"})
                else:
                    self._send(200, server.complete(body))
            elif self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and server.enable_lora:
                if self.path == "/v1/load_lora_adapter":
                    self._send_text(*server.load_adapter(body["lora_name"], body["lora_path"]))
                else:
                    self._send_text(*server.unload_adapter(body["lora_name"]))
            elif self.path == "/collective_rpc":
                if body.get("method") != "reload_weights":
                    self._send(400, {"error": f"unknown method {body.get('method')!r}"})
                    return
                server.reload(body["kwargs"]["weights_path"])
                self._send(200, {"results": [None]})
            elif self.path == "/reset_prefix_cache":
                self._send(200)
            else:
                self._send(404, {"error": f"no {self.path}"})

    return Handler
