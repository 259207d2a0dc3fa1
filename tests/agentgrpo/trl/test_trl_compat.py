"""What scripts written for TRL's GRPOTrainer (and an Unsloth-style card) rely on, beyond the docs.

Each test is one behaviour of TRL 1.16's code that agentgrpo matches: several environments
chosen per row, environments that own their data, reward weights, the trainer's public
attributes and helpers, iterable datasets, the phrases of TRL's messages, and the argument
spellings of the Unsloth-style usage card in the seeds. Behaviours that are runs are short real
runs of GRPOTrainer on the tiny random Llama.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset, IterableDataset
from transformers import LlamaConfig, LlamaForSequenceClassification

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.training.porting import check_optimizer
from tests.support.runs import CounterTools, one_step
from tests.support.tiny_model import tiny_llama, tiny_model
from tests.support.trainer import tiny_trainer


def config(tmp_path, **changes) -> GRPOConfig:
    """One optimizer step of 4 completions (2 prompts x 2 generations), 8 tokens each."""
    return GRPOConfig(**one_step(tmp_path, **changes))


def trainer_for(tokenizer, args, **arguments) -> GRPOTrainer:
    return GRPOTrainer(
        model=tiny_llama(tokenizer), args=args, processing_class=tokenizer, **arguments
    )


def conversation(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def zero(completions, **kwargs):
    return [0.0] * len(completions)


# --- Environments and tools ---------------------------------------------------------------


class Counter(CounterTools):
    """Counts; scores itself 0.25. Remembers what reset received."""

    def reset(self, **kwargs) -> None:
        self.reset_with, self.counter = kwargs, 0

    def get_reward(self) -> float:
        return 0.25


class Echo:
    """Repeats; scores itself 0.75. Remembers what reset received."""

    def reset(self, **kwargs) -> None:
        self.reset_with = kwargs

    def shout(self, text: str) -> str:
        """Say something loudly.

        Args:
            text: What to say.
        """
        return text.upper()

    def get_reward(self) -> float:
        return 0.75


MIXED_ROWS = Dataset.from_dict(
    {
        "prompt": [conversation("Count to 3."), conversation("Shout hello.")],
        "environment": ["counter", "echo"],
    }
)


def test_a_dict_environment_factory_picks_each_rows_environment_by_its_environment_column(
    tokenizer, tmp_path
):
    seen = []

    def record(environments, environment, **kwargs):
        seen.extend(zip(environment, environments, strict=True))
        return [0.0] * len(environments)

    trainer = trainer_for(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools"),
        reward_funcs=record,
        train_dataset=MIXED_ROWS,
        environment_factory={"counter": Counter, "echo": Echo},
    )
    trainer.train()
    # Each row played against its own environment, which never saw the routing column.
    assert {(name, type(env)) for name, env in seen} == {("counter", Counter), ("echo", Echo)}
    assert all("environment" not in env.reset_with for _, env in seen)
    # Only the row's environment's tools are offered in its prompt.
    for record_ in trainer.last_records:
        prompt = tokenizer.decode(record_.episode.rows[0].prompt_ids)
        own, other = ("increment", "shout") if "Count" in prompt else ("shout", "increment")
        assert own in prompt and other not in prompt
        # One reward column per environment class; the other environment's is None.
        expected = (
            {"Counter": 0.25, "Echo": None}
            if own == "increment"
            else {
                "Counter": None,
                "Echo": 0.75,
            }
        )
        assert {k: record_.rewards[k] for k in ("Counter", "Echo")} == expected
    assert trainer.reward_func_names == ["record", "Counter", "Echo"]


def test_a_dict_environment_factory_refuses_unknown_environments_and_a_missing_dataset(
    tokenizer, tmp_path
):
    factories = {"counter": Counter, "echo": Echo}
    args = config(tmp_path, chat_template="chatml_tools")
    unknown = MIXED_ROWS.map(lambda row: {"environment": row["environment"].replace("echo", "ech")})
    # As in TRL: the trainer is built, and training stops before its first step, in TRL's words.
    trainer = trainer_for(tokenizer, args, train_dataset=unknown, environment_factory=factories)
    with pytest.raises(ValueError) as raised:
        trainer.train()
    assert str(raised.value) == (
        "Example has `environment='ech'`, which is not among the environments passed to "
        "`environment_factory`. Expected one of: ['counter', 'echo']."
    )
    assert trainer.state.global_step == 0
    no_column = MIXED_ROWS.remove_columns("environment")
    trainer = trainer_for(tokenizer, args, train_dataset=no_column, environment_factory=factories)
    with pytest.raises(ValueError, match=r"Example has `environment=None`.*'environment' column"):
        trainer.train()
    with pytest.raises(ValueError, match="requires a `train_dataset` with an `environment` column"):
        trainer_for(tokenizer, args, environment_factory=factories)


class Silent(CounterTools):
    """States no task (reset returns None) and scores itself: TRL's environment-owned data."""

    def reset(self, **kwargs) -> None:
        self.counter = 0

    def get_reward(self) -> float:
        return float(self.counter == 3)


