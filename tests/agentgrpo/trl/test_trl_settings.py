"""Settings TRL 1.16 accepts, honoured as TRL's code does: one section per setting.

Pure functions are checked against numbers worked out by hand (the arithmetic is in the
comments); each setting that changes training also runs a short real GRPOTrainer on the tiny model.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import BitsAndBytesConfig, Gemma2Config, Gemma2ForCausalLM

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.learner.entropy_control import AdaptiveEntropy, next_entropy_coef
from agentgrpo.learner.losses import LossConfig, aggregate, policy_loss
from agentgrpo.learner.objectives import VespoShape, cispo_loss, vespo_loss, vespo_weights
from agentgrpo.models.loading import cast_lm_head_to_fp32, policy_init_kwargs
from agentgrpo.training.porting import loss_setting_warnings
from tests.support.tiny_model import special_ids, tiny_llama, tiny_model
from tests.support.trainer import logged, rank_in_call, short_run_config, tiny_trainer

PROMPTS = Dataset.from_dict({"prompt": ["The sky is", "Hello", "One two", "A B C"] * 10})
POSITIVE, NEGATIVE = VespoShape(k=2.0, lam=3.0), VespoShape(k=3.0, lam=2.0)  # TRL's defaults


def config(tmp_path, **overrides) -> GRPOConfig:
    """The short run with completions of up to 6 tokens from the 10 likeliest, no episode log."""
    fields = dict(max_completion_length=6, top_k=10, log_episodes=False)
    return short_run_config(tmp_path, **(fields | overrides))


# --------------------------------------------------------------------------- 1. vespo, cispo


def test_vespo_weights_a_positive_advantage_sequence_by_the_gamma_kernel():
    # Two active tokens with log-ratios 0.1 and 0.2 (the padding's 9.0 is ignored):
    #   log w = 0.1 + 0.2 = 0.3 (a sum over tokens, not a mean), w = e^0.3 = 1.3498588
    #   A >= 0 -> k = 2, lam = 3: log phi = lam + k log w - lam w
    #                                     = 3 + 0.6 - 4.0495764 = -0.4495764
    #   phi = e^-0.4495764 = 0.6378983
    log_ratio = torch.tensor([[0.1, 0.2, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    phi = vespo_weights(log_ratio, torch.tensor([[1.0]]), mask, POSITIVE, NEGATIVE)
    assert phi.item() == pytest.approx(0.6378983, abs=1e-6)


def test_vespo_uses_the_negative_shape_for_a_negative_advantage():
    # log w = -0.1 - 0.1 = -0.2, w = e^-0.2 = 0.8187308
    # A < 0 -> k = 3, lam = 2: log phi = 2 + 3 * (-0.2) - 2 * 0.8187308 = -0.2374615
    # phi = e^-0.2374615 = 0.7886272
    phi = vespo_weights(
        torch.tensor([[-0.1, -0.1]]), torch.tensor([[-1.0]]), torch.ones(1, 2), POSITIVE, NEGATIVE
    )
    assert phi.item() == pytest.approx(0.7886272, abs=1e-6)


def test_vespo_weight_is_one_on_policy_and_peaks_at_k_over_lambda():
    # phi(1) = e^(lam + 0 - lam) = 1. The peak of w^k e^(-lam w) is at w = k / lam = 2/3:
    # phi(2/3) = e^(3 + 2 ln(2/3) - 2) = e * 4/9 = 1.2081253.
    on_policy = vespo_weights(
        torch.zeros(1, 3), torch.ones(1, 1), torch.ones(1, 3), POSITIVE, NEGATIVE
    )
    peak = vespo_weights(
        torch.tensor([[math.log(2 / 3)]]), torch.ones(1, 1), torch.ones(1, 1), POSITIVE, NEGATIVE
    )
    assert on_policy.item() == pytest.approx(1.0)
    assert peak.item() == pytest.approx(math.e * 4 / 9, abs=1e-6)


def test_vespo_loss_is_minus_detached_weight_times_advantage_times_logprob():
    # phi = 0.6378983 (first test), A = 2: loss_t = -phi * A * logprob_t
    #   token 1: -0.6378983 * 2 * (-1.0) = 1.2757966;  token 2: -0.6378983 * 2 * (-0.5) = 0.6378983
    # gradient d loss_t / d logprob_t = -phi * A = -1.2757966 (phi is detached).
    logprobs = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    old = logprobs.detach() - torch.tensor([[0.1, 0.2]])  # log-ratios 0.1 and 0.2
    term = vespo_loss(logprobs - old, torch.tensor([[2.0]]), logprobs, torch.ones(1, 2))
    assert term.loss_B_T[0].tolist() == pytest.approx([1.2757966, 0.6378983], abs=1e-6)
    term.loss_B_T.sum().backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-1.2757966, -1.2757966], abs=1e-6)


def test_vespo_divides_the_token_sum_by_num_items_like_dapo():
    # On-policy (phi = 1), A = 1, logprobs -1 and -3 over 2 active tokens of a 4-token batch:
    # per-token losses 1 and 3, sum 4, / num_items 4 = 1.0.
    logprobs = torch.tensor([[-1.0, -3.0, 0.0]])
    out = policy_loss(
        logprobs,
        logprobs,
        torch.tensor([1.0]),
        torch.tensor([[1, 1, 0]]),
        LossConfig(loss_type="vespo"),
        num_items=4,
    )
    assert out.loss.item() == pytest.approx(1.0)
    per_token = torch.tensor([[1.0, 3.0, 7.0]])
    assert aggregate(per_token, torch.tensor([[1, 1, 0]]), "vespo", num_items=4).item() == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"vespo_positive": VespoShape(-1.0, 3.0)}, "vespo_k_pos >= 0"),
        ({"vespo_negative": VespoShape(3.0, 0.0)}, "vespo_lambda_neg > 0"),
        ({"delta": 2.0}, "delta applies"),
    ],
)
def test_vespo_settings_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(loss_type="vespo", **fields)


def test_vespo_warns_on_sequence_level_and_refuses_sequence_sampler_corrections(tmp_path):
    [warning] = loss_setting_warnings("vespo", "sequence")
    assert warning.startswith("VESPO computes sequence-level importance weights internally.")
    with pytest.raises(ValueError, match="'token_truncate' or 'token_mask'"):
        config(tmp_path, loss_type="vespo", use_vllm=True)  # default mode: sequence_mask


def test_cispo_with_the_default_epsilon_high_caps_the_weight_at_epsilon_as_trl_does(tmp_path):
    # TRL: epsilon_high defaults to epsilon = 0.2, and cispo clamps the ratio at it:
    # on-policy r = 1 -> weight min(1, 0.2) = 0.2; loss = -0.2 * A * logprob
    #   = -0.2 * 1.5 * (-2.0) = 0.6.
    args = config(tmp_path, loss_type="cispo")
    assert args.epsilon_high == 0.2
    with pytest.warns(UserWarning, match="below 1"):
        LossConfig(loss_type="cispo", epsilon_high=args.epsilon_high)
    logprobs = torch.tensor([[-2.0]])
    term = cispo_loss(torch.zeros(1, 1), torch.tensor([[1.5]]), logprobs, args.epsilon_high)
    assert term.loss_B_T.item() == pytest.approx(0.6)


def test_a_real_run_trains_with_vespo_and_with_default_cispo(tokenizer, tmp_path):
    for loss_type in ("vespo", "cispo"):
        args = config(tmp_path / loss_type, loss_type=loss_type, num_iterations=2)
        model = tiny_llama(tokenizer)
        before = model.lm_head.weight.detach().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # cispo's cap below 1
            trainer = GRPOTrainer(model, rank_in_call, args, PROMPTS, processing_class=tokenizer)
        trainer.train()
        assert trainer.state.global_step == 2
        assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
        assert not torch.equal(trainer.model.lm_head.weight, before), loss_type


# --------------------------------------------------------------------------- 2. adaptive entropy


def test_the_coefficient_steps_toward_the_target_within_its_bounds():
    # entropy 0.1 <= target 0.2: 0.01 + 0.005 = 0.015;  with max 0.012: min(0.015, 0.012)
    # entropy 0.3 > target: 0.01 - 0.005 = 0.005;  from 0.002: max(-0.003, 0.0) = 0.0
    assert next_entropy_coef(0.01, 0.1, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)
    assert next_entropy_coef(0.01, 0.1, 0.2, 0.005, 0.0, 0.012) == 0.012
    assert next_entropy_coef(0.01, 0.3, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.005)
    assert next_entropy_coef(0.002, 0.3, 0.2, 0.005, 0.0, 1.0) == 0.0
    assert next_entropy_coef(0.01, 0.2, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)  # at target


def test_the_controller_measures_the_whole_window_token_weighted():
    # Two micro-batches: entropy sums 0.3 over 2 tokens and 0.3 over 4 tokens.
    # Window mean: 0.6 / 6 = 0.1 <= target 0.11 -> coef 0.05 + 0.01 = 0.06.
    # (The mean of micro-batch means, (0.15 + 0.075) / 2 = 0.1125 > 0.11, would lower it.)
    control = AdaptiveEntropy(coef=0.05, target=0.11, delta=0.01, coef_min=0.0, coef_max=1.0)
    assert control.applied_coef == 0.0  # nothing measured yet: no bonus
    control.observe(0.3, 2)
    control.observe(0.3, 4)
    control.end_step(control.window_sum, control.window_tokens)
    assert control.last_entropy == pytest.approx(0.1)
    assert control.coef == pytest.approx(0.06)
    assert control.applied_coef == pytest.approx(0.06)  # entropy at or below target: applied
    assert (control.window_sum, control.window_tokens) == (0.0, 0.0)


def test_adaptive_entropy_updates_once_per_optimizer_step_under_accumulation(tokenizer, tmp_path):
    # The tiny random model's entropy is about ln(49152) = 10.8 nats: below a target of 100,
    # so the coefficient rises by delta at each of the 3 optimizer steps (6 micro-batches):
    # 0.0 -> 0.005 -> 0.010 -> 0.015. An update per micro-batch would reach 0.03.
    args = config(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        use_adaptive_entropy=True,
        entropy_coef=0.0,
        entropy_coef_delta=0.005,
        entropy_target=100.0,
    )
    trainer = tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)
    trainer.train()
    assert logged(trainer, "entropy_coef") == pytest.approx([0.005, 0.010, 0.015])
    assert trainer.entropy_control.coef == pytest.approx(0.015)
    assert trainer.entropy_coef == pytest.approx(0.015)  # TRL's attribute: the current one
    assert 5.0 < trainer.entropy_control.last_entropy < 100.0


def test_adaptive_entropy_state_is_saved_with_each_checkpoint(tokenizer, tmp_path):
    args = config(
        tmp_path, max_steps=1, save_strategy="steps", save_steps=1, use_adaptive_entropy=True
    )
    trainer = tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)
    trainer.train()
    state = json.loads((tmp_path / "checkpoint-1" / "entropy_ctrl_state.json").read_text())
    # entropy (about 10.8) > default target 0.2: coef max(0.0 - 0.005, 0.0) = 0.0
    assert state["entropy_coef"] == 0.0 and state["last_world_entropy"] > 0.2


# --------------------------------------------------------------------------- 3. fp32 lm_head


def tiny_gemma2(tokenizer) -> Gemma2ForCausalLM:
    """A 2-layer Gemma 2 (hidden 64) whose lm_head is tied to its embeddings, as Gemma's is."""
    model = tiny_model(
        Gemma2ForCausalLM, Gemma2Config, len(tokenizer), head_dim=16, **special_ids(tokenizer)
    )
    assert model.config.tie_word_embeddings
    return model.eval()


