"""The stages of a generation round, in order: rows in, micro-batches out.

A round plays `num_generations` episodes per row and scores them (`scoring.play_round`), combines
the reward columns, turns rewards into group-relative advantages, lays the episodes out as one
`TrainingBatch`, adds the old and reference logprobs the loss needs, and cuts the batch into the
micro-batches the optimizer steps consume. `play_and_batch` is that list of stages; everything
it touches comes in through `RoundParts` (the distributed gather included), so a round runs on
CPU without a Trainer, and each stage has explicit inputs and outputs.

`RoundPlan` holds the round's sizes, worked out once from the config and the number of processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from agentgrpo.learner.advantages import combine_rewards, group_advantages
from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.rounds.curriculum import Curriculum
from agentgrpo.rounds.dynamic_sampling import DynamicSampling, Resampled, resample
from agentgrpo.rounds.turn_credit import TurnCredit
from environments.seats import is_seated, seat_players
from rollout import Episode

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

Rows = Sequence[Mapping[str, Any]]
# (rows, num_generations, seed) -> (episodes in group order, rewards_N_F): plays and scores.
Play = Callable[[Rows, int, int], tuple[list[Episode], torch.Tensor]]
# A tensor of this process's rows -> every process's rows, in process order, on the CPU.
Gather = Callable[[torch.Tensor], torch.Tensor]
Logprobs = Callable[[TrainingBatch], torch.Tensor]


@dataclass(frozen=True)
class RoundPlan:
    """The sizes of a generation round, on each process.

    A round plays `prompts_per_process` rows `num_generations` times each (groups never span
    processes) and feeds `repeats` micro-batches of `micro_batch_size` episodes: the round is
    cut into `micro_batches` of them, and each is trained on `num_iterations` times.
    `accumulation_steps` micro-batches make one optimizer step.

    Attributes:
        prompts_per_process: Rows each process plays per round.
        num_generations: Episodes per row (a group).
        num_processes: Processes taking part.
        micro_batch_size: Episodes per micro-batch (`per_device_train_batch_size`).
        micro_batches: Micro-batches a round is cut into (`steps_per_generation`).
        accumulation_steps: Micro-batches per optimizer step (`gradient_accumulation_steps`).
        num_iterations: Times each micro-batch is trained on.
        max_steps: Optimizer steps of the run, or 0 when the epochs decide.
        train: A training round (shuffled, several micro-batches); False for evaluation
            (one micro-batch holding the whole round, never old logprobs).
        whole_groups: Shuffle groups, not episodes, keeping each group's episodes together
            (`micro_batches_commute`): micro-batches then hold few prompts, which the learner
            runs once each (`learner.shared_prompt`).
        seats: Groups each prompt gives: its game's policy seats (`rollout.match`), else 1.
    """

    prompts_per_process: int
    num_generations: int
    num_processes: int = 1
    micro_batch_size: int = 0
    micro_batches: int = 1
    accumulation_steps: int = 1
    num_iterations: int = 1
    max_steps: int = 0
    train: bool = True
    whole_groups: bool = False
    seats: int = 1

    @classmethod
    def from_config(
        cls, args: GRPOConfig, num_processes: int, environment: Any = None
    ) -> RoundPlan:
        """The training round of a `GRPOConfig` (its batch fields already resolved).

        `environment` is the run's environment factory: a game whose policy plays S seats
        gives S episodes per play (`trained_seats`), so a round plays S times fewer rows, and
        its episodes are as many as the batch sizes say.

        Raises:
            ValueError: The round cannot give every process whole groups, or as
                `environments.seats.seat_players`.
        """
        seats = trained_seats(environment, args.seat_players)
        completions, micro_batches = args.generation_batch_size, args.steps_per_generation
        assert completions is not None and micro_batches is not None  # GRPOConfig resolves them
        return cls(
            prompts_per_process=prompts_per_process(
                completions, args.num_generations, num_processes, seats
            ),
            num_generations=args.num_generations,
            num_processes=num_processes,
            micro_batch_size=args.per_device_train_batch_size,
            micro_batches=micro_batches,
            accumulation_steps=args.gradient_accumulation_steps,
            num_iterations=args.num_iterations,
            max_steps=args.max_steps,
            whole_groups=micro_batches_commute(args),
            seats=seats,
        )

    @classmethod
    def for_eval(cls, args: GRPOConfig, num_processes: int, seats: int = 1) -> RoundPlan:
        """An evaluation round: `per_device_eval_batch_size` episodes a process, one batch.

        A game whose policy plays `seats` seats gives that many episodes a play, as in training
        (`from_config`), so the round plays `seats` times fewer rows.
        """
        num_generations = args.num_generations_eval or args.num_generations
        per_process = prompts_per_process(
            args.per_device_eval_batch_size * num_processes, num_generations, num_processes, seats
        )
        return cls(
            per_process,
            num_generations,
            num_processes,
            micro_batch_size=per_process * num_generations * seats,
            train=False,
            seats=seats,
        )

    @property
    def per_prompt(self) -> str:
        """What one prompt gives, for the run's summary: its episodes, or games and seats.

        Examples:
            >>> RoundPlan(prompts_per_process=2, num_generations=4).per_prompt
            '4 per prompt'
            >>> RoundPlan(prompts_per_process=1, num_generations=4, seats=2).per_prompt
            '4 games per prompt, 2 seats trained in each'
        """
        if self.seats == 1:
            return f"{self.num_generations} per prompt"
        return f"{self.num_generations} games per prompt, {self.seats} seats trained in each"

    @property
    def episodes_per_process(self) -> int:
        """Episodes each process plays per round."""
        return self.prompts_per_process * self.num_generations * self.seats

    @property
    def repeats(self) -> int:
        """Micro-batches one round feeds: each of its `micro_batches`, `num_iterations` times."""
        return self.micro_batches * self.num_iterations

    @property
    def optimizer_steps(self) -> float:
        """Optimizer steps one pass over the round makes (a fraction when a step spans rounds)."""
        return self.micro_batches / self.accumulation_steps

    @property
    def needs_old_logprobs(self) -> bool:
        """The policy can change before a micro-batch is trained on: keep the generating one's."""
        whole_steps = self.micro_batches // self.accumulation_steps
        return self.train and (self.num_iterations > 1 or whole_steps > 1)

    @property
    def rows_needed(self) -> int | None:
        """Rows (over all processes) that `max_steps` consumes; None without max_steps."""
        if self.max_steps <= 0:
            return None
        rounds_per_step = self.accumulation_steps / self.micro_batches
        rounds = max(1, int(self.max_steps * rounds_per_step + 0.999))
        return rounds * self.prompts_per_process * self.num_processes

    def num_items(self, round_tokens: float) -> float:
        """The loss normaliser of each micro-batch: active tokens of one optimizer step.

        Args:
            round_tokens: Mask-1 tokens of the whole round, summed over all processes.
        """
        return round_tokens / self.optimizer_steps if self.train else round_tokens

    def first_micro_batch(self, global_step: int) -> int:
        """The index (counted from the run's start) of the micro-batch that `global_step` starts."""
        return global_step * self.accumulation_steps

    def starts_round(self, micro_index: int) -> bool:
        """Whether micro-batch `micro_index` (counted from the run's start) opens a new round."""
        return micro_index % self.repeats == 0

    def position(self, micro_index: int) -> int:
        """Which of its round's micro-batches micro-batch `micro_index` is."""
        return micro_index % self.repeats % self.micro_batches


