"""GRPOConfig: TRL 1.16's fields and defaults, agentgrpo's additions, and the checks made once."""

import dataclasses
import json
import pickle

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

from agentgrpo.config import LOSS_TYPES, GRPOConfig
from agentgrpo.config import grpo as config_module
from agentgrpo.rounds.wiring import episode_config_of

# (field, default) as TRL 1.16 declares them: a TRL script relies on these.
TRL_DEFAULTS = [
    ("learning_rate", 1e-06),
    ("bf16", None),
    ("gradient_checkpointing", True),
    ("logging_steps", 10),
    ("remove_unused_columns", False),
    ("model_init_kwargs", None),
    ("trust_remote_code", False),
    ("router_aux_loss_coef", None),
    ("disable_dropout", False),
    ("cast_lm_head_to_fp32", False),
    ("num_generations", 8),
    ("num_generations_eval", None),
    ("max_completion_length", 512),
    ("ds3_gather_for_generation", True),
    ("shuffle_dataset", True),
    ("pad_to_multiple_of", "auto"),
    ("generation_batch_size", None),
    ("steps_per_generation", None),
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("top_k", 0),
    ("min_p", None),
    ("generation_kwargs", None),
    ("chat_template_kwargs", None),
    ("repetition_penalty", 1.0),
    ("cache_implementation", None),
    ("use_vllm", False),
    ("vllm_mode", "colocate"),
    ("vllm_model_impl", "vllm"),
    ("vllm_enable_sleep_mode", False),
    ("vllm_structured_outputs_regex", None),
    ("vllm_guided_decoding_regex", None),
    ("vllm_server_base_url", None),
    ("vllm_server_host", "0.0.0.0"),
    ("vllm_server_port", 8000),
    ("vllm_server_timeout", 240.0),
    ("vllm_group_port", 51216),
    ("vllm_gpu_memory_utilization", 0.3),
    ("vllm_max_model_length", None),
    ("vllm_tensor_parallel_size", 1),
    ("beta", 0.0),
    ("num_iterations", 1),
    ("epsilon", 0.2),
    ("delta", None),
    ("epsilon_high", None),
    ("sapo_temperature_neg", 1.05),
    ("sapo_temperature_pos", 1.0),
    ("vespo_k_pos", 2.0),
    ("vespo_lambda_pos", 3.0),
    ("vespo_k_neg", 3.0),
    ("vespo_lambda_neg", 2.0),
    ("importance_sampling_level", "token"),
    ("reward_weights", None),
    ("multi_objective_aggregation", "sum_then_normalize"),
    ("scale_rewards", "group"),
    ("loss_type", "dapo"),
    ("mask_truncated_completions", False),
    ("sync_ref_model", False),
    ("ref_model_mixup_alpha", 0.6),
    ("ref_model_sync_steps", 512),
    ("top_entropy_quantile", 1.0),
    ("entropy_coef", 0.0),
    ("use_adaptive_entropy", False),
    ("entropy_coef_min", 0.0),
    ("entropy_coef_max", 1.0),
    ("entropy_coef_delta", 0.005),
    ("entropy_target", 0.2),
    ("max_tool_calling_iterations", None),
    ("vllm_importance_sampling_correction", True),
    ("vllm_importance_sampling_mode", "sequence_mask"),
    ("vllm_importance_sampling_clip_max", 3.0),
    ("vllm_importance_sampling_clip_min", None),
    ("off_policy_mask_threshold", None),
    ("use_bias_correction_kl", True),
    ("log_completions", False),
    ("log_multimodal", True),
    ("num_completions_to_print", None),
    ("log_unique_prompts", False),
    ("log_completions_hub_repo", None),
    ("use_transformers_continuous_batching", False),
    ("transformers_continuous_batching_config", None),
    ("use_transformers_paged", False),
    ("vllm_importance_sampling_cap", None),
]