def test_a_tied_bf16_lm_head_is_cast_to_fp32_and_stays_tied(tokenizer):
    model = tiny_gemma2(tokenizer).to(torch.bfloat16)
    cast_lm_head_to_fp32(model)
    embeddings = model.get_input_embeddings()
    assert model.lm_head.weight is embeddings.weight  # still one shared weight
    assert model.lm_head.weight.dtype == torch.float32
    ids = torch.tensor([[1, 2, 3]])
    assert embeddings(ids).dtype == torch.bfloat16  # the body still runs in bf16
    assert model(ids).logits.dtype == torch.float32


def test_the_float32_head_stays_float32_under_bf16_autocast_and_in_copies(tokenizer):
    # Autocast would compute the head's matmul in bfloat16 again; a copy (the reference model,
    # the asynchronous generator's) computes with its own weight.
    model = tiny_gemma2(tokenizer).to(torch.bfloat16)
    cast_lm_head_to_fp32(model)
    ids = torch.tensor([[1, 2, 3]])
    hidden = model.model(ids).last_hidden_state
    expected = hidden.float() @ model.lm_head.weight.T  # float32, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.lm_head(hidden)
    assert logits.dtype == torch.float32 and torch.equal(logits, expected)
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        copy_.lm_head.weight.zero_()
    assert torch.equal(copy_.lm_head(hidden), torch.zeros_like(expected))
    assert torch.equal(model.lm_head(hidden), expected)