class SilentWithRows(Silent):
    """The same, with its own task rows, none of which has a prompt."""

    @classmethod
    def dataset(cls) -> list[dict]:
        return [{"level": k} for k in range(4)]


@pytest.mark.parametrize("environment", [Silent, SilentWithRows])
def test_an_environment_that_owns_its_data_and_whose_reset_returns_none_trains(
    tokenizer, tmp_path, environment
):
    trainer = trainer_for(
        tokenizer, config(tmp_path, chat_template="chatml_tools"), environment_factory=environment
    )
    trainer.train()
    assert trainer.state.global_step == 1
    # As in TRL, the prompt is one empty user message (the tools still frame the task).
    for record in trainer.last_records:
        assert record.episode.messages[0] == {"role": "user", "content": ""}
        assert record.rewards == {environment.__name__: 0.0}


def one(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.mark.parametrize(("weights", "combined"), [([2.0], 2.0 + 0.25), ([2.0, 4.0], 2.0 + 1.0)])
def test_reward_weights_covering_only_reward_funcs_give_the_environments_reward_weight_1(
    tokenizer, tmp_path, weights, combined
):
    trainer = trainer_for(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools", reward_weights=weights),
        reward_funcs=one,
        train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
        environment_factory=Counter,
    )
    trainer.train()
    assert [record.reward for record in trainer.last_records] == [combined] * 4
    with pytest.raises(ValueError, match=r"Number of reward weights \(3\) must match number of"):
        trainer_for(
            tokenizer,
            config(tmp_path, chat_template="chatml_tools", reward_weights=[1.0, 1.0, 1.0]),
            reward_funcs=one,
            train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
            environment_factory=Counter,
        )


def tiny_reward_model(tokenizer) -> LlamaForSequenceClassification:
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return tiny_model(
        LlamaForSequenceClassification, LlamaConfig, len(tokenizer), **sizes,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    ).eval()  # fmt: skip


def test_the_trainer_has_trls_reward_names_processing_classes_aux_loss_flag_and_mask_helpers(
    tokenizer, tmp_path
):
    trainer = trainer_for(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools"),
        reward_funcs=[zero, tiny_reward_model(tokenizer)],
        reward_processing_classes=[None, tokenizer],
        train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
        environment_factory=Counter,
    )
    assert trainer.reward_func_names == ["zero", "LlamaForSequenceClassification", "Counter"]
    assert trainer.reward_processing_classes == [None, tokenizer, None]
    assert trainer.aux_loss_enabled is False  # a dense Llama has no router
    # get_high_entropy_mask(entropies, mask, threshold): tokens at or above the threshold
    # quantile of the active entropies. Active: 1, 2, 3, 4 (9 and 0 are padding); their
    # median, the 0.5 quantile, is 2.5.
    entropies = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert trainer.get_high_entropy_mask(entropies, mask, 0.5).tolist() == [
        [False, False, False],
        [True, True, False],
    ]
    # get_off_policy_mask (a static method, as in TRL): drop a sequence whose advantage is
    # negative and whose mean drift (sampler - policy logprobs) exceeds the threshold.
    logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    sampler = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-1.0, float("nan")]])  # drift 1, 1, 0
    advantages = torch.tensor([[-1.0], [1.0], [-1.0]])
    keep = GRPOTrainer.get_off_policy_mask(advantages, logps, sampler, torch.ones(3, 2), 0.5)
    assert keep.tolist() == [[0.0], [1.0], [1.0]]


# --- TRL's public attributes ---------------------------------------------------------------

