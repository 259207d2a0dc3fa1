"""The supervised warm start: teach the tool-call format from an environment's demonstrations.

A model that never writes a tool call gives GRPO nothing to compare: every episode of a group
earns the same reward. A few supervised steps on `demonstrations()` conversations (which show
the format, not the answers) fix that. The conversations are laid out by the engine's own
renderer (`rollout.demonstrations.demonstration_ids`), so the warm start trains on exactly the
tokens the model then sees and samples when it plays; where the chat template rewrites history, a
conversation is several rows, as an episode is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from environments import class_tools
from rollout import ChatRenderer
from rollout.demonstrations import DemonstrationRow, demonstration_ids
from tools import Tool, call_problems
from tools.threads import describe_error

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


def environment_demonstrations(
    environment: Any, n: int, seed: int
) -> list[Sequence[Mapping[str, Any]]]:
    """`n` conversations from the environment class's `demonstrations(n, seed)`.

    Raises:
        ValueError: There is no environment class, it has no `demonstrations` classmethod that
            can be called as `demonstrations(n, seed=seed)`, the call raised, or it returned
            something else than at least `n` conversations (lists of message dicts) the run
            would accept; the message names the method, and the conversation and message.

    """
    name = getattr(environment, "__name__", type(environment).__name__)
    method = getattr(environment, "demonstrations", None)
    if not isinstance(environment, type) or method is None:
        raise ValueError(
            f"warm_start_steps > 0 needs an environment class with a classmethod "
            f"`demonstrations(n, seed) -> list[list[dict]]`; {name} has none. Add one, or set "
            f"warm_start_steps=0."
        )
    _check_callable_on_the_class(environment, method, name, n, seed)
    try:
        returned = method(n, seed=seed)
    except Exception as error:
        raise ValueError(
            f"{name}.demonstrations({n}, seed={seed}) raised {describe_error(error)}"
        ) from error
    conversations = _conversations(returned, name)
    if len(conversations) < n:
        raise ValueError(f"{name}.demonstrations({n}) returned {len(conversations)} conversations")
    check_demonstrations(conversations[:n], class_tools(environment), name)
    return conversations[:n]


_SHAPE = "return a list of conversations, each a list of messages (dicts with role and content)"


def _check_callable_on_the_class(
    environment: type, method: Callable[..., Any], name: str, n: int, seed: int
) -> None:
    """Raise ValueError unless `method` is a classmethod (or staticmethod) taking `(n, seed=)`."""
    static = inspect.getattr_static(environment, "demonstrations")
    if inspect.isfunction(static):  # a plain method: called on the class, n would be `self`
        raise ValueError(
            f"{name}.demonstrations is an instance method; make it a @classmethod "
            f"`demonstrations(cls, n, seed=0)`: the warm start calls it on the class"
        )
    try:
        inspect.signature(method).bind(n, seed=seed)
    except TypeError as error:
        raise ValueError(
            f"{name}.demonstrations cannot be called as demonstrations({n}, seed={seed}) "
            f"({error}); give it the signature `demonstrations(cls, n, seed=0)`"
        ) from None
    except ValueError:  # no signature to read: the call tells
        pass


def _conversations(returned: Any, name: str) -> list[Sequence[Mapping[str, Any]]]:
    """`returned` as a list of conversations, each checked to be a list of message dicts.

    Raises:
        ValueError: `returned` is not a list (or other iterable) of conversations, or one of
            them is not a list of dicts; the message names the conversation and message.
    """
    if isinstance(returned, str | bytes | Mapping) or not isinstance(returned, Iterable):
        raise ValueError(f"{name}.demonstrations() returned {type(returned).__name__}; {_SHAPE}")
    conversations = list(returned)
    for c, conversation in enumerate(conversations):
        if isinstance(conversation, str | bytes | Mapping) or not isinstance(
            conversation, Sequence
        ):
            raise ValueError(
                f"{name}.demonstrations(): conversation {c} is a {type(conversation).__name__}, "
                f"not a list of messages; {_SHAPE}"
            )
        for m, message in enumerate(conversation):
            if not isinstance(message, Mapping):
                raise ValueError(
                    f"{name}.demonstrations(): conversation {c}, message {m} is a "
                    f"{type(message).__name__}, not a dict; {_SHAPE}"
                )
    return conversations


def check_demonstrations(
    conversations: Sequence[Sequence[Mapping[str, Any]]], tools: Mapping[str, Tool], name: str
) -> None:
    """Check that every demonstrated call is one the model could make, and every result text.

    A call must name one of `tools` with arguments it takes (as `call_tool` checks the model's),
    and a tool message's content must be a string: a warm start on anything else teaches a
    format the run will never accept.

    Raises:
        ValueError: Naming `name.demonstrations()`, the conversation and message, and the fault.
    """
    for c, conversation in enumerate(conversations):
        for m, message in enumerate(conversation):
            for problem in _message_problems(message, tools):
                raise ValueError(
                    f"{name}.demonstrations(): conversation {c}, message {m}: {problem} Write "
                    "calls the environment's tools accept, with their results as text."
                )


def _message_problems(message: Mapping[str, Any], tools: Mapping[str, Tool]) -> list[str]:
    if message.get("role") == "tool" and not isinstance(message.get("content"), str):
        return [f"a tool message's content is {type(message.get('content')).__name__}, not str."]
    calls = message.get("tool_calls") or []
    if isinstance(calls, str | Mapping) or not isinstance(calls, Sequence):
        return [f"tool_calls is a {type(calls).__name__}, not a list of calls."]
    problems = []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        if not isinstance(function, Mapping):
            problems.append(f"a call's function is a {type(function).__name__}, not a dict.")
            continue
        problems += call_problems(tools, function.get("name"), function.get("arguments"))
    return problems


def warm_start(
    model: torch.nn.Module,
    renderer: ChatRenderer,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    learning_rate: float,
    stop_text: str,
    log: Callable[[int, float], None] = lambda step, loss: None,
) -> list[float]:
    """Fine-tune `model` in place, one AdamW step per conversation; loss on mask-1 tokens only.

    A conversation is one or more rows (`demonstration_ids`: more than one where the template
    forks), each its own sequence. Every trained token weighs the same: a step's loss is the
    mean cross-entropy over the trained tokens of all the conversation's rows, so a turn counts
    as much whether or not the template forked before it, and a one-row conversation's loss is
    the model's own mean over its labels.

    Args:
        model: The policy (a causal LM), on its training device.
        renderer: The renderer episodes use, so the layout matches play exactly.
        conversations: Demonstrations, each a prompt followed by assistant and tool turns.
        learning_rate: AdamW's learning rate (its own optimizer, discarded afterwards).
        stop_text: The text that ends an assistant turn (the tokenizer's end-of-turn token).
        log: Called with (step, loss) after each step.

    Returns:
        The loss of each step.

    """
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], learning_rate)
    was_training = model.training
    model.train()
    losses = []
    for step, messages in enumerate(conversations):
        losses.append(_conversation_step(model, demonstration_ids(renderer, messages, stop_text)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log(step, losses[-1])
    model.train(was_training)
    return losses


def _conversation_step(model: torch.nn.Module, rows: Sequence[DemonstrationRow]) -> float:
    """Backpropagate the mean loss over the rows' trained tokens, one row at a time; return it."""
    device = next(model.parameters()).device
    trained = [sum(row.mask[1:]) for row in rows]  # the tokens each row's labels count
    total = 0.0
    for row, count in zip(rows, trained, strict=True):
        if not count:  # a row whose only trained token is its first: no label to predict
            continue
        ids_1_T = torch.tensor([row.ids], device=device)
        labels_1_T = ids_1_T.masked_fill(torch.tensor([row.mask], device=device) == 0, -100)
        loss = model(input_ids=ids_1_T, labels=labels_1_T).loss * (count / sum(trained))
        loss.backward()
        total += loss.item()
    return total


def warm_start_from_environment(
    model: torch.nn.Module,
    renderer: ChatRenderer,
    environment: Any,
    args: GRPOConfig,
    stop_text: str,
    show: bool,
) -> list[float]:
    """`warm_start` on `args.warm_start_steps` of the environment's demonstrations.

    `args` is the run's `GRPOConfig` (its `warm_start_steps`, `warm_start_learning_rate`,
    `seed` and `device`); `show` prints each step's loss. Returns the loss of each step.
    """
    steps = args.warm_start_steps
    conversations = environment_demonstrations(environment, steps, seed=args.seed)

    def log(step: int, loss: float) -> None:
        if show:
            print(f"warm start {step + 1}/{steps}: loss {loss:.3f}", flush=True)

    model.to(args.device)
    return warm_start(
        model, renderer, conversations, args.warm_start_learning_rate, stop_text=stop_text, log=log
    )
