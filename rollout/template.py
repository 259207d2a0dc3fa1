"""Rendering conversations to token ids through a chat template, without ever re-encoding.

The prompt of an episode is rendered and encoded once. After that, tokens are only appended: the
model's turn as sampled, then each tool turn as the *difference* the template makes when the tool
messages are added. `ChatRenderer.tool_turn` computes that difference when the template really
extends the conversation (rendering a longer conversation starts with the text of the shorter
one). A template that rewrites earlier turns (Qwen3 re-renders past reasoning) makes the episode
*fork* instead: the next turn is generated after the template's fresh rendering of the whole
conversation, which starts a new training row (the loss trains only on tokens sampled in the
row's own context, never on re-encoded ones).
`ChatRenderer.tool_turn_ids` is the strict form: it raises `TemplateDriftError` where forking
would be needed.

Tool results are untrusted text: `rollout.text_encoding` makes them encodable, and
`ChatRenderer.fit_tool_messages` cuts them where they could not fit the token budget anyway, so a
megabyte result is never tokenized only to be thrown away.

Templates come from `rollout.template_source` (`load_template`) and render in a sandbox: a
template is code from a model folder or a user, so every compile and render is bounded in time,
output and the size of what it builds (`rollout.template_sandbox`): past a bound it stops with
`TemplateRenderError`, naming the template (`describe_template`), the bound and the line.

Pictures are part of rendering: the template writes one placeholder per image part
(`image_placeholder`), and a vision-language model's processor expands each into the image's
tokens as the text is encoded (`encode_with_images`), so the expansion is part of the ids the
model sees (prompt and tool-turn tokens, mask 0). `rollout.images` loads processors and batches
the pixel tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rollout.template_sandbox import RenderLimits, bounded, render_bounded
from rollout.template_source import (
    PROBE_MESSAGES,
    PROBE_TOOL,
    check_probe,
    compile_template,
    describe_template,
)
from rollout.text_encoding import EncodeCache, max_token_chars
from tools import picture_problem
from tools.call import PICTURES_ARE_PIL

if TYPE_CHECKING:
    import torch


class TemplateDriftError(RuntimeError):
    """The chat template re-renders earlier turns differently once a turn is added.

    Episodes and warm-start demonstrations fork instead of raising it
    (`ChatRenderer.tool_turn`, `rollout.demonstrations`); it is raised where a single token row
    is required (`ChatRenderer.tool_turn_ids`), and for a demonstration whose assistant turn
    cannot be told apart from the template's text around it.
    """


@dataclass(frozen=True)
class ToolTurn:
    """What follows a model's turn once tool results are added to the conversation.

    Attributes:
        ids: With `fork` False, the ids to append to the current row after the sampled stop
            token (template glue, the tool results, the next assistant header). With `fork`
            True, the prompt ids of a new row: the fresh rendering of the whole conversation.
        prompt_text: The rendered text the next model turn is generated after.
        fork: Whether the template rewrote the conversation, so the episode continues on a new
            row.
        images: The images whose tokens `ids` hold (a vision-language model's: the tool
            results' images, or with `fork` every image of the conversation), in order.
        vision: The processor's tensors of `images` (empty without images).
    """

    ids: list[int]
    prompt_text: str
    fork: bool
    images: tuple[Any, ...] = ()
    vision: Mapping[str, Any] = field(default_factory=dict)


class ChatRenderer:
    """Renders messages through one chat template and turns text into token ids.

    Args:
        tokenizer: A transformers tokenizer (used to encode rendered text, and for its special
            tokens, which templates may reference as `bos_token`, `eos_token`, ...).
        template: jinja source, as returned by `load_template`.
        tools: Tool schemas (`{"type": "function", "function": {...}}`) shown to the model.
        template_kwargs: Extra variables for the template (e.g. `{"enable_thinking": False}`).
        encode_cache_size: Bound on the encode cache, in characters plus token ids.
        processor: A vision-language model's processor (`rollout.images.load_processor`), or
            None. With one, messages may hold image parts: the template gets the processor's
            `image_placeholder`, and `encode_messages` expands it into image
            tokens.
        limits: The bounds on each render (`RenderLimits`; its defaults when None).

    Raises:
        TemplateRenderError: Compiling the template went past a bound (so does `render`).
        jinja2.TemplateSyntaxError: The template is not valid jinja.

    """

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        tools: Sequence[Mapping[str, Any]] = (),
        template_kwargs: Mapping[str, Any] | None = None,
        encode_cache_size: int = 1 << 21,
        processor: Any = None,
        limits: RenderLimits | None = None,
    ):
        self.tokenizer = tokenizer
        self.template = template
        self.limits = limits or RenderLimits()
        self.source = describe_template(template, processor, tokenizer)
        self.tools = [dict(t) for t in tools]
        self.template_kwargs = dict(template_kwargs or {})
        self.processor = processor
        if processor is not None:
            self.template_kwargs.setdefault("image_placeholder", image_placeholder(processor))
        with bounded(self.limits, self.source):
            self._compiled = compile_template(template)
        # Group members render the same prompt and tool turns often repeat: encode each text once.
        self._encoded = EncodeCache(self._encode_uncached, encode_cache_size)
        self._special = {
            k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)
        }

    def render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        """The template's text for `messages`, ending with the assistant header if asked.

        Raises:
            TemplateRenderError: The render went past a bound of `limits`.
            jinja2.TemplateError: The template failed (`raise_exception`, an undefined name).

        """
        variables = dict(  # a template kwarg named like a variable is a TypeError, as in render()
            messages=messages,
            tools=self.tools or None,
            add_generation_prompt=generation_prompt,
            **self._special,
            **self.template_kwargs,
        )
        return render_bounded(self._compiled, variables, self.limits, self.source)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; the template, not the tokenizer, adds special tokens."""
        return list(self._encoded(text))

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    @cached_property
    def _max_token_chars(self) -> int | None:
        """`max_token_chars` of the tokenizer, read from its vocabulary when first needed."""
        return max_token_chars(self.tokenizer)

    def surely_longer_than(self, texts: Sequence[str], tokens: int) -> bool:
        """Whether `texts`, however the template wraps them, are more than `tokens` tokens.

        Counts characters only (see `fit_tool_messages`), so a request too long to take can be
        refused without tokenizing it; always False when the tokenizer has no such bound.
        """
        if self._max_token_chars is None:
            return False
        return sum(map(len, texts)) > tokens * self._max_token_chars

    def fit_tool_messages(
        self, messages: Sequence[Mapping[str, Any]], budget_tokens: int
    ) -> list[dict[str, Any]]:
        """Tool messages with each `content` cut where it could not fit `budget_tokens` anyway.

        No token covers more than `max_token_chars(tokenizer)` characters of text, so a content
        of `budget_tokens` times that many characters is at least `budget_tokens` tokens however
        the template wraps it. Cutting it there decides nothing differently: the tool turn would
        not fit in full, and does not fit cut. It only spares tokenizing what is thrown away.
        Contents that might fit are returned whole; so is everything when the tokenizer has no
        such bound (`max_token_chars` is None).

        Args:
            messages: Tool messages (`{"role": "tool", "content": str, ...}`).
            budget_tokens: The tokens left for the tool turn and what follows it.

        Returns:
            Copies of the messages, with `content` cut to at most the bound.

        """
        if self._max_token_chars is None:
            return [dict(m) for m in messages]
        limit = max(budget_tokens, 0) * self._max_token_chars
        return [{**m, "content": _cut_text(m["content"], limit)} for m in messages]

    def tool_turn(
        self,
        prompt_text: str,
        messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        stop_text: str,
    ) -> ToolTurn:
        """The tokens that follow the model's turn when `new_messages` are added, or a fork.

        Arguments as for `tool_turn_ids`. Where that would raise `TemplateDriftError` (the
        template renders earlier turns differently once turns are added, or does not end
        assistant turns with `stop_text`), the result is a fork: the ids of the template's
        rendering of the whole conversation with the generation prompt, to start a new row.

        Raises:
            jinja2.TemplateError: The template cannot render the conversation.

        """
        try:
            text, after = self._tool_turn_text(prompt_text, messages, new_messages, stop_text)
        except TemplateDriftError:
            return self.fresh([*messages, *new_messages])
        ids, vision, images = encode_messages(self.processor, text, new_messages, self.encode)
        return ToolTurn(ids, after, fork=False, images=tuple(images), vision=vision)

    def fitted_tool_turn(
        self,
        prompt_text: str,
        messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        stop_text: str,
        budget: tuple[int, int],
    ) -> tuple[list[dict[str, Any]], ToolTurn]:
        """`tool_turn` with `new_messages` cut to the budget (`fit_tool_messages`) first.

        `budget` is the tokens left in the current row and the episode's whole budget. A fork
        can drop history (past reasoning), leaving more room than the current row has, so a
        turn that forks with a cut message is redone with messages cut only at the whole
        budget. Returns the messages as the turn shows them, and the turn.
        """
        for limit in budget:
            fitted = self.fit_tool_messages(new_messages, limit)
            turn = self.tool_turn(prompt_text, messages, fitted, stop_text)
            if not turn.fork or fitted == list(new_messages):
                break
        return fitted, turn

    def fresh(self, messages: Sequence[Mapping[str, Any]]) -> ToolTurn:
        """The template's whole rendering of `messages` and the generation prompt: a new row.

        The result is a fork (`ToolTurn.fork`): its ids are the prompt of a new row, holding
        every image of `messages`.

        Raises:
            TemplateRenderError, jinja2.TemplateError: As `render`.
            ValueError: There are images but no processor, or the text holds a different
                number of placeholders (`encode_messages`).

        """
        text = self.render(messages, generation_prompt=True)
        ids, vision, images = encode_messages(self.processor, text, messages, self.encode)
        return ToolTurn(ids, text, fork=True, images=tuple(images), vision=vision)

    def tool_turn_ids(
        self,
        prompt_text: str,
        messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        stop_text: str,
    ) -> tuple[list[int], str]:
        """Token ids that follow the model's turn when `new_messages` (tool results) are added.

        Args:
            prompt_text: The rendered text the model's last turn was generated after (what
                `render(messages[:-1], generation_prompt=True)` returns).
            messages: The conversation so far, ending with the model's turn.
            new_messages: The messages to add (tool results).
            stop_text: The text of the stop token the model's turn ended on.

        Returns:
            The ids to append after the sampled stop token (everything the template writes from
            there up to and including the next assistant header; when the template writes the
            stop token as the opening of the tool turn instead of closing the assistant's, what
            follows it), and the new prompt text.

        Raises:
            TemplateDriftError: the template renders earlier turns differently once turns are
                added, or does not end assistant turns with `stop_text`.

        """
        text, after = self._tool_turn_text(prompt_text, messages, new_messages, stop_text)
        return self.encode(text), after

    def _tool_turn_text(
        self,
        prompt_text: str,
        messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        stop_text: str,
    ) -> tuple[str, str]:
        """`tool_turn_ids`' text to encode (not its ids), and the new prompt text."""
        before = self.render(messages, generation_prompt=False)
        after = self.render([*messages, *new_messages], generation_prompt=True)
        self._check_extends(prompt_text, before, "the model's turn")
        self._check_extends(before, after, "the tool results")
        assistant_text = before[len(prompt_text) :]
        added = after[len(before) :]
        end = assistant_text.rfind(stop_text)
        if end < 0 and added.startswith(stop_text):
            # The template writes the stop token as the next message's opening (GLM-4 opens tool
            # results with <|observation|>, the token its model stops on): the model wrote it.
            return added[len(stop_text) :], after
        if end < 0:
            raise TemplateDriftError(
                f"The chat template does not end assistant turns with {stop_text!r}, the token "
                f"the model stopped on, so the tokens after it cannot be known. Use a template "
                f"whose assistant turns end with the model's end-of-turn token."
            )
        glue = assistant_text[end + len(stop_text) :]
        return glue + added, after

    @staticmethod
    def _check_extends(shorter: str, longer: str, what: str) -> None:
        if longer.startswith(shorter):
            return
        at = next((i for i, (a, b) in enumerate(zip(shorter, longer, strict=False)) if a != b), 0)
        raise TemplateDriftError(
            f"Adding {what} changed how the chat template renders the earlier conversation "
            f"(first difference at character {at}: {shorter[at : at + 40]!r} became "
            f"{longer[at : at + 40]!r}). Training on it would use tokens the model never saw. "
            f"Use a template that renders past turns the same way whatever follows them."
        )

    def check_tool_support(self) -> None:
        """Raise `ToolTemplateError` unless the template shows tools, tool calls and results.

        Renders `rollout.template_source`'s probe conversation, with its made-up tool beside
        this renderer's tools (`check_probe`).
        """
        probe = ChatRenderer(
            self.tokenizer,
            self.template,
            [*self.tools, PROBE_TOOL],
            self.template_kwargs,
            limits=self.limits,
        )
        check_probe(lambda: probe.render(PROBE_MESSAGES, generation_prompt=True))


def _cut_text(content: Any, limit: int) -> Any:
    """`content` with its text (each text part's) cut to at most `limit` characters."""
    if isinstance(content, str):
        return content[:limit]
    return [
        {**part, "text": part["text"][:limit]} if part.get("type") == "text" else part
        for part in content_parts(content)
    ]


# What a processor returns besides the pixel tensors; the rest is the model's vision input.
_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}


