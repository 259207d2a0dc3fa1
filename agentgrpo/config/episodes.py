"""`GRPOConfig` fields of a multi-turn episode: turns, timeouts, template, parser, record."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require
from rollout.parsers import get_parser
from rollout.template import load_template

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig


@dataclass
class ToolCallingFields:
    """TRL's bound on tool-calling turns."""

    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Most turns whose tool calls run, as in TRL: a later turn that calls tools "
            "ends the episode there (finish max_turns), its calls not run. None: no limit but "
            "max_turns and the token budget."
        },
    )


@dataclass
class EpisodeFields:
    """agentgrpo's episodes: turns, timeouts, concurrency, template, parser, record."""

    max_turns: int | None = field(
        default=None,
        metadata={
            "help": "Most model turns per episode. None: max_tool_calling_iterations + 1 when "
            "that is set, else only the token budget limits turns."
        },
    )
    tool_timeout_s: float | None = field(
        default=30.0,
        metadata={
            "help": "Seconds one tool call may run before it fails (as a message to the model). "
            "None: no timeout."
        },
    )
    environment_timeout_s: float | None = field(
        default=120.0,
        metadata={
            "help": "Seconds each of an environment's __init__, reset, done (a property), "
            "reward and close may take before the run stops with an error naming the method. "
            "None: no timeout."
        },
    )
    max_concurrent_episodes: int = field(
        default=256, metadata={"help": "Most episodes in flight at once."}
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "Template that renders conversations and tools. None: the tokenizer's; "
            "'chatml_tools': built-in ChatML with Hermes tool calls; or jinja source."
        },
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": "How tool calls are read from model text (a rollout.PARSERS name: 'hermes', "
            "'llama3_json', 'qwen3_xml', 'glm4', 'harmony', 'atem', 'mistral', 'deepseek_v3', "
            "'gemma4', 'lfm2'). None: detected from the chat template."
        },
    )
    log_episodes: bool = field(
        default=True,
        metadata={
            "help": "Write every training episode (token ids, loss mask, sampler logprobs, "
            "messages, tool calls and results, rewards, advantage, policy version) to "
            "<output_dir>/episodes/step-N.jsonl as each step ends."
        },
    )


def check_episode_values(config: "GRPOConfig") -> None:
    """Check the episode limits: turns, timeouts and concurrency."""
    require(
        config.max_turns is None or config.max_turns >= 1,
        f"max_turns={config.max_turns} must be at least 1 (or None for no turn limit).",
    )
    require(
        config.tool_timeout_s is None or config.tool_timeout_s > 0,
        f"tool_timeout_s={config.tool_timeout_s} must be positive (or None for no timeout).",
    )
    require(
        config.environment_timeout_s is None or config.environment_timeout_s > 0,
        f"environment_timeout_s={config.environment_timeout_s} must be positive (or None for "
        "no timeout).",
    )
    require(
        config.max_concurrent_episodes >= 1,
        f"max_concurrent_episodes={config.max_concurrent_episodes} must be at least 1.",
    )


def check_template_and_parser(config: "GRPOConfig") -> None:
    """Look the chat template and tool-call parser up by name (rollout's own lookups raise)."""
    if config.tool_call_parser is not None:
        get_parser(config.tool_call_parser)
    if config.chat_template is not None:
        load_template(None, config.chat_template)  # the tokenizer is only read for None
