"""Generation through an OpenAI-compatible server ("server" mode): ids in, ids and logprobs out.

Each request is one `POST /v1/completions` with the prompt as token ids, asking for the sampled
tokens back as ids (`return_token_ids`, vLLM's extension) with their logprobs, so nothing is ever
decoded and re-encoded. Requests run in worker threads (standard-library HTTP), as many at once
as episodes ask for, and the server batches them continuously. Any OpenAI-compatible server that
returns token ids works for generation; pushing weights needs `agentgrpo vllm-serve`.

`/v1/completions` takes no pictures, so a request with pictures goes to vLLM's token-in,
token-out endpoint instead (`POST /inference/v1/generate`, which `agentgrpo vllm-serve` enables
with `--enable-scale-out`): the prompt ids with each picture's tokens put back to its
placeholder, the pictures as PNG data URLs, and vLLM's sampling parameters. vLLM expands the
placeholders itself and returns the ids it read, which must be the row's exactly, as in
colocate mode.

An asynchronous run pushes new weights while episodes play. `between_steps` holds new requests
back, pauses the server (`agentgrpo vllm-serve`'s `/pause?mode=abort`), which cuts the requests
in flight short and returns what each had sampled, runs the push, and resumes. Each cut request
is then continued, from its prompt and what it had sampled, with the new weights: a completion
can hold tokens of two versions, and its `Completion.versions` says which (`request_gate`).

Every failure to reach the server is a `ServerUnavailableError` that names the server and what
to do, raised after at most the configured timeout: never a hang. Every request carries the key
in `AGENTGRPO_VLLM_KEY`, when it is set, which `agentgrpo vllm-serve` then requires
(`server_guard`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import http.client
import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import anyio

from rollout.backends.lora_versions import Adapter, AdapterVersions
from rollout.backends.request_gate import RequestGate
from rollout.backends.server_guard import KEY_VARIABLE, server_key
from rollout.images import unexpanded_ids
from rollout.types import Completion, Pictures, SamplingParams, check_sampling_overrides

_TOKEN_ID_PREFIX = "token_id:"
_REFUSALS = {  # what to do about `server_guard`'s answers
    401: f". Set {KEY_VARIABLE} here to the key the server was started with",
    403: ". Reach it as http://127.0.0.1:PORT from its own machine, or start it with a key",
}


class ServerUnavailableError(ConnectionError):
    """The generation server did not answer: not started, unreachable, or gone mid-run."""


class ServerRequestError(RuntimeError):
    """The server answered a request with an error status; the message holds its reply.

    `status`: the HTTP status (None where the reply itself was wrong).
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


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
        key: Sent as `Authorization: Bearer <key>` with every request; by default the
            `AGENTGRPO_VLLM_KEY` of this process's environment (none when unset).

    """

    def __init__(self, base_url: str, timeout_s: float, key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        key = key or server_key()
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}

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
        request = urllib.request.Request(self.base_url + path, headers=self._headers)
        return self._call(request, timeout_s)

    def post(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        text: bool = False,
    ) -> Any:
        """`POST path` with a JSON body and its JSON reply (None for an empty reply).

        `text`: the reply is plain text (vLLM's LoRA endpoints answer so); return it as is.
        """
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json", **self._headers},
        )
        return self._call(request, timeout_s, text)

    def _call(
        self, request: urllib.request.Request, timeout_s: float | None, text: bool = False
    ) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as reply:
                payload = reply.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            raise ServerRequestError(
                f"{request.get_method()} {request.full_url} failed with {error.code}: {detail}"
                + _REFUSALS.get(error.code, ""),
                error.code,
            ) from None
        except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out
            raise ServerUnavailableError(
                f"the server at {self.base_url} did not answer {request.get_method()} "
                f"{request.full_url} ({error!r}); if it stopped, restart it (`agentgrpo "
                "vllm-serve`) and resume the run from its last checkpoint"
            ) from None
        if text:
            return payload.decode(errors="replace")
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
        processor: A vision-language model's processor, the one the server's model folder
            holds: requests may then hold images (see `generate`). None: text only.

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
        processor: Any = None,
    ):
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation would never end a turn")
        check_sampling_overrides(sampling_overrides or {})
        self.connection = connection
        self.model = model
        self.processor = processor
        self.stop_token_ids = frozenset(stop_token_ids)
        self.context_limit = context_limit
        self.sampling_overrides = dict(sampling_overrides or {})
        if regex is not None:
            self.sampling_overrides["structured_outputs"] = {"regex": regex}
        self._threads = anyio.CapacityLimiter(max_concurrent_requests)
        self._gate = RequestGate()
        # Adapter-only pushes (`load_adapter`); None: requests use the served weights.
        self.adapters: AdapterVersions | None = None

    @classmethod
    def connect(cls, connection: ServerConnection, **kwargs: Any) -> VLLMServerBackend:
        """Wait for the server, then serve its first model (its name and context length).

        A server that a killed run left paused mid-push (`between_steps`) is resumed first,
        so that requests do not wait for it until they time out.
        """
        connection.wait_until_up()
        with contextlib.suppress(ServerRequestError):  # not `agentgrpo vllm-serve`: no pauses
            connection.post("/resume")
        [card, *_] = connection.get("/v1/models")["data"]
        return cls(connection, card["id"], context_limit=card.get("max_model_len"), **kwargs)

    @property
    def reads_images(self) -> bool:
        """Whether requests may hold images: the backend was given a processor."""
        return self.processor is not None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
        """Send one request and return its sampled ids and logprobs.

        `pictures.images` (PIL) are those whose expanded tokens `prompt_ids` hold, in order; the
        request then goes to `/inference/v1/generate` and fails if the ids vLLM expanded are not
        `prompt_ids`. `pictures.vision` is not read: vLLM makes its own tensors.
        """
        images = pictures.images if pictures else ()
        if self.context_limit and len(prompt_ids) + params.max_tokens > self.context_limit:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                f"server's context of {self.context_limit} tokens (--max-model-len)"
            )
        if images and self.processor is None:
            raise ValueError(
                "this request holds images but the vLLM server backend was built without a "
                "processor; give it the model's processor (`rollout.images.load_processor`)"
            )
        adapter = self.adapters.for_request() if self.adapters is not None else None
        parts: list[Completion] = []
        while True:  # a part cut short by a weight push is continued after it
            drawn = [token for part in parts for token in part.token_ids]
            rest = dataclasses.replace(
                params,
                max_tokens=params.max_tokens - len(drawn),
                seed=None if params.seed is None else params.seed + len(drawn),
            )
            part, cut = await self._request(prompt_ids + drawn, rest, images, adapter)
            parts.append(part)
            if not cut or len(drawn) + len(part.token_ids) >= params.max_tokens:
                return _joined(parts)

    async def _request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        images: Sequence[Any],
        adapter: Adapter | None,
    ) -> tuple[Completion, bool]:
        """One request; its completion, and whether a weight push cut it short.

        With `adapter` it generates with that LoRA and its tokens carry the adapter's version;
        without, with the served weights.
        """
        model = adapter.name if adapter is not None else self.model
        if images:
            reply, version = await anyio.to_thread.run_sync(
                self._post_with_images, prompt_ids, params, images, model, limiter=self._threads
            )
            completion, choice = _generated(reply, prompt_ids), reply["choices"][0]
        else:
            body = self._request_body(prompt_ids, params) | {"model": model}
            reply, version = await anyio.to_thread.run_sync(
                self._post, "/v1/completions", body, limiter=self._threads
            )
            choice = reply["choices"][0]
            completion = _completion(choice)
        if adapter is not None:
            version = adapter.version
        return _tagged(completion, version), choice.get("finish_reason") == "abort"

    @property
    def weights_version(self) -> int | None:
        """The version tagging the tokens of requests sent now (None: no tags)."""
        return self._gate.version

    def set_weights_version(self, version: int) -> None:
        """Tag the tokens of requests sent from now on with `version`."""
        self._gate.version = version

    def load_adapter(self, adapter: Adapter, frozen: bool = False) -> list[Adapter]:
        """Load a LoRA adapter version on the server; unload (and return) the oldest.

        `adapters` (set it first) says how many versions stay loaded; `frozen`: as for
        `VLLMColocateBackend.load_adapter` (a snapshot's: the caller unloads it). Nothing
        pauses: requests in flight go on with their own versions. The server must run with
        `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (`agentgrpo vllm-serve`
        sets it) and read `adapter.path` (the trainer's file system).
        """
        if self.adapters is None:
            raise RuntimeError("set `adapters` (the versions to keep) before loading adapters")
        body = {"lora_name": adapter.name, "lora_path": adapter.path, "load_inplace": False}
        try:
            self.connection.post("/v1/load_lora_adapter", body, text=True)
        except ServerRequestError as error:
            raise ServerRequestError(
                f"the server at {self.connection.base_url} did not load the LoRA adapter in "
                f"{adapter.path}: start it with `agentgrpo vllm-serve --enable-lora "
                "--max-lora-rank R` on a machine that reads the trainer's files, or set "
                f"vllm_lora_push='merged'. The server said: {error}",
                error.status,
            ) from None
        evicted = [] if frozen else self.adapters.add(adapter)
        for old in evicted:
            self.unload_adapter(old)
        return evicted

    def unload_adapter(self, adapter: Adapter) -> None:
        """Unload `adapter` from the server (no request may still use it)."""
        self.connection.post("/v1/unload_lora_adapter", {"lora_name": adapter.name}, text=True)

    async def between_steps(self, update: Callable[[], None], version: int | None = None) -> None:
        """Run `update` (a weight push) while no request is in flight, then go on.

        New requests wait from now until `update` has run; the server is paused, which cuts
        the ones in flight short (`generate` continues them afterwards), and resumed at the
        end, whether `update` succeeded or not. With `version`, the tokens drawn afterwards
        carry it (`Completion.versions`). Two calls at once run one after the other.

        Raises:
            ServerRequestError: The server cannot pause (start it with `agentgrpo vllm-serve`).
        """
        await anyio.to_thread.run_sync(self._alone, update, version)

    def _alone(self, update: Callable[[], None], version: int | None) -> None:
        with self._gate.holding():
            self._call_for_push("/pause?mode=abort")
            try:
                abort = functools.partial(self._call_for_push, "/abort_requests")
                self._gate.wait_until_idle(abort, self.connection.timeout_s)
                update()
                if version is not None:
                    self._gate.version = version
            finally:
                self._call_for_push("/resume")

    def _call_for_push(self, path: str) -> None:
        try:
            self.connection.post(path)
        except ServerRequestError as error:
            raise ServerRequestError(
                f"the server at {self.connection.base_url} cannot pause for a weight push "
                f"({path}): start it with `agentgrpo vllm-serve` (it enables vLLM's "
                f"VLLM_SERVER_DEV_MODE endpoints). The server said: {error}",
                error.status,
            ) from None

    def _post(self, path: str, body: Mapping[str, Any]) -> tuple[Any, int | None]:
        """`connection.post` once no push holds requests back; its reply and weights version."""
        with self._gate.request() as version:
            return self.connection.post(path, body), version

    def _post_with_images(
        self, prompt_ids: list[int], params: SamplingParams, images: Sequence[Any], model: str
    ) -> tuple[Any, int | None]:
        body = {
            "model": model,
            "token_ids": unexpanded_ids(self.processor, prompt_ids, images),
            "content_parts": [{"type": "image_url", "url": png_data_url(i)} for i in images],
            "sampling_params": self._sampling_params(params),
            "return_token_ids": True,
        }
        try:
            return self._post("/inference/v1/generate", body)
        except ServerRequestError as error:
            if error.status not in (403, 404):  # 403: no --enable-scale-out; 404: not vLLM
                raise
            raise ServerRequestError(
                f"the server at {self.connection.base_url} takes no pictures: start it with "
                "`agentgrpo vllm-serve` (it passes vLLM --enable-scale-out, which serves "
                f"/inference/v1/generate). The server said: {error}"
            ) from None

    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        """The vLLM `SamplingParams` fields of a request with images (as `_request_body`'s)."""
        return {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_tokens": params.max_tokens,
            "seed": params.seed,
            "n": 1,
            "logprobs": 0,
            "stop_token_ids": sorted(self.stop_token_ids),
            "detokenize": False,
        } | self.sampling_overrides

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


def _joined(parts: Sequence[Completion]) -> Completion:
    """The parts of one completion (cut by weight pushes) as one; it stopped if its last did."""
    if len(parts) == 1:
        return parts[0]
    tagged = [part.versions for part in parts if part.versions is not None]
    return Completion(
        [token for part in parts for token in part.token_ids],
        [logprob for part in parts for logprob in part.logprobs],
        stopped=parts[-1].stopped,
        versions=[v for tags in tagged for v in tags] if len(tagged) == len(parts) else None,
    )


def _tagged(completion: Completion, version: int | None) -> Completion:
    """`completion` with every token tagged `version` (unchanged when None)."""
    if version is None:
        return completion
    return dataclasses.replace(completion, versions=[version] * len(completion.token_ids))


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


def _generated(reply: Mapping[str, Any], prompt_ids: list[int]) -> Completion:
    """An `/inference/v1/generate` reply as a `Completion`, if vLLM read `prompt_ids` exactly."""
    read = reply.get("prompt_token_ids")
    if read != prompt_ids:
        raise ValueError(
            "vLLM expanded this prompt's images into other tokens than the processor did "
            f"({len(read or [])} ids, not {len(prompt_ids)}): its logprobs would not be the "
            "policy's. Check that the served model folder's processor settings are those of "
            "the processor given to agentgrpo, or generate with transformers"
        )
    [choice] = reply["choices"]
    steps = (choice.get("logprobs") or {}).get("content") or []
    token_ids = list(choice.get("token_ids") or [])
    if [step["token_id"] for step in steps] != token_ids:
        raise ServerRequestError("the server returned no logprob for some sampled tokens")
    logprobs = [float(step["logprob"]) for step in steps]
    return Completion(token_ids, logprobs, stopped=choice.get("finish_reason") == "stop")


def png_data_url(image: Any) -> str:
    """A PIL image as a `data:image/png;base64,...` URL (lossless: vLLM reads the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _token_id(token: str) -> int:
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise ServerRequestError(
            f"the server returned the token {token!r} as text; agentgrpo needs token ids "
            "(vLLM's `return_token_ids` or `return_tokens_as_token_ids`)"
        )
    return int(token.removeprefix(_TOKEN_ID_PREFIX))
