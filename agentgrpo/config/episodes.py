"""`GRPOConfig` fields of a multi-turn episode: turns, timeouts, template, parser, record."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require
from rollout.parsers import get_parser
from rollout.template_source import load_template
from tools.mcp import mcp_servers_of

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
    mcp_servers: list[str] | None = field(
        default=None,
        metadata={
            "help": "MCP servers whose tools every episode offers beside the environment's: "
            "each a command that serves MCP on stdio ('python server.py --flag'), an http(s):// "
            "URL (streamable HTTP), or a JSON object (or, in Python, a dict) with 'command', "
            "'args' and 'env', or 'url', and optionally 'per_episode'. Started before the "
            "first episode to list their tools; then shared by all episodes and stopped when "
            'the run ends, or, with "per_episode": true, started afresh for each episode '
            "(an HTTP server: a session of its own) and stopped when it ends. On the command "
            "line also --mcp-server, once per server (run and eval)."
        },
    )
    infra_retries: int = field(
        default=2,
        metadata={
            "help": "How often an episode that an infrastructure failure ended (a tool, the "
            "environment or an MCP server raised tools.InfrastructureError: a sandbox that "
            "died, a server that is gone) is replayed from scratch, same row and seed. After "
            "that it is kept as failed (finish infra): not scored, left out of its group's "
            "baseline, not trained on, counted in episodes/infra_failures. 0: never replayed."
        },
    )
    seat_players: dict[str, str] | None = field(
        default=None,
        metadata={
            "help": "Who plays each seat of a game with seats (docs/several-players.md), as a "
            "JSON object of seat to player: 'policy' (the model; its turns are trained), "
            "'snapshot' or 'snapshot:N' (a frozen copy of the policy, refreshed every N steps; "
            "on vLLM a LoRA policy's adapter), 'league:N:K' (one of its K latest snapshots, "
            "drawn per game), "
            "'adapter:NAME' (a trained LoRA adapter of its own; needs peft_config), 'model:PATH' "
            "(another model saved in the folder PATH, never trained; transformers only), "
            "'random' (a random legal move) or 'module:function' (a scripted player). Seats "
            'left out are the policy\'s. None: self-play, every seat trained. Example: {"o": '
            '"random"}.'
        },
    )
    adapter_learning_rates: dict[str, float] | None = field(
        default=None,
        metadata={
            "help": "With seats played by trained LoRA adapters ('adapter:NAME' in seat_players; "
            "docs/several-players.md), a JSON object of adapter name to its learning rate. "
            "Adapters left out, and the policy's own, use learning_rate; all follow the same "
            'schedule. Example: {"solver": 1e-5}.'
        },
    )
    seat_temperatures: dict[str, float] | None = field(
        default=None,
        metadata={
            "help": "Sampling temperature of seats a frozen player plays ('snapshot', "
            "'league:N:K', 'model:PATH' in seat_players), as a JSON object of seat to "
            "temperature; 0: greedy. Seats left out sample at temperature. A trained seat "
            'samples at temperature (its logprobs are the policy\'s). Example: {"o": 0} for '
            "an opponent that always plays its most likely move."
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
    """Check the episode limits: turns, timeouts, concurrency and replays."""
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
    require(
        config.infra_retries >= 0,
        f"infra_retries={config.infra_retries} must be 0 (an infrastructure failure is not "
        "replayed) or more.",
    )
    mcp_servers_of(config.mcp_servers)  # each spec names a server whose command is here
    players = config.seat_players
    require(
        players is None
        or (isinstance(players, dict) and all(isinstance(v, str) for v in players.values())),
        f"seat_players={players!r} must map seat names to players ('policy', 'snapshot', "
        "'adapter:NAME', 'random' or 'module:function'), e.g. {'o': 'random'}.",
    )
    rates = config.adapter_learning_rates
    require(
        rates is None
        or (
            isinstance(rates, dict)
            and all(isinstance(v, int | float) and v > 0 for v in rates.values())
            and set(rates) <= _adapters_named(players)
        ),
        f"adapter_learning_rates={rates!r} must map adapters that seat_players names "
        f"('adapter:NAME'; named here: {sorted(_adapters_named(players))}) to positive "
        "learning rates, e.g. {'solver': 1e-5}.",
    )
    _check_seat_temperatures(config.seat_temperatures, players)


def _check_seat_temperatures(temperatures: object, players: object) -> None:
    """Each `seat_temperatures` entry: a seat a frozen player plays, a temperature >= 0."""
    frozen = {
        seat
        for seat, player in (players.items() if isinstance(players, dict) else ())
        if str(player).partition(":")[0] in _SAMPLED_FROZEN
    }
    require(
        temperatures is None
        or (
            isinstance(temperatures, dict)
            and all(isinstance(t, int | float) and t >= 0 for t in temperatures.values())
            and set(temperatures) <= frozen
        ),
        f"seat_temperatures={temperatures!r} must map seats that a frozen player plays in "
        f"seat_players ('snapshot', 'league:N:K' or 'model:PATH'; here: {sorted(frozen)}) to "
        "temperatures of 0 (greedy) or more, e.g. {'o': 0}: a trained seat samples at "
        "temperature, and a random or scripted player samples nothing.",
    )


# Players that sample from frozen weights: a sampling temperature of their own fits them.
_SAMPLED_FROZEN = ("snapshot", "league", "model")


def _adapters_named(players: object) -> set[str]:
    """The NAMEs of the ``"adapter:NAME"`` players in `players` (a `seat_players` value)."""
    if not isinstance(players, dict):
        return set()
    found = (str(p).partition(":") for p in players.values())
    return {name for kind, _, name in found if kind == "adapter"}


def check_template_and_parser(config: "GRPOConfig") -> None:
    """Look the chat template and tool-call parser up by name (rollout's own lookups raise)."""
    if config.tool_call_parser is not None:
        get_parser(config.tool_call_parser)
    if config.chat_template is not None:
        load_template(None, config.chat_template)  # the tokenizer is only read for None