def trained_seats(environment: Any, players: Mapping[str, str] | None) -> int:
    """How many episodes one play of a row gives: the policy's seats in a game, else 1.

    Raises:
        ValueError: As `environments.seats.seat_players`.
    """
    if not (isinstance(environment, type) and is_seated(environment)):
        return 1
    return sum(p is None for p in seat_players(environment, players).values())


def micro_batches_commute(args: GRPOConfig) -> bool:
    """Whether a round's update is the same whichever episodes share a micro-batch.

    It is when the round lies inside one optimizer step (`gradient_accumulation_steps` a
    multiple of `steps_per_generation`), each micro-batch is trained once (`num_iterations=1`),
    and the loss averages nothing over a micro-batch's tokens: not `bnpo`, no entropy bonus (it
    is a token mean), `top_entropy_quantile=1` (the quantile is a micro-batch's). The grpo and
    dr_grpo means are over a micro-batch's episodes, which every micro-batch has as many of.
    TRL shuffles episodes whatever the loss; where this holds, whole groups are shuffled.
    """
    micro_batches = args.steps_per_generation
    assert micro_batches is not None  # GRPOConfig resolves it
    return (
        args.num_iterations == 1
        and args.gradient_accumulation_steps % micro_batches == 0
        and args.loss_type != "bnpo"
        and args.entropy_coef == 0.0
        and not args.use_adaptive_entropy
        and args.top_entropy_quantile == 1.0
    )