AGENTGRPO_DEFAULTS = [
    ("max_turns", None),
    ("padding_free", False),
    ("tool_timeout_s", 30.0),
    ("environment_timeout_s", 120.0),
    ("max_concurrent_episodes", 256),
    ("chat_template", None),
    ("tool_call_parser", None),
    ("mcp_servers", None),
    ("infra_retries", 2),
    ("seat_players", None),
    ("adapter_learning_rates", None),
    ("seat_temperatures", None),
    ("log_episodes", True),
    ("warm_start_steps", 0),
    ("warm_start_learning_rate", 5e-5),
    ("save_warm_start", False),
    # asynchronous GRPO: TRL's AsyncGRPOConfig names and defaults
    ("async_grpo", False),
    ("max_staleness", 4),
    ("vllm_lora_push", "auto"),
    ("queue_maxsize", 1024),
    ("weight_sync_steps", 1),
    # dynamic sampling: off, as TRL trains on every group
    ("dynamic_sampling", False),
    ("max_resample_rounds", 3),
    # curriculum: off, as TRL plays every row once an epoch in the sampler's order
    ("curriculum", False),
    ("curriculum_floor", 0.05),
    ("curriculum_pass_reward", 1.0),
    # long episodes: no compaction, the episode ends at the limit as in TRL
    ("max_context", None),
    ("context_policy", None),
    ("context_threshold", 0.75),
    ("context_keep_last", 2),
    ("context_summary_prompt", None),
    ("context_summary_tokens", 256),
    # credit per turn: the episode's advantage on every token, as TRL
    ("turn_advantage", "episode"),
    ("turn_discount", 1.0),
]

DECLARED = {f.name: f for f in dataclasses.fields(GRPOConfig)}


@pytest.fixture
def make(tmp_path):
    def make(**kwargs) -> GRPOConfig:
        return GRPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)

    return make


@pytest.fixture
def world_size(monkeypatch):
    """Pretend to run on `n` processes."""

    def set_world_size(n: int) -> None:
        monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: n))

    return set_world_size


# --- Fields and defaults -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "default"), TRL_DEFAULTS + AGENTGRPO_DEFAULTS)
def test_each_field_declares_the_default_trl_1_16_declares(name, default):
    declared = DECLARED[name].default
    assert declared == default
    assert type(declared) is type(default)


def test_every_grpo_field_is_documented_where_it_is_defined():
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [name for name, _ in TRL_DEFAULTS + AGENTGRPO_DEFAULTS]
    assert set(own) | base == set(DECLARED)
    for name in own:
        assert DECLARED[name].metadata.get("help"), name


def test_a_default_config_resolves_what_trl_leaves_open(make):
    config = make()
    assert config.learning_rate == 1e-6
    assert config.gradient_checkpointing is True
    assert config.remove_unused_columns is False
    assert config.steps_per_generation == config.gradient_accumulation_steps == 1
    assert config.generation_batch_size == config.per_device_train_batch_size == 8
    assert config.epsilon_high == config.epsilon == 0.2
    assert config.pad_to_multiple_of is None


def test_gradient_checkpointing_is_non_reentrant_unless_asked_otherwise(make):
    assert make().gradient_checkpointing_kwargs == {"use_reentrant": False}
    reentrant = {"use_reentrant": True, "every_n_layers": 2}
    assert make(gradient_checkpointing_kwargs=reentrant).gradient_checkpointing_kwargs == reentrant
    assert make(gradient_checkpointing=False).gradient_checkpointing_kwargs is None


# --- bf16 ------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only resolution")
def test_bf16_resolves_to_false_on_a_machine_without_a_cuda_gpu(make):
    assert make().bf16 is False


def test_bf16_defaults_on_where_cuda_supports_it_and_off_on_cpu(monkeypatch):
    monkeypatch.setattr(config_module, "_cuda_bf16_available", lambda: True)
    assert config_module.default_bf16(fp16=False, use_cpu=False) is True
    assert config_module.default_bf16(fp16=True, use_cpu=False) is False
    assert config_module.default_bf16(fp16=False, use_cpu=True) is False