def test_a_tied_gemma2_trains_with_cast_lm_head_to_fp32(tokenizer, tmp_path):
    args = config(tmp_path, cast_lm_head_to_fp32=True, max_steps=1)
    trainer = GRPOTrainer(
        tiny_gemma2(tokenizer), rank_in_call, args, PROMPTS, processing_class=tokenizer
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.model.lm_head.weight.dtype == torch.float32
    assert trainer.model.lm_head.weight is trainer.model.get_input_embeddings().weight


# --------------------------------------------------------------------------- 4. short eval sets


def evaluate_recording(tokenizer, tmp_path, eval_set, reward: float, **fields):
    """`trainer.evaluate()` on `eval_set`, a constant reward: the prompts scored, the metrics."""
    seen: list[str] = []

    def record_prompts(prompts, **kwargs):
        seen.extend(prompts)
        return [reward] * len(prompts)

    args = config(tmp_path, **fields)
    trainer = tiny_trainer(tokenizer, record_prompts, args, PROMPTS, eval_dataset=eval_set)
    return seen, trainer.evaluate()


@pytest.mark.parametrize("eval_rows", [3, 5])
def test_every_eval_row_is_played_when_the_set_is_not_a_whole_number_of_batches(
    tokenizer, tmp_path, eval_rows
):
    # per_device_eval_batch_size 8 / num_generations_eval 2 = 4 prompts a batch:
    # 3 rows are one short batch; 5 rows are a batch of 4 and a short one of 1.
    eval_set = Dataset.from_dict({"prompt": [f"Question {i}" for i in range(eval_rows)]})
    batches = dict(per_device_eval_batch_size=8, num_generations_eval=2)
    seen, metrics = evaluate_recording(tokenizer, tmp_path, eval_set, 0.0, **batches)
    assert sorted(seen) == sorted(list(eval_set["prompt"]) * 2)  # every row, 2 episodes each
    assert "eval_loss" in metrics


def test_num_generations_eval_1_evaluates_one_episode_per_row(tokenizer, tmp_path):
    # TRL accepts groups of one in evaluation; their advantages are 0 (test_advantages.py).
    eval_set = Dataset.from_dict({"prompt": ["Question 0", "Question 1", "Question 2"]})
    batches = dict(per_device_eval_batch_size=2, num_generations_eval=1)
    seen, metrics = evaluate_recording(tokenizer, tmp_path, eval_set, 0.5, **batches)
    assert sorted(seen) == ["Question 0", "Question 1", "Question 2"]  # one episode each
    assert metrics["eval_reward"] == 0.5


# --------------------------------------------------------------------------- 5. trust_remote_code

REMOTE_CODE = """
from transformers import (
    AutoModel, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel,
)
from transformers.tokenization_utils_tokenizers import TokenizersBackend


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"


class TinyRemoteModel(LlamaModel):
    config_class = TinyRemoteConfig


AutoModel.register(TinyRemoteConfig, TinyRemoteModel, exist_ok=True)


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig


class TinyRemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = TinyRemoteConfig


class TinyRemoteTokenizer(TokenizersBackend):
    pass
"""


@pytest.fixture(scope="module")
def remote_code_dir(tokenizer, tmp_path_factory) -> Path:
    """A local model folder whose config, model classes and tokenizer are custom code."""
    path = tmp_path_factory.mktemp("tiny-remote")
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "tiny_remote.py").write_text(textwrap.dedent(REMOTE_CODE))
    model_config = json.loads((path / "config.json").read_text())
    model_config["model_type"] = "tiny_remote"
    model_config["auto_map"] = {
        "AutoConfig": "tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "tiny_remote.TinyRemoteForCausalLM",
        "AutoModelForSequenceClassification": "tiny_remote.TinyRemoteForSequenceClassification",
    }
    (path / "config.json").write_text(json.dumps(model_config))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "TinyRemoteTokenizer"
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tiny_remote.TinyRemoteTokenizer"]}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_trust_remote_code_reaches_the_policy_its_tokenizer_and_reward_models(
    remote_code_dir, tmp_path
):
    args = config(tmp_path, trust_remote_code=True)
    trainer = GRPOTrainer(str(remote_code_dir), [str(remote_code_dir)], args, PROMPTS)
    assert type(trainer.model).__name__ == "TinyRemoteForCausalLM"
    assert type(trainer.processing_class).__name__ == "TinyRemoteTokenizer"
    [reward_model] = trainer.reward_funcs  # as in TRL: the loaded model itself
    assert type(reward_model).__name__ == "TinyRemoteForSequenceClassification"
    assert type(trainer.reward_processing_classes[0]).__name__ == "TinyRemoteTokenizer"


