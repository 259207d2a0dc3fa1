"""The one place a run's parts are built from a `GRPOConfig`: training and `agentgrpo eval` alike.

`build_parts` turns the config, a generation backend, the tokenizer, the environment, the tools
and the reward functions into the episode settings, the rollout engine that plays them, the
scorer that rates them and the loss settings, so that evaluation plays exactly the episodes
training would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentgrpo.config.context import context_of
from agentgrpo.learner.losses import LossConfig
from agentgrpo.learner.objectives import VespoShape
from agentgrpo.rewards.calls import RewardFunction
from agentgrpo.rounds.scoring import Scorer, environment_reward_classes
from environments.seats import OtherModel, Snapshot, is_seated, seat_players
from rollout import EpisodeConfig, GenerationBackend, RolloutEngine
from rollout.agents import Agent
from rollout.match import MatchEngine
from tools.mcp import mcp_servers_of

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


@dataclass(frozen=True)
class RunParts:
    """A run's parts, built by `build_parts`.

    Attributes:
        episode_config: How each episode is played (lengths, turns, sampling, tool timeout).
        engine: Plays episodes with the backend, the environment and the tools.
        scorer: Rates a group of episodes with the reward functions and the environment.
        loss_config: The loss and its hyperparameters.
        reward_weights: One weight per reward column (`scorer.names`).
    """

    episode_config: EpisodeConfig
    engine: RolloutEngine
    scorer: Scorer
    loss_config: LossConfig
    reward_weights: list[float]


def build_parts(
    config: GRPOConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None,
    tools: Sequence[Callable[..., Any]] = (),
    reward_funcs: Sequence[RewardFunction] = (),
    trainer_state: Callable[[], Any] = lambda: None,
    agent: Agent | None = None,
    seat_backends: Mapping[str, GenerationBackend | Sequence[GenerationBackend]] | None = None,
) -> RunParts:
    """Build the parts of a run from `config` (a `GRPOConfig`).

    Args:
        config: The run's settings.
        backend: Generates the model's turns.
        tokenizer: The policy's tokenizer.
        environment_factory: The environment class (or zero-argument factory), a dict of them
            by name (each row's `environment` column picks one), or None.
        tools: Plain tool functions offered in every episode.
        reward_funcs: Reward functions, already wrapped (`rewards.calls.reward_functions`).
        trainer_state: Returns the `TrainerState` passed to reward functions (None outside
            training).
        agent: An agent that plays each episode through the engine's chat endpoint, in place
            of an environment and tools; its returned rewards are reward columns of their own.
        seat_backends: The backend (a league: its pool) of each seat a frozen snapshot or
            another model (``"model:PATH"``) plays (`seat_players`); None: `backend` plays the
            snapshot seats, which is right where the policy does not train (evaluation: its
            snapshot is itself), and a seat of another model is refused.

    Raises:
        ValueError: No reward at all, or `reward_weights` not matching the rewards (see
            `reward_weights_of`).
    """
    engine = build_engine(
        config, backend, tokenizer, environment_factory, tools, agent, seat_backends
    )
    scorer = Scorer(
        funcs=list(reward_funcs),
        env_reward_classes=environment_reward_classes(environment_factory),
        with_environments=environment_factory is not None,
        text_completions=not engine.context.has_tools and agent is None,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        trainer_state=trainer_state,
        agent_columns=agent.columns if agent is not None else (),
    )
    own = [1.0] * len(scorer.env_reward_classes) + list(agent.weights if agent else ())
    weights = reward_weights_of(scorer.names, len(scorer.funcs), config.reward_weights, own)
    episode_config = engine.context.config  # every environment's context shares it
    return RunParts(episode_config, engine, scorer, loss_config_of(config), weights)


def build_engine(
    config: GRPOConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None,
    tools: Sequence[Callable[..., Any]] = (),
    agent: Agent | None = None,
    seat_backends: Mapping[str, GenerationBackend | Sequence[GenerationBackend]] | None = None,
) -> RolloutEngine:
    """The engine that plays a `GRPOConfig` run's episodes (its template, parser and limits).

    `build_parts` builds the run's with it; `agentgrpo doctor --generate` plays through it too,
    with no reward to score. The arguments are `build_parts`'s; what `RolloutEngine` refuses
    is raised. A game with seats is played by a `MatchEngine` (`seat_players` says who plays
    each seat).

    Raises:
        ValueError: `seat_players` without a game with seats, a game with seats played
            beside several environments or an agent, or a seat of another model without its
            backend in `seat_backends`.
    """
    options: dict[str, Any] = {}
    engine_class: type[RolloutEngine] = RolloutEngine
    if isinstance(environment_factory, type) and is_seated(environment_factory):
        if agent is not None:
            raise ValueError(
                f"{environment_factory.__qualname__} is a game with seats, which plays "
                "without an agent: drop the agent"
            )
        engine_class, options["players"] = MatchEngine, config.seat_players
        options["seat_temperatures"] = config.seat_temperatures
        options["seat_backends"] = _seat_backends(
            config, environment_factory, backend, seat_backends
        )
    elif config.seat_players:
        raise ValueError(
            f"seat_players={config.seat_players} needs one environment class with seats (e.g. "
            "env:TicTacToe); leave it unset for this run"
        )
    return engine_class(
        backend,
        tokenizer,
        environment_factory=environment_factory,
        tools=tools,
        chat_template=config.chat_template,
        tool_call_parser=config.tool_call_parser,
        # JSON object text is parsed by TrainingArguments; other text is not a valid value.
        chat_template_kwargs=config.chat_template_kwargs,  # type: ignore[arg-type]
        config=episode_config_of(config),
        max_concurrent_episodes=config.max_concurrent_episodes,
        player=agent.player if agent is not None else None,
        mcp_servers=mcp_servers_of(config.mcp_servers),
        infra_retries=config.infra_retries,
        **options,
    )


def _seat_backends(
    config: GRPOConfig,
    game: type,
    backend: GenerationBackend,
    given: Mapping[str, GenerationBackend | Sequence[GenerationBackend]] | None,
) -> Mapping[str, GenerationBackend | Sequence[GenerationBackend]]:
    """What plays `game`'s frozen seats: `given`, or `backend` for each snapshot seat.

    Raises:
        ValueError: A seat another model plays (``"model:PATH"``) and no backend given for it:
            `backend` is not that model.
    """
    players = seat_players(game, config.seat_players)
    if given is not None:
        return given
    models = {s: p.path for s, p in players.items() if isinstance(p, OtherModel)}
    if models:
        raise ValueError(
            f"seat_players plays {models} (seat: folder) with other models, whose backends the "
            "caller loads: pass seat_backends (agentgrpo.training.seat_models builds them; "
            "`agentgrpo run`, `agentgrpo eval` and GRPOTrainer do this)"
        )
    return {seat: backend for seat, p in players.items() if isinstance(p, Snapshot)}


def episode_config_of(config: GRPOConfig) -> EpisodeConfig:
    """How each episode of a `GRPOConfig` run is played."""
    max_completion_length = config.max_completion_length
    assert max_completion_length is not None  # GRPOConfig refuses None
    return EpisodeConfig(
        max_completion_length=max_completion_length,
        max_turns=config.episode_max_turns,
        max_tool_rounds=config.max_tool_calling_iterations,
        tool_timeout_s=config.tool_timeout_s,
        environment_timeout_s=config.environment_timeout_s,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k or 0,
        max_context=config.max_context,
        context=context_of(config),
        turn_states=config.turn_advantage == "same_state",
    )


def loss_config_of(config: GRPOConfig) -> LossConfig:
    """The loss settings of a `GRPOConfig`."""
    epsilon_high = config.epsilon_high
    assert epsilon_high is not None  # GRPOConfig resolves it (None: epsilon)
    return LossConfig(
        loss_type=config.loss_type,
        epsilon_low=config.epsilon,
        epsilon_high=epsilon_high,
        delta=config.delta,
        importance_sampling_level=config.importance_sampling_level,
        beta=config.beta,
        use_bias_correction_kl=config.use_bias_correction_kl,
        sapo_temperature_pos=config.sapo_temperature_pos,
        sapo_temperature_neg=config.sapo_temperature_neg,
        vespo_positive=VespoShape(config.vespo_k_pos, config.vespo_lambda_pos),
        vespo_negative=VespoShape(config.vespo_k_neg, config.vespo_lambda_neg),
        max_completion_length=config.max_completion_length,
        entropy_coef=config.entropy_coef,
    )


def reward_weights_of(
    names: Sequence[str],
    num_funcs: int,
    weights: Sequence[float] | None,
    own: Sequence[float] = (),
) -> list[float]:
    """One weight per reward column (`names`: the functions', then the environments' and agent's).

    `weights` may cover every column, or only the `num_funcs` reward functions (TRL's form):
    then the columns after them get their `own` weights (an agent's `reward_weights`; empty:
    1.0 each). None weighs each function 1 and the other columns by `own`.

    Raises:
        ValueError: There is no reward at all, or `weights` has another length.

    Examples:
        >>> reward_weights_of(["correct", "Counter"], 1, [0.5])
        [0.5, 1.0]
        >>> reward_weights_of(["short", "exact", "format"], 1, None, own=[2.0, 0.5])
        [1.0, 2.0, 0.5]
    """
    if not names:
        raise ValueError(
            "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
            "environment defines a `get_reward` method (or `reward`, agentgrpo's name). A "
            "`reward` attribute that the tools update is the environment's state: read it in a "
            "reward function, as TRL's OpenEnv examples do (`def reward_func(environments, "
            "**kwargs): return [env.reward for env in environments]`)."
        )
    own = [float(w) for w in own] or [1.0] * (len(names) - num_funcs)
    if weights is None:
        return [1.0] * num_funcs + own
    if len(weights) == num_funcs:
        return [float(w) for w in weights] + own
    if len(weights) != len(names):
        message = (  # TRL's words first
            f"Number of reward weights ({len(weights)}) must match number of reward functions "
            f"({num_funcs})"
        )
        if len(names) > num_funcs:
            message += f", or of rewards with the environment's own ({', '.join(names)})"
        raise ValueError(message + ".")
    return [float(w) for w in weights]