# The public attributes TRL 1.16's GRPOTrainer.__init__ sets (`self.<name> = ...` in
# trl/trainer/grpo_trainer.py), and its public methods; when trl is installed the test also reads
# that file, so a name added there shows up here.
TRL_ATTRIBUTES = {
    "beta", "chat_template", "chat_template_kwargs", "continuous_batching_config",
    "entropy_coef", "environment_factories", "environments", "eos_token_ids", "epsilon_high",
    "epsilon_low", "generation_config", "generation_kwargs", "importance_sampling_level",
    "log_completions", "log_multimodal", "log_unique_prompts", "loss_type",
    "mask_truncated_completions", "max_completion_length", "max_tool_calling_iterations",
    "min_p", "multi_objective_aggregation", "num_completions_to_print", "num_generations",
    "num_generations_eval", "num_iterations", "off_policy_mask_threshold", "pad_to_multiple_of",
    "ref_model", "repetition_penalty", "reward_func_names", "reward_funcs",
    "reward_processing_classes", "reward_weights", "rollout_func", "router_aux_loss_coef",
    "aux_loss_enabled", "scale_rewards", "shuffle_dataset", "temperature", "tools",
    "top_entropy_quantile", "top_k", "top_p", "use_adaptive_entropy",
    "use_transformers_continuous_batching", "use_vllm", "vllm_gpu_memory_utilization",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_mode",
    "vllm_tensor_parallel_size",
}  # fmt: skip
TRL_METHODS = {
    "compute_loss", "create_model_card", "get_eval_dataloader", "get_gamma_weights",
    "get_high_entropy_mask", "get_off_policy_mask", "get_train_dataloader", "log",
    "prediction_step", "training_step",
}  # fmt: skip
# TRL's vLLM client object, its Hub upload of completions and the event loop of its async
# reward functions: agentgrpo has its own of each (see agentgrpo/training/trl_attributes.py).
NOT_PROVIDED = {"vllm_generation", "commit_scheduler", "async_loop", "async_loop_thread"}
NOT_PROVIDED |= {"async_loop_ready_event"}


def trls_own_attribute_names() -> set[str]:
    """What `self.<name> =` TRL's installed grpo_trainer.py assigns (empty without trl)."""
    spec = importlib.util.find_spec("trl")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return set()
    source = Path(spec.submodule_search_locations[0], "trainer", "grpo_trainer.py").read_text()
    return set(re.findall(r"self\.([a-z]\w*)\s*(?:,[^=]*)?=[^=]", source))


def test_the_trainer_has_every_public_attribute_and_method_of_trls(tokenizer, tmp_path):
    trainer = trainer_for(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools"),
        reward_funcs=one,
        train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
        environment_factory=Counter,
    )
    names = (TRL_ATTRIBUTES | trls_own_attribute_names()) - NOT_PROVIDED
    missing = sorted(name for name in names if not hasattr(trainer, name))
    assert not missing, f"TRL's GRPOTrainer has {missing}"
    assert all(callable(getattr(trainer, name)) for name in TRL_METHODS)


def test_config_fields_trl_copies_onto_the_trainer_read_the_config_and_are_read_only(
    tokenizer, tmp_path
):
    args = config(
        tmp_path,
        beta=0.04,
        epsilon=0.3,
        epsilon_high=0.5,
        loss_type="grpo",
        top_p=0.9,
        num_generations_eval=None,
        max_tool_calling_iterations=None,
    )
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    trainer = trainer_for(tokenizer, args, reward_funcs=one, train_dataset=rows)
    assert (trainer.beta, trainer.loss_type, trainer.top_p) == (0.04, "grpo", 0.9)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.3, 0.5)  # TRL's two names
    assert trainer.num_generations_eval == trainer.num_generations == 2  # None: the same
    assert trainer.max_tool_calling_iterations == sys.maxsize  # None: no limit
    assert trainer.chat_template_kwargs == {} and trainer.continuous_batching_config is None
    assert trainer.chat_template is None  # the tokenizer's own template renders
    assert trainer.entropy_coef == 0.0 and trainer.use_vllm is False
    with pytest.raises(AttributeError, match=r"set GRPOConfig\(beta=\.\.\.\) before"):
        trainer.beta = 0.1
    with pytest.raises(AttributeError, match=r"GRPOConfig\(epsilon=\.\.\.\)"):
        trainer.epsilon_low = 0.1