def prompts_per_process(
    completions: int, num_generations: int, processes: int, seats: int = 1
) -> int:
    """Prompts each process plays per round; groups are never split across processes.

    A prompt played as a game with `seats` policy seats gives `seats` groups (one per seat).

    Examples:
        >>> prompts_per_process(completions=16, num_generations=4, processes=2)
        2
        >>> prompts_per_process(completions=16, num_generations=4, processes=1, seats=2)
        2
    """
    if completions % (num_generations * processes * seats):
        per_seat = f" x {seats} seats trained per game" if seats > 1 else ""
        raise ValueError(
            f"a round of {completions} completions over {processes} process(es) cannot give "
            f"each process whole groups of num_generations={num_generations}{per_seat}; "
            f"choose batch sizes so that the round is a multiple of num_generations x "
            f"processes{' x seats' if seats > 1 else ''}"
        )
    return completions // (num_generations * processes * seats)


def round_seed(seed: int, train: bool, global_step: int, process_index: int) -> int:
    """The sampling seed of a round: fixed by the run's seed, mode, step and process.

    Only ints are hashed: Python salts the hash of strings per interpreter, which would break
    reproducibility across runs (and checkpoint resumes).
    """
    return hash((seed, train, global_step, process_index)) % 2**31


@dataclass(frozen=True)
class RewardShaping:
    """How reward columns become one reward per episode, and rewards become advantages.

    Attributes:
        weights_F: One weight per reward column, or None for all ones. A tensor is read at
            each use, so changing it in place changes the next round (TRL's `reward_weights`).
        aggregation: `multi_objective_aggregation` ("sum_then_normalize" or
            "normalize_then_sum").
        scale: `scale_rewards` ("group", "batch" or "none").
        turns: The credit per turn (`turn_advantage`), or None: every token of an episode
            gets its advantage.
    """

    weights_F: Sequence[float] | torch.Tensor | None = None
    aggregation: str = "sum_then_normalize"
    scale: str = "group"
    turns: TurnCredit | None = None

    @classmethod
    def from_config(cls, args: GRPOConfig) -> RewardShaping:
        """The shaping a `GRPOConfig` asks for."""
        turns = None
        if args.turn_advantage != "episode":
            scaled = args.scale_rewards != "none"
            turns = TurnCredit(args.turn_advantage, args.turn_discount, scaled)
        return cls(args.reward_weights, args.multi_objective_aggregation, args.scale_rewards, turns)

    def combine(self, rewards_N_F: torch.Tensor, num_generations: int) -> torch.Tensor:
        """rewards_N: the weighted columns; NaN where every column is None (advantage 0).

        `scoring.warn_if_unscored` has already logged such episodes when they were scored.
        """
        weights_F = torch.as_tensor(self.weights_or_ones(rewards_N_F.shape[1]), dtype=torch.float32)
        return combine_rewards(rewards_N_F, weights_F, num_generations, self.aggregation)

    def weights_or_ones(self, columns: int) -> Sequence[float] | torch.Tensor:
        """`weights_F`, or `columns` ones when it is None."""
        return [1.0] * columns if self.weights_F is None else self.weights_F

    def advantages(self, everyone_N: torch.Tensor, num_generations: int) -> torch.Tensor:
        """advantages_N over every process's rewards (batch scaling needs them all)."""
        scale = self.scale
        if self.aggregation == "normalize_then_sum":
            scale = "batch"  # each reward was normalised per group already (GDPO)
        return group_advantages(everyone_N, num_generations, scale)


