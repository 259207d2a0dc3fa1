"""Generation through an OpenAI-compatible server ("server" mode): ids in, ids and logprobs out.

Each request is one `POST /v1/completions` with the prompt as token ids, asking for the sampled
tokens back as ids (`return_token_ids`, vLLM's extension) with their logprobs, so nothing is ever
decoded and re-encoded. Requests run in worker threads (standard-library HTTP), as many at once
as episodes ask for, and the server batches them continuously. Any OpenAI-compatible server that
returns token ids works for generation; pushing weights needs `agentgrpo vllm-serve`.

Every failure to reach the server is a `ServerUnavailableError` that names the server and what
to do, raised after at most the configured timeout: never a hang.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping
from typing import Any

import anyio

from rollout.backends.vllm_colocate import check_sampling_overrides
from rollout.types import Completion, SamplingParams

_TOKEN_ID_PREFIX = "token_id:"


class ServerUnavailableError(ConnectionError):
    """The generation server did not answer: not started, unreachable, or gone mid-run."""


class ServerRequestError(RuntimeError):
    """The server answered a request with an error status; the message holds its reply."""


def server_url(base_url: str | None, host: str, port: int) -> str:
    """The server's base URL: `base_url` when set, else `http://host:port`.

    >>> server_url(None, "localhost", 8000)
    'http://localhost:8000'
    >>> server_url("http://gpu-box:9000/", "ignored", 1)
    'http://gpu-box:9000'
    """
    return (base_url or f"http://{host}:{port}").rstrip("/")


class ServerConnection:
    """JSON over HTTP to one server, with timeouts on every call.

    Args:
        base_url: e.g. `http://localhost:8000` (no `/v1`).
        timeout_s: How long `wait_until_up` waits, and each call may take (connecting, or
            waiting for the reply of a request the server is working on).

    """

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def wait_until_up(self) -> None:
        """Poll `/v1/models` until the server answers, for at most `timeout_s` seconds."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.get("/v1/models", timeout_s=5.0)
                return
            except ServerUnavailableError:
                if time.monotonic() >= deadline:
                    raise ServerUnavailableError(
                        f"no server answered at {self.base_url} within {self.timeout_s:g} s "
                        "(vllm_server_timeout). Start one with `agentgrpo vllm-serve --model "
                        "MODEL`, or point vllm_server_base_url (or vllm_server_host and "
                        "vllm_server_port) at a running one."
                    ) from None
                time.sleep(1.0)

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        """`GET path` and its JSON reply."""
        return self._call(urllib.request.Request(self.base_url + path), timeout_s)

    def post(
        self, path: str, body: Mapping[str, Any] | None = None, timeout_s: float | None = None
    ) -> Any:
        """`POST path` with a JSON body and its JSON reply (None for an empty reply)."""
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
        )
        return self._call(request, timeout_s)

    def _call(self, request: urllib.request.Request, timeout_s: float | None) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as reply:
                payload = reply.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            raise ServerRequestError(
                f"{request.get_method()} {request.full_url} failed with {error.code}: {detail}"
            ) from None
        except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out
            raise ServerUnavailableError(
                f"the server at {self.base_url} did not answer {request.get_method()} "
                f"{request.full_url} ({error!r}); if it stopped, restart it (`agentgrpo "
                "vllm-serve`) and resume the run from its last checkpoint"
            ) from None
        return json.loads(payload) if payload else None


class VLLMServerBackend:
    """A `GenerationBackend` over an OpenAI-compatible completions endpoint.

    Build it with `connect`. The sampler logprobs are what the server returns: with
    `agentgrpo vllm-serve` (`--logprobs-mode processed_logprobs`) the log-softmax at the
    request's temperature, as in `VLLMColocateBackend`; a plain vLLM server returns them at
    temperature 1.

    Args:
        connection: The server.
        model: The served model's name (the request's `model` field).
        stop_token_ids: Ids that end a turn; the stop id is kept as the last sampled token.
        context_limit: The server's context length (None: unknown, not checked here).
        sampling_overrides: Extra sampling fields for every request (`min_p`,
            `repetition_penalty`, ...), JSON-able.
        regex: Constrain every turn to this regular expression (vLLM structured outputs).
        max_concurrent_requests: The most requests in flight at once.

    """

    def __init__(
        self,
        connection: ServerConnection,
        model: str,
        stop_token_ids: Collection[int],
        context_limit: int | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        regex: str | None = None,
        max_concurrent_requests: int = 256,
    ):
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation would never end a turn")
        check_sampling_overrides(sampling_overrides or {})
        self.connection = connection
        self.model = model
        self.stop_token_ids = frozenset(stop_token_ids)
        self.context_limit = context_limit
        self.sampling_overrides = dict(sampling_overrides or {})
        if regex is not None:
            self.sampling_overrides["structured_outputs"] = {"regex": regex}
        self._threads = anyio.CapacityLimiter(max_concurrent_requests)

    @classmethod
    def connect(cls, connection: ServerConnection, **kwargs: Any) -> VLLMServerBackend:
        """Wait for the server, then serve its first model (its name and context length)."""
        connection.wait_until_up()
        [card, *_] = connection.get("/v1/models")["data"]
        return cls(connection, card["id"], context_limit=card.get("max_model_len"), **kwargs)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Send one completion request and return its sampled ids and logprobs."""
        if self.context_limit and len(prompt_ids) + params.max_tokens > self.context_limit:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                f"server's context of {self.context_limit} tokens (--max-model-len)"
            )
        body = self._request_body(prompt_ids, params)
        reply = await anyio.to_thread.run_sync(
            self.connection.post, "/v1/completions", body, limiter=self._threads
        )
        return _completion(reply["choices"][0])

    def _request_body(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
        } | self.sampling_overrides
        return {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": params.max_tokens,
            "seed": params.seed,
            "n": 1,
            "logprobs": 0,
            "stop_token_ids": sorted(self.stop_token_ids),
            "skip_special_tokens": False,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **sampling,
        }


def _completion(choice: Mapping[str, Any]) -> Completion:
    """A completions `choice` as a `Completion`: ids from `token_ids` or `token_id:N` tokens."""
    logprobs = choice.get("logprobs") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = [_token_id(token) for token in logprobs.get("tokens") or []]
    if not logprobs.get("token_logprobs") and token_ids:
        raise ServerRequestError(
            "the server returned no logprobs for the sampled tokens; agentgrpo needs a server "
            "that honours `logprobs` on /v1/completions (vLLM does)"
        )
    sampled = [float(lp) for lp in logprobs.get("token_logprobs") or []]
    return Completion(list(token_ids), sampled, stopped=choice.get("finish_reason") == "stop")


def _token_id(token: str) -> int:
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise ServerRequestError(
            f"the server returned the token {token!r} as text; agentgrpo needs token ids "
            "(vLLM's `return_token_ids` or `return_tokens_as_token_ids`)"
        )
    return int(token.removeprefix(_TOKEN_ID_PREFIX))