def image_placeholder(processor: Any) -> str:
    """The text a chat template writes for one image, which `processor` expands into its tokens.

    Qwen2-VL's family wraps its image token in vision start and end tokens; Gemma3's
    processor expands its begin-of-image token; the others expand their image token.
    """
    tokenizer = processor.tokenizer
    start = getattr(tokenizer, "vision_start_token", None) or _token(tokenizer, "<|vision_start|>")
    end = getattr(tokenizer, "vision_end_token", None) or _token(tokenizer, "<|vision_end|>")
    if start and end:
        return f"{start}{processor.image_token}{end}"
    boi = getattr(processor, "boi_token", None)
    return boi or processor.image_token


def _token(tokenizer: Any, token: str) -> str | None:
    """`token` when the tokenizer has it as one id, else None."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return token if len(ids) == 1 and ids[0] != tokenizer.unk_token_id else None


def encode_with_images(
    processor: Any, text: str, images: Sequence[Any]
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of rendered `text`, each image placeholder expanded, and the images' tensors.

    Args:
        processor: A VLM processor (`load_processor`).
        text: Rendered template text holding one `image_placeholder` per image, in order.
        images: The images (PIL), one per placeholder.

    Returns:
        The ids (the template, not the tokenizer, adds special tokens) and the vision inputs
        the model's forward takes with them (empty when there are no images).

    Raises:
        ValueError: The text holds a different number of placeholders than there are images.
    """
    placeholder = image_placeholder(processor)
    if text.count(placeholder) != len(images):
        raise ValueError(
            f"the text has {text.count(placeholder)} image placeholders ({placeholder!r}) but "
            f"{len(images)} images were given; each image needs one image part in the messages"
        )
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    encoded = processor(
        text=[text], images=[list(images)], return_tensors="pt", add_special_tokens=False
    )
    ids = encoded["input_ids"][0].tolist()
    return ids, {k: v for k, v in encoded.items() if k not in _TEXT_KEYS}


