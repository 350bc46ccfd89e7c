"""TRL's DPOTrainer on DiffLlama, fully and with LoRA, on conversational preference data through a chat template.

docs/fine-tuning.md ("With TRL") shows the same runs; TRL's SFTTrainer is tested in test_finetuning.py.
"""

import math

import pytest
import torch
from conftest import differential_model
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from test_finetuning import LAMBDA_NAME, lambdas_of
from transformers import AutoModelForCausalLM

from diff_llama.training import lora_config, optimizer_for

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402  (a dependency of TRL)

PROBE = torch.tensor([[5, 9, 20, 14, 7, 3, 11]])


def preference_pairs() -> Dataset:
    def turn(role, text):
        return [{"role": role, "content": text}]

    rows = [
        ("What does differential attention subtract?", "A second attention map.", "Nothing at all."),
        ("What do language models predict?", "The next token.", "Quick brown foxes."),
    ]
    return Dataset.from_list([{"prompt": turn("user", q), "chosen": turn("assistant", good),
                               "rejected": turn("assistant", bad)} for q, good, bad in rows])


def dpo_config(folder, **options):
    return trl.DPOConfig(str(folder), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                         save_strategy="no", report_to="none", bf16=False, **options)  # bf16 needs a GPU


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def saved_model(request, tmp_path, chatml_tokenizer):
    """A folder with a tiny DiffLlama of either version whose λ is far from its start, and the chat tokenizer."""
    folder = tmp_path / "base"
    differential_model(request.param, torch.float32, vocab_size=len(chatml_tokenizer)).save_pretrained(folder)
    chatml_tokenizer.save_pretrained(folder)
    return folder, request.param


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder)


def check_losses(trainer):
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # At the first step the policy is the reference, so the DPO loss is exactly -log sigmoid(0): a wrong or
    # differently loaded reference model would show here.
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)


def test_full_dpo_trains_lambda_against_a_frozen_reference(saved_model, chatml_tokenizer, tmp_path):
    folder, _ = saved_model
    model, reference = load(folder), load(folder)
    lambdas_before = lambdas_of(model.eval(), PROBE)
    # TRL would rebuild a missing reference from config.json's class name, which is transformers' built-in DiffLlama
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=dpo_config(tmp_path / "dpo"),
                             train_dataset=preference_pairs(), processing_class=chatml_tokenizer,
                             optimizers=(optimizer_for(model, learning_rate=1e-3, lambda_learning_rate=5e-2), None))
    trainer.train()
    check_losses(trainer)
    assert not torch.allclose(lambdas_of(model.eval(), PROBE), lambdas_before)
    torch.testing.assert_close(lambdas_of(reference, PROBE), lambdas_before, rtol=0, atol=0)


def check_adapter(trainer, folder, output, version):
    """The adapter the trainer saves holds λ, and the base model plus that adapter computes the trained model."""
    model = trainer.model.eval()
    with torch.no_grad(), model.disable_adapter():  # DPO's reference: the model before training, λ included
        torch.testing.assert_close(model(PROBE).logits, load(folder).eval()(PROBE).logits)
    trainer.save_model(str(output))
    adapter = load_file(output / "adapter_model.safetensors")
    assert any("differential_lambda" in key and LAMBDA_NAME[version] in key for key in adapter), sorted(adapter)
    reloaded = PeftModel.from_pretrained(load(folder), output).eval()
    torch.testing.assert_close(lambdas_of(reloaded, PROBE), lambdas_of(model, PROBE))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(PROBE).logits, model(PROBE).logits)


def test_dpo_with_lora_trains_lambda_in_the_adapter(saved_model, chatml_tokenizer, tmp_path):
    folder, version = saved_model
    model = load(folder)
    lambdas_before = lambdas_of(model.eval(), PROBE)
    trainer = trl.DPOTrainer(model=model, args=dpo_config(tmp_path / "dpo", learning_rate=1e-2),
                             train_dataset=preference_pairs(), processing_class=chatml_tokenizer,
                             peft_config=lora_config())
    assert trainer.ref_model is None  # the reference is the model with its adapter off
    trainer.train()
    check_losses(trainer)
    assert not torch.allclose(lambdas_of(trainer.model.eval(), PROBE), lambdas_before)
    check_adapter(trainer, folder, tmp_path / "adapter", version)


def test_dpo_on_a_lora_model_with_its_own_lambda_learning_rate(tmp_path, chatml_tokenizer):
    """The documented way for version 1's λ vectors: wrap the model, give the trainer `optimizer_for`'s optimizer."""
    folder = tmp_path / "base"
    differential_model(1, torch.float32, vocab_size=len(chatml_tokenizer)).save_pretrained(folder)
    model = get_peft_model(load(folder), lora_config())
    lambdas_before = lambdas_of(model.eval(), PROBE)
    optimizer = optimizer_for(model, learning_rate=1e-4, lambda_learning_rate=5e-2)
    trainer = trl.DPOTrainer(model=model, args=dpo_config(tmp_path / "dpo"), train_dataset=preference_pairs(),
                             processing_class=chatml_tokenizer, optimizers=(optimizer, None))
    trainer.train()
    check_losses(trainer)
    assert not torch.allclose(lambdas_of(trainer.model.eval(), PROBE), lambdas_before)
    check_adapter(trainer, folder, tmp_path / "adapter", 1)