def test_reward_weights_is_trls_tensor_and_changing_it_changes_the_next_round(tokenizer, tmp_path):
    trainer = trainer_for(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools", reward_weights=[2.0]),
        reward_funcs=one,
        train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
        environment_factory=Counter,
    )
    # TRL's layout: the functions' weights, then 1.0 for the environment that scores itself.
    assert trainer.reward_weights.dtype == torch.float32
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    trainer.reward_weights[1] = 4.0  # in place, as a TRL callback may
    trainer.train()
    assert [record.reward for record in trainer.last_records] == [2.0 * 1 + 4.0 * 0.25] * 4
    trainer.reward_weights = [0.5, 0.5]
    assert trainer.reward_weights.tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"one weight per reward function \['one', 'Counter'\]"):
        trainer.reward_weights = torch.ones(3)


def test_reward_funcs_hold_what_was_given_then_each_environments_get_reward(tokenizer, tmp_path):
    reward_model = tiny_reward_model(tokenizer)
    trainer = trainer_for(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools"),
        reward_funcs=[zero, reward_model],
        reward_processing_classes=[None, tokenizer],
        train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
        environment_factory=Counter,
    )
    given_function, given_model, get_reward = trainer.reward_funcs
    assert given_function is zero and given_model is reward_model
    assert get_reward.__name__ == "get_reward"  # TRL's wrapper of the environment's own
    counter, echo = Counter(), Echo()
    assert get_reward(environments=[counter, echo], prompts=["a", "b"]) == [0.25, None]
    assert len(trainer.reward_funcs) == len(trainer.reward_func_names) == 3


def test_environments_tools_and_eos_ids_take_trls_forms(tokenizer, tmp_path):
    args = config(tmp_path, chat_template="chatml_tools")
    trainer = trainer_for(
        tokenizer,
        args,
        train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
        environment_factory=Counter,
        tools=[shout_tool],
    )
    assert trainer.environment_factories == {None: Counter}
    assert [tool.__name__ for tool in trainer.tools] == ["shout_tool", "increment"]
    assert trainer.environments is None  # before the first round, as in TRL
    assert trainer.eos_token_ids[0] == tokenizer.eos_token_id
    assert trainer.chat_template is not None and "<tool_call>" in trainer.chat_template
    trainer.train()
    assert [type(env) for env in trainer.environments] == [Counter] * 4  # one per completion
    several = trainer_for(
        tokenizer,
        args,
        train_dataset=MIXED_ROWS,
        environment_factory={"counter": Counter, "echo": Echo},
    )
    assert several.environment_factories == {"counter": Counter, "echo": Echo}
    assert sorted(tool.__name__ for tool in several.tools) == ["increment", "shout"]


def shout_tool(text: str) -> str:
    """Shout.

    Args:
        text: What to shout.
    """
    return text.upper()


def test_generation_kwargs_and_generation_config_are_what_transformers_generation_gets(
    tokenizer, tmp_path
):
    args = config(tmp_path, top_k=5, generation_kwargs={"top_k": 20, "no_repeat_ngram_size": 3})
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    trainer = trainer_for(tokenizer, args, reward_funcs=one, train_dataset=rows)
    kwargs = trainer.generation_kwargs
    assert kwargs["max_new_tokens"] == 8 and kwargs["do_sample"] is True
    assert kwargs["top_k"] == 20 and kwargs["no_repeat_ngram_size"] == 3  # generation_kwargs win
    assert kwargs["eos_token_id"] == trainer.eos_token_ids
    assert trainer.generation_config.top_k == 20
    trainer.args.use_vllm = True  # what a vLLM run's trainer reads; TRL has no such attribute
    with pytest.raises(AttributeError, match="with use_vllm=True the vLLM backend generates"):
        trainer.generation_config  # noqa: B018