def test_custom_code_is_not_run_without_trust_remote_code(remote_code_dir, tmp_path):
    with pytest.raises(ValueError, match="custom code"):
        GRPOTrainer(str(remote_code_dir), rank_in_call, config(tmp_path), PROMPTS)


# --------------------------------------------------------------------------- 6. liger kernel


LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None


@pytest.mark.skipif(LIGER_INSTALLED, reason="liger-kernel is installed")
def test_use_liger_kernel_without_liger_installed_names_the_install(tokenizer, tmp_path):
    args = config(tmp_path, use_liger_kernel=True)
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)


@pytest.mark.skipif(not LIGER_INSTALLED, reason="needs liger-kernel installed")
def test_use_liger_kernel_on_cpu_is_refused_naming_why(tokenizer, tmp_path):
    args = config(tmp_path, use_liger_kernel=True)
    with pytest.raises(ValueError, match="no CPU backend"):
        tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)


def test_use_liger_kernel_refuses_prompt_learning_adapters_as_trl_does(tokenizer, tmp_path):
    from peft import PromptTuningConfig, TaskType

    args = config(tmp_path, use_liger_kernel=True)
    prompt_tuning = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    with pytest.raises(ValueError, match="prompt-learning"):
        tiny_trainer(tokenizer, rank_in_call, args, PROMPTS, peft_config=prompt_tuning)


