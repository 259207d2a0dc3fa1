"""One agent episode's chat requests, recorded token-exactly as training rows.

An agent (a function that runs its own loop through an OpenAI client, `rollout.agents`) sends
the whole conversation with every request. `AgentSession.complete` finds the row the request
continues: a row whose conversation (its last request and the reply the model gave) is where the
request's messages start. The messages added since (tool results, a user turn) are appended to
that row as the chat template writes them (mask 0, `ChatRenderer.tool_turn`), then the model's
reply as sampled (mask 1), so the next turn is generated after the tokens the model sampled, as
in `rollout.episode`. A request that continues no row starts a new one from the template's
rendering of its messages (a fork): the agent rewrote, summarised or dropped messages, changed
its tools, or the row it continues is still generating (parallel sub-calls of one agent each
get their own row).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from rollout.backend import GenerationBackend
from rollout.episode import EpisodeConfig
from rollout.parsers import Parser
from rollout.template import ChatRenderer, ToolTurn
from rollout.text_encoding import valid_unicode
from rollout.tokens import TokenRow
from rollout.types import Compaction, EpisodeRow, Finish, ParsedTurn, ToolCallRecord

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(ValueError):
    """A chat request the endpoint cannot answer; `status` is the HTTP status to reply with.

    `finish` is set when the request was refused because the episode reached a limit
    (`Finish.LENGTH`, `Finish.MAX_TURNS`): the episode then ends that way, not as an error.
    """

    def __init__(self, message: str, status: int = 400, finish: Finish | None = None):
        super().__init__(message)
        self.status = status
        self.finish = finish


@dataclass(frozen=True)
class ChatRequest:
    """The parts of a `/v1/chat/completions` body the endpoint acts on.

    Attributes:
        messages: The conversation in the template's form (`template_messages`).
        tools: The tool schemas offered (`{"type": "function", "function": {...}}`).
        max_tokens: The request's own cap on the reply (None: the episode's budget decides).
        logprobs: Whether the reply carries each token's sampler logprob.
        token_ids: Whether the reply carries the prompt's and the completion's token ids.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    logprobs: bool = False
    token_ids: bool = False


@dataclass(frozen=True)
class ChatReply:
    """The model's answer to one request: the assistant message and how it was made.

    `message` is the assistant message in the template's form (tool-call arguments as dicts,
    each call with its `id`); `prompt_ids` is the context it was generated after.
    """

    message: dict[str, Any]
    finish_reason: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    tokens: list[str]


class SessionContext:
    """What every agent session of a run shares: the generator, the template and the parser.

    Args:
        backend: The generation backend.
        tokenizer: The policy's tokenizer.
        template: The chat template's jinja source.
        parser_for: Tool schemas to the parser that reads tool calls offered with them.
        config: The episode limits and sampling (`EpisodeConfig`).
        template_kwargs: Extra template variables.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        template: str,
        parser_for: Callable[[list[dict[str, Any]]], Parser],
        config: EpisodeConfig,
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.backend = backend
        self.tokenizer = tokenizer
        self.template = template
        self.config = config
        self.template_kwargs = template_kwargs
        self._parser_for = parser_for
        self._by_tools: dict[str, tuple[ChatRenderer, Parser]] = {}
        self._building = threading.Lock()  # sessions ask from worker threads

    def renderer_and_parser(self, tools: list[dict[str, Any]]) -> tuple[ChatRenderer, Parser]:
        """The renderer showing `tools` and the parser reading calls to them (built once).

        Once, even when sessions ask from several threads at a time: a row continues only
        under the very renderer it started with.
        """
        key = json.dumps(tools, sort_keys=True)
        with self._building:
            if key not in self._by_tools:
                renderer = ChatRenderer(self.tokenizer, self.template, tools, self.template_kwargs)
                if tools:
                    renderer.check_tool_support()
                self._by_tools[key] = (renderer, self._parser_for(tools))
            return self._by_tools[key]


@dataclass
class _Row:
    """One training row of a session and the conversation its tokens hold.

    `prompt_text` is the rendered text the last reply was generated after; `stop_text` the
    stop token it ended on (None when it was cut off, so the row cannot go on).
    """

    tokens: TokenRow
    messages: list[dict[str, Any]]
    prompt_text: str
    renderer: ChatRenderer
    stop_text: str | None = None
    busy: bool = False

    def __post_init__(self) -> None:
        self.prompt_length = len(self.tokens.prompt_ids)

    @property
    def spent(self) -> int:
        """Tokens of the row past its prompt: what `max_completion_length` bounds."""
        return len(self.tokens.context_ids) - self.prompt_length

    def continued_by(self, messages: Sequence[Mapping[str, Any]], renderer: ChatRenderer) -> bool:
        """Whether `messages` start with this row's conversation, under the same tools."""
        n = len(self.messages)
        return (
            not self.busy
            and self.stop_text is not None
            and renderer is self.renderer
            and len(messages) > n
            and list(messages[:n]) == self.messages
        )