def test_get_gamma_weights_is_vespos_phi_of_the_sequence_weight():
    # Sequence 0: on-policy (w = 1): phi = 1. Sequence 1: two active tokens with ratio 2 and a
    # sampler correction of 0.5 each: w = (2 * 0.5)**2 = 1 again. Sequence 2: ratio e on its one
    # active token, A < 0: phi = e**3 * exp(2 * (1 - e)) with TRL's (k, lambda) = (3, 2).
    log_ratio = torch.tensor([[0.0, 0.0], [math.log(2.0)] * 2, [1.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    correction = torch.tensor([[1.0, 1.0], [0.5, 0.5], [1.0, 1.0]])
    advantages = torch.tensor([[1.0], [1.0], [-1.0]])
    phi = GRPOTrainer.get_gamma_weights(advantages, log_ratio, mask, correction)
    expected = math.e**3 * math.exp(2 * (1 - math.e))
    assert phi[:, 0].tolist() == pytest.approx([1.0, 1.0, expected])


def test_create_model_card_takes_trls_arguments(tokenizer, tmp_path):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    trainer = trainer_for(tokenizer, config(tmp_path), reward_funcs=one, train_dataset=rows)
    trainer.create_model_card(model_name="tiny-grpo", dataset_name="my/rows", tags="mine")
    card = (tmp_path / "README.md").read_text()
    assert "tiny-grpo" in card and "my/rows" in card
    assert all(tag in card for tag in ("mine", "trl", "grpo", "agentgrpo"))


def test_each_checkpoint_writes_the_model_card_into_the_output_folder_as_trl_does(
    tokenizer, tmp_path
):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    args = config(tmp_path / "my-run", save_strategy="steps", save_steps=1)
    trainer_for(tokenizer, args, reward_funcs=one, train_dataset=rows).train()
    card = (tmp_path / "my-run" / "README.md").read_text()
    assert "my-run" in card and (tmp_path / "my-run" / "checkpoint-1").is_dir()


def test_a_tokenizer_the_trainer_loads_pads_and_truncates_on_the_left_as_trls(
    tokenizer, tiny_model_dir, tmp_path
):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    trainer = GRPOTrainer(
        model=str(tiny_model_dir), args=config(tmp_path), reward_funcs=one, train_dataset=rows
    )
    sides = trainer.processing_class.padding_side, trainer.processing_class.truncation_side
    assert sides == ("left", "left")


def test_transformers_continuous_batching_trains_on_agentgrpos_own_and_says_so(
    tokenizer, tmp_path, caplog
):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    args = config(tmp_path, use_transformers_continuous_batching=True)
    with caplog.at_level(logging.WARNING, logger="agentgrpo.training.porting"):
        trainer = trainer_for(tokenizer, args, reward_funcs=one, train_dataset=rows)
    [note] = [r.message for r in caplog.records if "continuous_batching" in r.message]
    assert note.startswith("use_transformers_continuous_batching=True: agentgrpo's transformers")
    trainer.train()
    assert trainer.state.global_step == 1


# --- Datasets -----------------------------------------------------------------------------


def stream(prompts: list[str]) -> IterableDataset:
    return Dataset.from_dict({"prompt": prompts}).to_iterable_dataset()


def test_an_iterable_eval_set_or_a_dict_of_them_is_evaluated(tokenizer, tmp_path):
    train_rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    args = config(tmp_path, per_device_eval_batch_size=4)
    trainer = trainer_for(
        tokenizer, args, reward_funcs=one, train_dataset=train_rows, eval_dataset=stream(["A", "B"])
    )
    assert trainer.evaluate()["eval_reward"] == 1.0
    seen = []

    def one_noting_prompts(prompts, **kwargs):
        seen.extend(prompts)
        return [1.0] * len(prompts)

    several = {"first": stream(["A", "B"]), "second": stream(["C", "D", "E", "F"])}
    trainer = trainer_for(
        tokenizer,
        args,
        reward_funcs=one_noting_prompts,
        train_dataset=train_rows,
        eval_dataset=several,
    )
    metrics = trainer.evaluate()
    assert {"eval_first_loss", "eval_second_loss"} <= metrics.keys()
    assert sorted(seen) == [p for p in "ABCDEF" for _ in range(2)]  # each row, G times


def test_an_iterable_eval_set_first_given_to_evaluate_is_streamed_without_dispatch(
    tokenizer, tmp_path
):
    train_rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    args = config(tmp_path, per_device_eval_batch_size=4)
    trainer = trainer_for(tokenizer, args, reward_funcs=one, train_dataset=train_rows)
    assert trainer.evaluate(eval_dataset=stream(["A", "B", "C"]))["eval_reward"] == 1.0
    assert trainer.args.accelerator_config.dispatch_batches is False


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_iterable_train_set_is_read_through_its_seeded_shuffle_unless_told_not_to(
    shuffle, tokenizer, tmp_path
):
    # TRL 1.16 reads a stream through `IterableDataset.shuffle(seed=args.seed)` by default.
    prompts = [f"Row {i}" for i in range(200)]
    args = config(tmp_path, max_steps=2, shuffle_dataset=shuffle, seed=3)
    trainer = trainer_for(tokenizer, args, reward_funcs=one, train_dataset=stream(prompts))
    read = [row["prompt"] for row in trainer.train_dataset]
    shuffled = [row["prompt"] for row in stream(prompts).shuffle(seed=3)][: len(read)]
    assert read == (shuffled if shuffle else prompts[: len(read)])
    assert len(read) == 4 and (read != prompts[:4]) == shuffle


def test_iterable_datasets_force_one_worker_and_dispatch_batches_off_and_refuse_it_on(
    tokenizer, tmp_path
):
    args = config(tmp_path, dataloader_num_workers=2)
    trainer_for(tokenizer, args, reward_funcs=one, train_dataset=stream(["A", "B"]))
    assert args.dataloader_num_workers == 0
    assert args.accelerator_config.dispatch_batches is False
    args = config(tmp_path, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        trainer_for(tokenizer, args, reward_funcs=one, train_dataset=stream(["A", "B"]))


# --- Messages TRL's users and tests match on ----------------------------------------------


def test_messages_start_with_trls_words(tokenizer, tmp_path):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_f"):
        trainer_for(tokenizer, config(tmp_path), reward_funcs=one)
    with pytest.raises(
        ValueError,
        match=r"No reward source provided\. Pass `reward_funcs`, or an `environment_factory` "
        "whose environment defines a `get_reward` method",
    ):
        trainer_for(tokenizer, config(tmp_path), train_dataset=rows)
    with pytest.raises(
        ValueError,
        match=r"The number of reward processing classes \(2\) must match the number of reward "
        r"functions \(1\)\.",
    ):
        trainer_for(
            tokenizer,
            config(tmp_path),
            reward_funcs=one,
            reward_processing_classes=[None, None],
            train_dataset=rows,
        )
    with pytest.raises(ValueError, match="`max_steps` must be set to a positive value to define"):
        trainer_for(tokenizer, config(tmp_path, max_steps=-1), environment_factory=Silent)

    def one_reward_too_few(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    trainer = trainer_for(
        tokenizer, config(tmp_path), reward_funcs=one_reward_too_few, train_dataset=rows
    )
    with pytest.raises(ValueError, match="'one_reward_too_few' returned 1 rewards, but 2 were"):
        trainer.train()


def test_completions_no_reward_function_scores_are_logged_with_their_arguments_as_trl_does(
    tokenizer, tmp_path, caplog
):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"], "answer": ["blue", "hi"]})

    def not_applicable(completions, answer, **kwargs):
        return [None] * len(completions)

    trainer = trainer_for(
        tokenizer, config(tmp_path), reward_funcs=not_applicable, train_dataset=rows
    )
    with caplog.at_level(logging.WARNING, logger="agentgrpo"):
        trainer.train()
    [warning] = [r for r in caplog.records if "All reward functions returned None" in r.message]
    assert warning.levelno == logging.WARNING and warning.name == "agentgrpo.rounds.scoring"
    # TRL's text: the row's arguments (its columns, then prompt and completion), then its advice.
    first, arguments, advice = warning.getMessage().split("\n")
    assert first == "All reward functions returned None for the following kwargs:"
    assert arguments.startswith("{'answer': ") and ", 'prompt': '" in arguments
    assert ", 'completion': '" in arguments
    assert advice.startswith(
        "Please ensure that at least one reward function returns a valid reward. (4 of 4"
    )


def test_a_completion_no_reward_function_scores_has_advantage_zero_as_in_trl(tokenizer, tmp_path):
    # Each group is [unscored, 1.0]. TRL 1.16 leaves the unscored one out of the baseline: one
    # scored completion has no spread, so every advantage is 0 and nothing moves. Scoring it 0
    # instead would push the other completion up.
    def every_other(completions, **kwargs):
        return [None if i % 2 == 0 else 1.0 for i in range(len(completions))]

    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    trainer = trainer_for(tokenizer, config(tmp_path), reward_funcs=every_other, train_dataset=rows)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["grad_norm"] == 0.0 and logged["frac_reward_zero_std"] == 0.0
    assert logged["reward"] == 1.0 and logged["reward_std"] == 0.0


@pytest.mark.parametrize("remove", [False, True])
def test_remove_unused_columns_keeps_only_the_prompt_for_the_reward_functions(
    remove, tokenizer, tmp_path
):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"], "answer": ["blue", "hi"]})
    seen = []

    def noting_columns(completions, **kwargs):
        seen.append(kwargs.get("answer"))
        return [1.0] * len(completions)

    args = config(tmp_path, remove_unused_columns=remove)
    trainer = trainer_for(tokenizer, args, reward_funcs=noting_columns, train_dataset=rows)
    trainer.train()
    expected = [None] if remove else [["blue"] * 2, ["hi"] * 2]  # TRL keeps prompt, images
    assert sorted(seen, key=str) == sorted(expected * (2 if remove else 1), key=str)


# --- The Unsloth-style card in the seeds --------------------------------------------------


def bitsandbytes_works() -> bool:
    try:
        check_optimizer("adamw_8bit", torch.device("cpu"))
    except ImportError:
        return False
    return True


def test_the_unsloth_style_card_example_trains_as_written(tokenizer, tmp_path):
    # The card's example; its model is the tiny Llama, and its run is 2 steps of 8-token
    # completions (not 500 of 512), with adamw_torch only where bitsandbytes cannot run.
    model = tiny_llama(tokenizer)
    dataset = Dataset.from_dict({"prompt": ["2 + 2 =", "3 + 3 ="], "ground_truths": ["4", "6"]})
    seen = []

    def reward_fn(responses, ground_truths):
        seen.extend(responses)
        rewards = []
        for resp, gt in zip(responses, ground_truths):  # noqa: B905  # as the card writes it
            # Check if answer matches
            rewards.append(1.0 if gt in resp else 0.0)
        return rewards

    # Configure GRPO training
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        learning_rate=1e-5,
        max_steps=2,
        num_generations=4,  # Generate 4 responses per prompt
        optim="adamw_8bit" if bitsandbytes_works() else "adamw_torch",
        max_completion_length=8,
        use_cpu=True,
        report_to="none",
    )

    # Create trainer
    trainer = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        tokenizer=tokenizer,
        reward_fn=reward_fn,
    )

    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.reward_func_names == ["reward_fn"]
    # `responses` received the completions' text: 2 rounds of 2 prompts x 4 generations.
    completions = [
        tokenizer.decode(r.episode.completion_ids, skip_special_tokens=True)
        for r in trainer.last_records
    ]
    assert len(seen) == 16 and sorted(seen[-8:]) == sorted(completions)
    if bitsandbytes_works():
        assert "bitsandbytes" in type(trainer.optimizer.optimizer).__module__


def test_the_unsloth_style_arguments_fold_into_trls_and_conflicts_are_refused(tokenizer, tmp_path):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    args = config(tmp_path)
    folded = GRPOTrainer(
        tiny_llama(tokenizer),
        zero,
        args,
        rows,
        tokenizer=tokenizer,
        reward_model=tiny_reward_model(tokenizer),
        reward_fn=one,
        reward_processing_classes=[None, tokenizer, None],
        num_generations=2,  # agrees with the config
    )
    assert folded.processing_class is tokenizer
    assert folded.reward_func_names == ["zero", "LlamaForSequenceClassification", "one"]
    with pytest.raises(ValueError, match="pass only processing_class"):
        tiny_trainer(tokenizer, one, args, rows, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"num_generations=4\) differs from the config's"):
        GRPOTrainer(tiny_llama(tokenizer), one, args, rows, tokenizer=tokenizer, num_generations=4)


def test_adamw_8bit_without_bitsandbytes_fails_at_start_up_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what Python does when it is absent
    args = config(tmp_path, optim="adamw_8bit")
    # The model path does not exist: the error comes before any model is loaded.
    with pytest.raises(ImportError, match=r"pip install bitsandbytes.*optim='adamw_torch'"):
        GRPOTrainer(
            str(tmp_path / "no-model-here"), one, args, Dataset.from_dict({"prompt": ["A"]})
        )