@dataclass(frozen=True)
class RoundParts:
    """What a round needs besides its rows: the stages that touch models or other processes.

    Attributes:
        play: Plays the rows and scores the episodes (see `Play`).
        shaping: Rewards to advantages.
        collate: (episodes, advantages_B) -> `TrainingBatch` without logprobs.
        old_logprobs: The current policy's logprobs of a batch, no grad (used when the plan
            says `needs_old_logprobs`).
        ref_logprobs: The reference model's logprobs of a batch, or None when beta is 0.
        gather: See `Gather`; the identity on one process.
        process_index: This process's index in the gather's order.
        dynamic: Replaces a training round's uninformative groups (`dynamic_sampling`), or
            None to train on every group.
        curriculum: Draws a training round's rows in place of the sampler's (`curriculum`),
            or None to play the rows given.
        observe: Receives each round's episodes and their combined rewards_N, as trained
            (after dynamic sampling), wherever they were played; None: nothing does.
    """

    play: Play
    shaping: RewardShaping
    collate: Callable[[Sequence[Episode], torch.Tensor], TrainingBatch]
    old_logprobs: Logprobs
    ref_logprobs: Logprobs | None = None
    gather: Gather = lambda tensor: tensor
    process_index: int = 0
    dynamic: DynamicSampling | None = None
    curriculum: Curriculum | None = None
    observe: Callable[[Sequence[Episode], torch.Tensor], None] | None = None


@dataclass(frozen=True)
class Round:
    """One played round on this process: its episodes, their scores, and the micro-batches.

    Attributes:
        episodes: N episodes in group order.
        rewards_N_F: One column per reward function (NaN where it returned None).
        rewards_N: The combined rewards.
        advantages_N: The advantages the loss uses.
        micro_batches: The batches to train on, in order (one in evaluation).
        resampled: What dynamic sampling replaced, or None when it did not run.
        curriculum: The curriculum's metrics after the round (empty without one).
    """

    episodes: list[Episode]
    rewards_N_F: torch.Tensor
    rewards_N: torch.Tensor
    advantages_N: torch.Tensor
    micro_batches: list[TrainingBatch]
    resampled: Resampled | None = None
    curriculum: dict[str, float] = field(default_factory=dict)


def play_and_batch(parts: RoundParts, plan: RoundPlan, rows: Rows, seed: int) -> Round:
    """Play one round of `rows` and turn it into micro-batches, stage by stage.

    Every process calls this with its own rows at the same time: the advantages and the loss
    normaliser gather over all processes. With a curriculum, a training round plays the
    rows it draws, and every process's results are added to it before dynamic sampling.
    """
    curriculum = parts.curriculum if plan.train else None  # eval rows are never drawn
    if curriculum is not None:
        per_process, processes = plan.prompts_per_process, plan.num_processes
        rows = curriculum.draw_rows(per_process, processes, parts.process_index)
    episodes, rewards_N_F = parts.play(rows, plan.num_generations, seed)  # play, score
    if curriculum is not None:
        weights_F = parts.shaping.weights_or_ones(rewards_N_F.shape[1])
        curriculum.record(parts.gather(rewards_N_F), weights_F, plan.num_generations)
    resampled = None
    if parts.dynamic is not None and plan.train:  # uninformative groups replaced
        combine = functools.partial(parts.shaping.combine, num_generations=plan.num_generations)
        played = episodes, rewards_N_F
        resampled = resample(
            parts.dynamic, combine, parts.gather, played, plan.num_generations, seed
        )
        episodes, rewards_N_F = resampled.episodes, resampled.rewards_N_F
    rewards_N = parts.shaping.combine(rewards_N_F, plan.num_generations)
    if parts.observe is not None:
        parts.observe(episodes, rewards_N)
    advantages_N = local_advantages(parts, rewards_N, plan.num_generations)
    batch = parts.collate(episodes, advantages_N)
    if parts.shaping.turns is not None and plan.train:
        batch = with_turn_credit(parts, plan, batch, episodes, rewards_N, advantages_N)
    batch = with_logprobs(parts, plan, batch)
    micro_batches = split_micro_batches(batch, plan, global_tokens(parts.gather, batch))
    metrics = curriculum.metrics() if curriculum is not None else {}
    return Round(episodes, rewards_N_F, rewards_N, advantages_N, micro_batches, resampled, metrics)