class AgentSession:
    """The requests of one agent episode, and the training rows they make.

    Args:
        context: What the run's sessions share.
        sample_seed: The episode's seed; request k samples with a seed derived from it and k.
    """

    def __init__(self, context: SessionContext, sample_seed: int):
        self.context = context
        self.sample_seed = sample_seed
        self._rows: list[_Row] = []
        self.received = 0  # requests to the session's URL, answered or not
        self.refusals = 0  # requests answered with a 4xx (the endpoint counts them)
        self.last_refusal = ""  # why the latest refused request was refused
        self.requests = 0  # requests answered by the model
        self.failure: Exception | None = None  # the first error that was not the request's fault
        self.tool_calls = 0
        self.parse_errors = 0
        self.refused: Finish | None = None  # the limit a refused request hit
        self.cut_off = False  # a reply ran out of tokens
        self.messages: list[dict[str, Any]] = []  # the latest request's conversation and reply
        self.compactions: list[Compaction] = []  # rewrites that shortened the context
        self._placing = anyio.Lock()  # one request at a time finds (or starts) its row

    async def complete(self, request: ChatRequest) -> ChatReply:
        """Generate the model's reply to `request` and record it in the row it continues.

        Rendering and tokenizing run in a worker thread (one request of the session at a
        time), so a long conversation never holds up the event loop the other episodes share.

        Raises:
            RequestError: The episode has used all its turns, a reply was cut off at the token
                budget, the conversation leaves no token of the budget or the context, or the
                template cannot render it.
        """
        async with self._placing:
            row, parser, budget, seed = await anyio.to_thread.run_sync(self._prepare, request)
        prompt_ids = row.tokens.context_ids
        try:
            completion = await self.context.backend.generate(
                prompt_ids, self.context.config.sampling(budget, seed)
            )
            row.tokens.append_sampled(completion.token_ids, completion.logprobs)
            reply = self._reply(completion.token_ids, completion.stopped, parser)
            row.messages = [*request.messages, reply.message]
            row.stop_text = self._decode(completion.token_ids[-1:]) if completion.stopped else None
        finally:
            row.busy = False  # last: a request placed meanwhile (in a thread) sees the row whole
        self.messages = row.messages
        return ChatReply(
            reply.message,
            reply.finish_reason,
            prompt_ids,
            list(completion.token_ids),
            list(completion.logprobs),
            [self._decode([token]) for token in completion.token_ids],
        )

    def _prepare(self, request: ChatRequest) -> tuple[_Row, Parser | None, int, int]:
        """The busy row the reply goes on, the parser of its tool calls, its budget and seed."""
        config = self.context.config
        if self.requests >= config.max_turns:
            self._refuse(Finish.MAX_TURNS, f"the episode used all max_turns={config.max_turns}")
        if self.cut_off:
            self._refuse(Finish.LENGTH, "a reply used up the episode's token budget")
        renderer, parser = self.context.renderer_and_parser(request.tools)
        self._check_text(request.messages, renderer)
        row = self._place(request.messages, renderer)
        budget = self._budget(row, request.max_tokens)
        self.requests += 1
        row.busy = True
        seed = hash((self.sample_seed, self.requests)) % 2**62
        return row, parser if request.tools else None, budget, seed

    def _check_text(self, messages: list[dict[str, Any]], renderer: ChatRenderer) -> None:
        """Refuse, before tokenizing it, a conversation surely too long for any row.

        A row holds at most its prompt (`max_prompt_length`, else the context) and the
        completion budget; the text of the user, system and tool messages all lands in it
        (templates may drop earlier reasoning of assistant turns, never these).
        """
        config = self.context.config
        limits = [self.context.backend.context_limit]
        if config.max_prompt_length:
            limits.append(config.max_prompt_length + config.max_completion_length)
        tokens = min((limit for limit in limits if limit), default=None)
        text = [m["content"] for m in messages if m["role"] != "assistant"]
        if tokens is not None and renderer.surely_longer_than(text, tokens):
            self._refuse(
                Finish.LENGTH,
                f"the conversation's text is surely over {tokens} tokens, more than a row "
                f"holds (max_prompt_length={config.max_prompt_length}, max_completion_length="
                f"{config.max_completion_length}, model context="
                f"{self.context.backend.context_limit})",
            )

    def _refuse(self, finish: Finish, why: str) -> None:
        self.refused = finish
        raise RequestError(f"{why}; the episode ends here ({finish.value})", finish=finish)

    def _place(self, messages: list[dict[str, Any]], renderer: ChatRenderer) -> _Row:
        """The row this request goes on, its new messages appended (mask 0); forks as needed."""
        row = next((r for r in reversed(self._rows) if r.continued_by(messages, renderer)), None)
        if row is not None:
            turn = self._turn(row, messages, renderer)
            if not turn.fork:
                self._check_room(row, len(turn.ids))
                row.tokens.append_context(turn.ids)
                row.prompt_text = turn.prompt_text
                row.stop_text = None
                return row
            prompt_text, ids = turn.prompt_text, turn.ids
        else:
            prompt_text = self._render(renderer, messages)
            ids = renderer.encode(prompt_text)
            self._note_compaction(len(ids))
        self._check_prompt(len(ids))
        row = _Row(TokenRow(ids), list(messages), prompt_text, renderer)
        self._rows.append(row)
        return row

    def _note_compaction(self, after: int) -> None:
        """Record a history the agent rewrote shorter than its last row's context (`"agent"`)."""
        before = len(self._rows[-1].tokens.context_ids) if self._rows else 0
        if after < before:
            compaction = Compaction(self.requests, before, after, "agent", row=len(self._rows))
            self.compactions.append(compaction)

    def _turn(self, row: _Row, messages: list[dict[str, Any]], renderer: ChatRenderer) -> ToolTurn:
        n = len(row.messages)
        assert row.stop_text is not None  # `continued_by` checked it
        try:
            return renderer.tool_turn(row.prompt_text, messages[:n], messages[n:], row.stop_text)
        except Exception as error:
            raise RequestError(f"the chat template cannot render these messages: {error}") from None

    @staticmethod
    def _render(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> str:
        try:
            return renderer.render(messages, generation_prompt=True)
        except Exception as error:
            raise RequestError(f"the chat template cannot render these messages: {error}") from None

    def _check_room(self, row: _Row, adding: int) -> None:
        limit = self.context.config.max_completion_length
        if row.spent + adding >= limit:
            self._refuse(Finish.LENGTH, f"the conversation is past max_completion_length={limit}")

    def _check_prompt(self, length: int) -> None:
        limit = self.context.config.max_prompt_length
        context = self.context.backend.context_limit
        if (limit and length > limit) or (context and length >= context):
            self._refuse(
                Finish.LENGTH,
                f"the prompt is {length} tokens, over the limit (max_prompt_length={limit}, "
                f"model context={context})",
            )

    def _budget(self, row: _Row, max_tokens: int | None) -> int:
        """Tokens the reply may take: the row's budget, the context left and the request's cap."""
        budget = self.context.config.max_completion_length - row.spent
        context = self.context.backend.context_limit
        if context:
            budget = min(budget, context - len(row.tokens.context_ids))
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        if budget < 1:
            self._refuse(Finish.LENGTH, "no tokens are left for a reply")
        return budget

    def _decode(self, ids: list[int]) -> str:
        return self.context.tokenizer.decode(ids)

    def _reply(self, ids: list[int], stopped: bool, parser: Parser | None) -> _Reply:
        """The assistant message for sampled `ids`, with its tool calls parsed."""
        if not stopped:
            self.cut_off = True
            return _Reply({"role": "assistant", "content": self._decode(ids)}, "length")
        text = self._decode(ids[:-1])
        parsed = parser(text) if parser is not None else ParsedTurn(text)
        self.tool_calls += len(parsed.tool_calls) + len(parsed.errors)
        self.parse_errors += len(parsed.errors)
        # A call that could not be read stays in the text, so the agent sees what was written.
        content = text if parsed.errors else parsed.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not parsed.tool_calls:
            return _Reply(message, "stop")
        message["tool_calls"] = [
            {
                "id": f"call_{self.requests}_{k}",
                "type": "function",
                "function": {"name": call.name, "arguments": dict(call.arguments)},
            }
            for k, call in enumerate(parsed.tool_calls)
        ]
        return _Reply(message, "tool_calls")

    def rows(self) -> tuple[EpisodeRow, ...]:
        """The session's training rows, in the order they started."""
        return tuple(
            EpisodeRow(
                r.tokens.prompt_ids, r.tokens.completion_ids, r.tokens.loss_mask, r.tokens.logprobs
            )
            for r in self._rows
        )

    def tool_call_records(self) -> tuple[ToolCallRecord, ...]:
        """The tool calls of the latest conversation, each with the result the agent sent back."""
        results = {
            m.get("tool_call_id"): m["content"] for m in self.messages if m["role"] == "tool"
        }
        return tuple(
            ToolCallRecord(
                call["function"]["name"],
                call["function"]["arguments"]
                if isinstance(call["function"]["arguments"], dict)
                else {},
                results.get(call.get("id"), ""),
            )
            for m in self.messages
            if m["role"] == "assistant"
            for call in m.get("tool_calls") or []
        )


@dataclass(frozen=True)
class _Reply:
    message: dict[str, Any]
    finish_reason: str


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages in the form chat templates read, checked.

    Text content parts are joined; a null content is ""; tool-call arguments given as a JSON
    string (OpenAI's form) become the object they hold; a tool message gets the `name` of the
    call it answers (templates that name results read it).

    Raises:
        RequestError: Not a list of messages, an unknown role, content that is not text, or a
            field of the wrong type (the message names it).
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of chat messages")
    names: dict[str | None, str] = {}
    converted = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{index}] is a {type(message).__name__}, not an object")
        role = _string(message, "role", f"messages[{index}]", required=True)
        if role == "tool":
            call_id = _string(message, "tool_call_id", f"messages[{index}]")
            name = _string(message, "name", f"messages[{index}]") or names.get(call_id, "")
            converted.append(
                {
                    "role": "tool",
                    "content": _text(message, index),
                    "name": name,
                    "tool_call_id": call_id,
                }
            )
            continue
        if role not in _ROLES:
            raise RequestError(
                f"messages[{index}] has role {role!r}; expected one of {[*_ROLES, 'tool']}"
            )
        entry: dict[str, Any] = {"role": _ROLES[role], "content": _text(message, index)}
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise RequestError(f"messages[{index}].tool_calls must be a list of tool calls")
            entry["tool_calls"] = [_call(call, index) for call in calls]
            names.update((c["id"], c["function"]["name"]) for c in entry["tool_calls"])
        converted.append(entry)
    return converted


def _text(message: Mapping[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return valid_unicode(content)
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return valid_unicode("".join(str(p.get("text", "")) for p in content))
    raise RequestError(f"messages[{index}].content must be text (a string or text parts)")


def _string(mapping: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    """`mapping[key]` when it is a string, None when absent (or null) and not `required`.

    Raises:
        RequestError: The field holds something else, or is missing though `required`.
    """
    value = mapping.get(key)
    if isinstance(value, str) or (value is None and not required):
        return value
    got = "nothing" if value is None else type(value).__name__
    raise RequestError(f"{where}.{key} must be a string, not {got}")


def _call(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls holds a call without a function name")
    where = f"messages[{index}].tool_calls[].function"
    call_id = _string(call, "id", f"messages[{index}].tool_calls[]")
    arguments = function.get("arguments")
    if not isinstance(arguments, str | dict | None):
        raise RequestError(f"{where}.arguments must be a JSON string or an object")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = arguments
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