def encode_messages(
    processor: Any,
    text: str,
    messages: Sequence[Mapping[str, Any]],
    encode: Callable[[str], list[int]],
) -> tuple[list[int], dict[str, torch.Tensor], list[Any]]:
    """Token ids of rendered `text` holding `messages`' images, their tensors, and the images.

    Without images (`images_of(messages)` empty) the ids are `encode(text)` (a renderer's
    cached encoding) and there are no tensors; with images, `encode_with_images`.

    Args:
        processor: A VLM processor (`load_processor`), or None for a text-only model.
        text: Rendered template text holding one `image_placeholder` per image of `messages`.
        messages: The messages `text` renders (their image parts, in order).
        encode: Encodes text without images.

    Raises:
        ValueError: There are images but no processor, or the text holds a different number
            of placeholders (`encode_with_images`).
    """
    images = images_of(messages)
    if not images:
        return encode(text), {}, []
    if processor is None:
        raise ValueError(
            "the conversation holds images but the model has no image processor: train a "
            "vision-language model, with its processor as processing_class"
        )
    ids, vision = encode_with_images(processor, text, images)
    return ids, vision, images


def images_of(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The images of `messages`' image parts (`{"type": "image", "image": <PIL image>}`), in order.

    Raises:
        ValueError: An image part holds no image (the row's `image`/`images` column fills
            them: `with_row_images`), or one that is not a PIL image, or is empty or oversized
            (`tools.picture_problem`).
    """
    images = []
    for message in messages:
        for part in content_parts(message.get("content")):
            if part.get("type") != "image":
                continue
            if part.get("image") is None:
                raise ValueError(
                    "an image part of the prompt has no image: give the row an 'image' or "
                    "'images' column with one image per image part, or put the image in the "
                    "part as {'type': 'image', 'image': <PIL image>}"
                )
            if problem := picture_problem(part["image"]):
                raise ValueError(f"an image part holds {problem}; {PICTURES_ARE_PIL}")
            images.append(part["image"])
    return images


def content_parts(content: Any) -> list[Mapping[str, Any]]:
    """The parts of a message's content: none for text, else its mappings (`{"type": ...}`)."""
    return (
        [part for part in content if isinstance(part, Mapping)] if isinstance(content, list) else []
    )