def with_turn_credit(
    parts: RoundParts,
    plan: RoundPlan,
    batch: TrainingBatch,
    episodes: Sequence[Episode],
    rewards_N: torch.Tensor,
    advantages_N: torch.Tensor,
) -> TrainingBatch:
    """`batch` with per-token advantages (`advantages_B_C`) from the credit per turn."""
    assert parts.shaping.turns is not None
    rows_C = parts.shaping.turns.token_advantages(
        episodes, rewards_N, advantages_N, parts.gather, parts.process_index, plan.num_generations
    )
    advantages_B_C = torch.zeros_like(batch.loss_mask_B_C)
    for b, row_C in enumerate(rows_C):
        advantages_B_C[b, : len(row_C)] = row_C
    return replace(batch, advantages_B_C=advantages_B_C)


def local_advantages(
    parts: RoundParts, rewards_N: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """advantages_N of this process's episodes, computed over every process's rewards."""
    advantages_N = parts.shaping.advantages(parts.gather(rewards_N), num_generations)
    start = parts.process_index * len(rewards_N)
    return advantages_N[start : start + len(rewards_N)]


def with_logprobs(parts: RoundParts, plan: RoundPlan, batch: TrainingBatch) -> TrainingBatch:
    """Add old logprobs (when the plan needs them) and reference logprobs (when there is one)."""
    if plan.needs_old_logprobs:
        batch = replace(batch, old_logprobs_B_C=parts.old_logprobs(batch))
    if parts.ref_logprobs is not None:
        batch = replace(batch, ref_logprobs_B_C=parts.ref_logprobs(batch))
    return batch


def global_tokens(gather: Gather, batch: TrainingBatch) -> float:
    """Mask-1 tokens of `batch` summed over every process."""
    return float(gather(batch.loss_mask_B_C.sum().reshape(1)).sum())


def split_micro_batches(
    batch: TrainingBatch, plan: RoundPlan, round_tokens: float
) -> list[TrainingBatch]:
    """Shuffle a training round's episodes and cut them into micro-batches; eval stays whole.

    A micro-batch holds `plan.micro_batch_size` episodes with all their rows (so a forked
    episode makes it longer), which keeps the per-episode normalisations of the loss whole.
    With `plan.whole_groups` the groups are shuffled and each group's episodes stay together.
    Every micro-batch carries `plan.num_items(round_tokens)`. The shuffle draws from torch's
    global generator (seeded by the Trainer, restored on resume).
    """
    num_items = plan.num_items(round_tokens)
    if not plan.train:
        return [replace(batch, num_items=num_items)]
    episodes = batch.episodes
    if plan.whole_groups:
        groups: dict[int, list[int]] = {}
        for n in episodes:  # episode n of the round is in group n // num_generations
            groups.setdefault(n // plan.num_generations, []).append(n)
        chosen = list(groups.values())
        order = [n for g in torch.randperm(len(chosen)).tolist() for n in chosen[g]]
    else:
        order = [episodes[i] for i in torch.randperm(len(episodes)).tolist()]
    size = plan.micro_batch_size
    return [
        replace(batch.select_episodes(order[i : i + size]), num_items=num_items)
        for i in range(0, len(order), size)
    ]