@pytest.mark.parametrize(("launched", "bf16"), [("bf16", True), ("fp16", False), ("no", False)])
def test_bf16_follows_the_mixed_precision_an_accelerate_launch_asked_for(
    make, monkeypatch, launched, bf16
):
    # Under a DeepSpeed config with bf16 enabled, bf16=False stopped the run before training.
    monkeypatch.setattr(config_module, "_cuda_bf16_available", lambda: False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    assert make(use_cpu=True).bf16 is bf16
    assert make(use_cpu=True, bf16=not bf16).bf16 is not bf16  # an explicit value is kept


def test_use_cpu_keeps_float32_even_on_a_machine_with_a_bf16_gpu(make, monkeypatch):
    monkeypatch.setattr(config_module, "_cuda_bf16_available", lambda: True)
    assert make(use_cpu=True).bf16 is False


def test_an_explicit_bf16_is_kept(make):
    assert make(bf16=False).bf16 is False
    assert make(bf16=True, use_cpu=True).bf16 is True


# --- Batch arithmetic -------------------------------------------------------------------------


# Columns: per-device batch, gradient accumulation, steps_per_generation, generation_batch_size,
# num_generations, world size; then the resolved steps_per_generation and generation batch.
BATCH_CASES = [
    (4, 1, None, None, 4, 1, 1, 4),
    (4, 3, None, None, 6, 1, 3, 12),
    (2, 1, 4, None, 8, 1, 4, 8),
    (4, 1, None, 32, 8, 1, 8, 32),
    (2, 2, None, None, 4, 2, 2, 8),
    (3, 1, None, 24, 4, 2, 4, 24),
]


@pytest.mark.parametrize(
    ("batch", "accum", "spg", "gbs", "group", "world", "steps", "total"), BATCH_CASES
)
def test_steps_per_generation_and_generation_batch_size_determine_each_other(
    make, world_size, batch, accum, spg, gbs, group, world, steps, total
):
    world_size(world)
    config = make(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        steps_per_generation=spg,
        generation_batch_size=gbs,
        num_generations=group,
    )
    assert (config.steps_per_generation, config.generation_batch_size) == (steps, total)


def test_setting_both_generation_batch_size_and_steps_per_generation_is_an_error(make):
    with pytest.raises(ValueError, match="set only one of them"):
        make(generation_batch_size=16, steps_per_generation=2)


def test_a_generation_batch_size_must_be_a_multiple_of_the_global_batch(make, world_size):
    world_size(2)
    with pytest.raises(
        ValueError,
        match=r"generation_batch_size \(12\) must be divisible by the global batch size \(8\)",
    ):
        make(per_device_train_batch_size=4, generation_batch_size=12, num_generations=4)


def test_a_generation_batch_that_splits_a_group_is_an_error_that_says_what_to_choose(make):
    with pytest.raises(ValueError) as error:
        make(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=8)
    message = str(error.value)
    assert message.startswith(
        "generation_batch_size (12) must be divisible by num_generations (8)."
    )
    assert (
        "gradient_accumulation_steps" in message and "choose per_device_train_batch_size" in message
    )


def test_an_eval_batch_that_splits_a_group_is_an_error_when_evaluating(make):
    with pytest.raises(
        ValueError,
        match=r"global eval batch size \(6 \* 1\) must be divisible by the number of "
        r"generations used for evaluation \(4\)",
    ):
        make(eval_strategy="steps", per_device_eval_batch_size=6, num_generations_eval=4)
    with pytest.raises(ValueError, match=r"used for evaluation \(8\)"):
        make(eval_strategy="steps", per_device_eval_batch_size=6)
    assert make(eval_strategy="steps", per_device_eval_batch_size=6, num_generations_eval=3)
    assert make(per_device_eval_batch_size=6, num_generations_eval=4)  # no evaluation


# --- Normalized values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "resolved"),
    [(True, "group"), (False, "none"), ("true", "group"), ("batch", "batch"), ("none", "none")],
)
def test_scale_rewards_booleans_mean_group_and_none(make, given, resolved):
    assert make(scale_rewards=given).scale_rewards == resolved


def test_epsilon_high_defaults_to_epsilon_and_keeps_a_given_value(make):
    assert make(epsilon=0.1).epsilon_high == 0.1
    assert make(epsilon=0.1, epsilon_high=0.28).epsilon_high == 0.28


def test_the_deprecated_importance_sampling_cap_sets_clip_max_with_a_warning(make):
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_clip_max"):
        config = make(vllm_importance_sampling_cap=2.0)
    assert config.vllm_importance_sampling_clip_max == 2.0


def test_pad_to_multiple_of_accepts_command_line_text(make):
    assert make(pad_to_multiple_of="64").pad_to_multiple_of == 64
    assert make(pad_to_multiple_of="None").pad_to_multiple_of is None
    assert make(pad_to_multiple_of=16).pad_to_multiple_of == 16


def test_every_trl_loss_type_is_accepted(make):
    for loss_type in LOSS_TYPES:
        assert make(loss_type=loss_type).loss_type == loss_type