def test_use_liger_kernel_refuses_what_trl_refuses(tokenizer, tmp_path):
    from peft import LoraConfig

    args = config(tmp_path, use_liger_kernel=True)
    lora_on_head = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="PEFT adapter to `lm_head`"):
        tiny_trainer(tokenizer, rank_in_call, args, PROMPTS, peft_config=lora_on_head)
    args = config(
        tmp_path, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True}
    )
    with pytest.raises(ValueError, match="fused_linear_cross_entropy"):
        tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)


# --------------------------------------------------------------------------- 7. quantization


def test_quantization_config_joins_the_policys_from_pretrained_arguments(tmp_path):
    quantization = BitsAndBytesConfig(load_in_4bit=True)
    args = config(tmp_path, trust_remote_code=True)
    kwargs = policy_init_kwargs(args, quantization)
    assert kwargs == {
        "quantization_config": quantization,
        "trust_remote_code": True,
        "dtype": "auto",
    }
    both = config(tmp_path, model_init_kwargs={"quantization_config": quantization})
    with pytest.raises(ValueError, match="only one place"):
        policy_init_kwargs(both, quantization)


def test_a_quantization_config_reaches_from_pretrained(tiny_model_dir, tmp_path):
    # bitsandbytes is not installed here: the error transformers raises when loading shows the
    # quantization config reached from_pretrained, and it names the fix.
    quantization = BitsAndBytesConfig(load_in_4bit=True)
    with pytest.raises(ImportError, match="pip install -U bitsandbytes"):
        GRPOTrainer(
            str(tiny_model_dir),
            rank_in_call,
            config(tmp_path),
            PROMPTS,
            quantization_config=quantization,
        )


def test_loading_arguments_for_a_loaded_model_are_ignored_with_trls_warnings(
    tokenizer, tmp_path, caplog
):
    args = config(tmp_path, model_init_kwargs={"dtype": "bfloat16"})
    with caplog.at_level(logging.WARNING):
        trainer = tiny_trainer(
            tokenizer,
            rank_in_call,
            args,
            PROMPTS,
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )
    logged = [record.getMessage() for record in caplog.records]
    assert (
        "You passed `model_init_kwargs` to the `GRPOConfig`, but your model is already "
        "instantiated. The `model_init_kwargs` will be ignored."
    ) in logged
    assert (
        "You passed `quantization_config` to the trainer, but your model is already "
        "instantiated. The `quantization_config` will be ignored."
    ) in logged
    assert trainer.model.dtype == torch.float32  # as given


