"""What scripts written for TRL's GRPOTrainer (and an Unsloth-style card) rely on, beyond the docs.

Each test is one behaviour of TRL 1.16's code that agentgrpo matches: several environments
chosen per row, environments that own their data, reward weights, the trainer's public
attributes and helpers, iterable datasets, the phrases of TRL's messages, and the argument
spellings of the Unsloth-style usage card in the seeds. Behaviours that are runs are short real
runs of GRPOTrainer on the tiny random Llama.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from datasets import Dataset, IterableDataset
from tiny_model import tiny_llama
from transformers import LlamaConfig, LlamaForSequenceClassification

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.porting import check_optimizer


def config(tmp_path, **changes) -> GRPOConfig:
    """One optimizer step of 4 completions (2 prompts x 2 generations), 8 tokens each."""
    fields = {
        "output_dir": str(tmp_path),
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 8,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
    }
    return GRPOConfig(**(fields | changes))


def trainer_for(tokenizer, args, **arguments) -> GRPOTrainer:
    return GRPOTrainer(
        model=tiny_llama(tokenizer), args=args, processing_class=tokenizer, **arguments
    )


def conversation(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def zero(completions, **kwargs):
    return [0.0] * len(completions)


# --- Environments and tools ---------------------------------------------------------------


class Counter:
    """Counts; scores itself 0.25. Remembers what reset received."""

    def reset(self, **kwargs) -> None:
        self.reset_with, self.counter = kwargs, 0

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: The value to add.
        """
        self.counter += step
        return self.counter

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
    with pytest.raises(ValueError, match="environment='ech', which is not among the environments"):
        trainer_for(tokenizer, args, train_dataset=unknown, environment_factory=factories)
    with pytest.raises(ValueError, match="requires a `train_dataset` with an 'environment' column"):
        trainer_for(tokenizer, args, environment_factory=factories)
    no_column = MIXED_ROWS.remove_columns("environment")
    with pytest.raises(ValueError, match="requires a `train_dataset` with an 'environment' column"):
        trainer_for(tokenizer, args, train_dataset=no_column, environment_factory=factories)


class Silent:
    """States no task (reset returns None) and scores itself: TRL's environment-owned data."""

    def reset(self, **kwargs) -> None:
        self.counter = 0

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: The value to add.
        """
        self.counter += step
        return self.counter

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
    with pytest.raises(ValueError, match="the number of reward weights must match"):
        trainer_for(
            tokenizer,
            config(tmp_path, chat_template="chatml_tools", reward_weights=[1.0, 1.0, 1.0]),
            reward_funcs=one,
            train_dataset=Dataset.from_dict({"prompt": [conversation("Count.")] * 2}),
            environment_factory=Counter,
        )


def tiny_reward_model(tokenizer) -> LlamaForSequenceClassification:
    torch.manual_seed(0)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForSequenceClassification(model_config).eval()


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


def test_messages_contain_trls_key_phrases_and_unscored_rows_are_logged(
    tokenizer, tmp_path, caplog
):
    rows = Dataset.from_dict({"prompt": ["The sky is", "Hello"]})
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        trainer_for(tokenizer, config(tmp_path), reward_funcs=one)
    with pytest.raises(ValueError, match="No reward source provided"):
        trainer_for(tokenizer, config(tmp_path), train_dataset=rows)
    with pytest.raises(ValueError, match="must match"):
        trainer_for(
            tokenizer,
            config(tmp_path),
            reward_funcs=one,
            reward_processing_classes=[None, None],
            train_dataset=rows,
        )

    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    trainer = trainer_for(
        tokenizer, config(tmp_path), reward_funcs=not_applicable, train_dataset=rows
    )
    with caplog.at_level(logging.WARNING, logger="agentgrpo"):
        trainer.train()
    [warning] = [r for r in caplog.records if "All reward functions returned None" in r.message]
    assert warning.levelno == logging.WARNING and warning.name == "agentgrpo.rounds"


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
        GRPOTrainer(
            tiny_llama(tokenizer), one, args, rows, processing_class=tokenizer, tokenizer=tokenizer
        )
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