# --- Validation errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(scale_rewards="std"), "scale_rewards='std' is not one of 'group', 'batch', 'none'"),
        (dict(loss_type="ppo"), "loss_type='ppo' is not one of 'grpo', 'dr_grpo'"),
        (dict(importance_sampling_level="group"), "importance_sampling_level='group'"),
        (dict(vllm_mode="remote"), "vllm_mode='remote' is not one of 'colocate', 'server'"),
        (dict(vllm_model_impl="hf"), "vllm_model_impl='hf'"),
        (dict(vllm_importance_sampling_mode="clip"), "vllm_importance_sampling_mode='clip'"),
        (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation='mean'"),
        (dict(num_generations=1), "GRPO requires at least 2 generations per prompt"),
        (dict(num_generations=None), "set num_generations >= 2"),
        (dict(num_generations_eval=0), "num_generations_eval=0 must be at least 1"),
        (dict(max_completion_length=0), "max_completion_length=0 must be at least 1"),
        (dict(max_completion_length=None), "every episode needs a budget of completion tokens"),
        (dict(top_entropy_quantile=1.5), r"top_entropy_quantile=1.5 must be in \[0, 1\]"),
        (dict(top_entropy_quantile=-0.1), "top_entropy_quantile=-0.1"),
        (dict(max_tool_calling_iterations=-1), "max_tool_calling_iterations=-1 must be >= 0"),
        (dict(max_turns=0), "max_turns=0 must be at least 1"),
        (dict(tool_timeout_s=0.0), "tool_timeout_s=0.0 must be positive"),
        (dict(environment_timeout_s=-1.0), "environment_timeout_s=-1.0 must be positive"),
        (dict(max_concurrent_episodes=0), "max_concurrent_episodes=0 must be at least 1"),
        (dict(infra_retries=-1), r"infra_retries=-1 must be 0 \(an infrastructure failure"),
        (dict(save_warm_start=True), "warm_start_steps=0 runs no warm start"),
        (dict(sync_ref_model=True), "set beta > 0 or sync_ref_model=False"),
        (dict(log_completions_hub_repo="me/completions"), "but log_completions is False"),
        (dict(auto_find_batch_size=True), "auto_find_batch_size is not supported by GRPO"),
        (
            dict(vllm_importance_sampling_clip_min=3.0),
            r"clip_min \(3.0\) must be less than vllm_importance_sampling_clip_max \(3.0\)",
        ),
        (
            dict(
                vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_max=None,
            ),
            "At least one of `vllm_importance_sampling_clip_min` or",
        ),
    ],
)
def test_a_value_that_cannot_work_is_a_value_error_that_says_what_to_fix(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(learning_rate=INF), r"learning_rate=inf is infinite .*1e400"),
        (dict(learning_rate=float("1e400")), "learning_rate=inf is infinite"),
        (dict(beta=NAN), "beta=nan is not a number; give a finite value"),
        (dict(temperature=-INF), "temperature=-inf is infinite"),
        (dict(epsilon=NAN), "epsilon=nan is not a number"),
        (dict(max_grad_norm=INF), "max_grad_norm=inf is infinite"),
        (dict(reward_weights=[1.0, NAN]), "reward_weights=nan is not a number"),
        (dict(tool_timeout_s=INF), "tool_timeout_s=inf is infinite .* or None for no limit"),
        (dict(learning_rate=-1e-6), "learning_rate=-1e-06 is negative; it must be >= 0"),
        (dict(beta=-0.1), "beta=-0.1 is negative"),
        (dict(temperature=-1.0), "temperature=-1.0 is negative"),
    ],
)
def test_nan_infinity_and_negative_rates_are_refused_naming_the_field(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_a_generation_batch_too_large_to_hold_is_refused_before_anything_is_allocated(make):
    with pytest.raises(ValueError, match=r"num_generations=1000000000000 is above 65536"):
        make(num_generations=10**12, per_device_train_batch_size=10**12)
    with pytest.raises(ValueError, match=r"generation batch of 131072 episodes .* above 65536"):
        make(per_device_train_batch_size=2**16, gradient_accumulation_steps=2, num_generations=2)
    assert make(per_device_train_batch_size=2**16, num_generations=2**16).generation_batch_size


def test_use_transformers_paged_is_trls_deprecated_name_of_continuous_batching(make):
    with pytest.warns(FutureWarning, match="`use_transformers_paged` is deprecated"):
        config = make(use_transformers_paged=True)
    assert config.use_transformers_continuous_batching is True


def test_sync_ref_model_is_accepted_with_a_kl_penalty(make):
    assert make(sync_ref_model=True, beta=0.04).sync_ref_model is True


def test_tool_call_parser_and_chat_template_names_are_checked_by_rollout(make):
    assert make(tool_call_parser="hermes", chat_template="chatml_tools").chat_template
    assert make(chat_template="{{ messages }}").chat_template == "{{ messages }}"
    with pytest.raises(ValueError, match="unknown tool_call_parser 'xml'"):
        make(tool_call_parser="xml")
    with pytest.raises(ValueError, match="neither a built-in template"):
        make(chat_template="chatml")


# --- Unknown keywords -------------------------------------------------------------------------


def test_a_mistyped_keyword_names_the_nearest_field(make):
    suggestion = "unknown argument 'lerning_rate'; did you mean 'learning_rate'"
    with pytest.raises(TypeError, match=suggestion):
        make(lerning_rate=1e-5)
    with pytest.raises(TypeError, match="'num_generation'; did you mean 'num_generations'"):
        make(num_generation=4)


def test_an_unrecognisable_keyword_is_still_a_type_error(make):
    with pytest.raises(TypeError, match=r"unknown argument 'zzz'\.$"):
        make(zzz=1)


# --- Episode turns ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "turns"),
    [
        (dict(max_turns=3), 3),
        (dict(max_turns=3, max_tool_calling_iterations=9), 3),
        (dict(max_tool_calling_iterations=4), 5),
        (dict(max_tool_calling_iterations=0), 1),
        (dict(), 512),
        (dict(max_completion_length=64), 64),
    ],
)
def test_episode_max_turns_resolves_max_turns_then_tool_iterations_then_the_token_budget(
    make, kwargs, turns
):
    assert make(**kwargs).episode_max_turns == turns