def test_a_peft_model_with_a_peft_config_is_refused_as_trl_does(tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, target_modules=["q_proj"])
    model = get_peft_model(tiny_llama(tokenizer), lora)
    with pytest.raises(ValueError, match="You passed a `PeftModel` instance together with a"):
        GRPOTrainer(
            model,
            rank_in_call,
            config(tmp_path),
            PROMPTS,
            processing_class=tokenizer,
            peft_config=lora,
        )


# --------------------------------------------------------------------------- 8. GSPO warning


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo"])
def test_sequence_level_ratios_with_a_token_summed_loss_warn_as_trl_does(loss_type):
    [warning] = loss_setting_warnings(loss_type, "sequence")
    assert f"the `'{loss_type}'` loss sums per-token contributions" in warning
    assert "weights each sequence by its completion length" in warning
    assert "set `loss_type='grpo'`" in warning


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo"])
def test_sequence_level_ratios_with_a_per_sequence_loss_do_not_warn(tmp_path, loss_type):
    assert loss_setting_warnings(loss_type, "sequence") == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config(tmp_path, loss_type=loss_type, importance_sampling_level="sequence")


def test_the_trainer_logs_trls_loss_warnings_when_it_is_built(tokenizer, tmp_path, caplog):
    # As TRL: a warning through the logging module when the trainer is built, not at config
    # time; luspo at TRL's default token level trains.
    args = config(tmp_path, loss_type="luspo", max_steps=1)
    with caplog.at_level(logging.WARNING):
        trainer = tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)
    [record] = [r for r in caplog.records if "`'luspo'` loss" in r.message]
    assert "should be set to `'sequence'` to mirror the paper's setup" in record.message
    assert record.name == "agentgrpo.training.porting" and record.levelno == logging.WARNING
    trainer.train()
    assert trainer.state.global_step == 1


# --- min_p, repetition_penalty and generation_kwargs with transformers generation -------------


def test_sampling_settings_reach_the_transformers_backend_and_train(tokenizer, tmp_path):
    args = config(
        tmp_path,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.1,
        generation_kwargs={"do_sample": True, "top_k": 20},
    )
    model = tiny_llama(tokenizer)
    before = {n: p.clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model, rank_in_call, args=args, train_dataset=PROMPTS, processing_class=tokenizer
    )
    backend = trainer.engine.context.backend
    assert backend.sampling_overrides == {"min_p": 0.01, "repetition_penalty": 1.1, "top_k": 20}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert backend.prefixes.tokens == 0  # emptied after each round: the weights changed


def test_generation_kwargs_trl_passes_to_generate_apply_and_train(tokenizer, tmp_path):
    # What transformers' generate takes for sampling: beam-only settings that change nothing
    # with one beam, transformers' own processors, and a per-turn token limit.
    generation_kwargs = {
        "num_beams": 1,
        "length_penalty": -0.1,
        "no_repeat_ngram_size": 2,
        "typical_p": 0.95,
        "max_new_tokens": 4,
    }
    args = config(tmp_path, max_steps=1, generation_kwargs=generation_kwargs)
    trainer = tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)
    backend = trainer.engine.context.backend
    assert backend.settings.processing == {"no_repeat_ngram_size": 2, "typical_p": 0.95}
    trainer.train()
    lengths = [len(record.episode.completion_ids) for record in trainer.last_records]
    assert lengths and max(lengths) <= 4  # max_new_tokens bounds the turn


def test_generation_kwargs_that_cannot_give_sampler_logprobs_are_refused_naming_them(
    tokenizer, tmp_path
):
    args = config(tmp_path, generation_kwargs={"num_beams": 2, "length_penalty": -0.1})
    with pytest.raises(ValueError) as refused:
        tiny_trainer(tokenizer, rank_in_call, args, PROMPTS)
    message = str(refused.value)
    assert message.startswith("generation_kwargs={'num_beams': 2} cannot be used for GRPO")
    assert "no per-token sampler logprobs" in message and "num_generations" in message