@pytest.mark.parametrize(("iterations", "turns"), [(None, 3), (0, 3), (2, 3)])
def test_episodes_run_at_most_max_tool_calling_iterations_turns_of_calls(make, iterations, turns):
    episodes = episode_config_of(make(max_turns=3, max_tool_calling_iterations=iterations))
    assert (episodes.max_turns, episodes.max_tool_rounds) == (turns, iterations)


# --- Command line and saving ------------------------------------------------------------------


def test_the_command_line_parses_into_a_checked_config(tmp_path):
    parser = HfArgumentParser(GRPOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir", str(tmp_path), "--report_to", "none",
            "--learning_rate", "3e-6", "--loss_type", "grpo", "--scale_rewards", "none",
            "--reward_weights", "1.0", "0.5", "--model_init_kwargs", '{"dtype": "float32"}',
            "--per_device_train_batch_size", "4", "--num_generations", "4",
            "--max_turns", "6", "--tool_timeout_s", "2.5", "--chat_template", "chatml_tools",
            "--pad_to_multiple_of", "8",
        ]
    )  # fmt: skip
    assert config.learning_rate == 3e-6
    assert (config.loss_type, config.scale_rewards) == ("grpo", "none")
    assert config.reward_weights == [1.0, 0.5]
    assert config.model_init_kwargs == {"dtype": "float32"}
    assert (config.max_turns, config.tool_timeout_s) == (6, 2.5)
    assert config.chat_template == "chatml_tools"
    assert config.pad_to_multiple_of == 8
    assert config.generation_batch_size == 4
    assert "--max_concurrent_episodes" in parser.format_help()


def test_the_command_line_rejects_an_unknown_flag(tmp_path):
    parser = HfArgumentParser(GRPOConfig)
    with pytest.raises(ValueError, match="--lerning_rate"):
        parser.parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--lerning_rate", "1e-5"]
        )


def test_a_config_serializes_to_json_and_pickles(make):
    config = make(max_turns=4, reward_weights=[1.0, 2.0])
    saved = json.loads(config.to_json_string())
    assert saved["max_turns"] == 4
    assert saved["generation_batch_size"] == 8
    assert saved["epsilon_high"] == 0.2
    assert pickle.loads(pickle.dumps(config)).to_dict() == config.to_dict()
