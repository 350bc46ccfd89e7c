"""Training, gradients, embeddings, dtype and device-map loading: the LlamaForCausalLM feature set."""

from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from conftest import SAMPLE_TEXT, differential_model, random_batch, tiny_config, tiny_model
from diff_llama import DiffLlamaForCausalLM
from diff_llama.differential_kernels import BlockedDifferentialAttention, CausalPairedAttentionCPU


# Also run on the oldest supported transformers (scripts/run_oldest_transformers_tests.sh).
pytestmark = pytest.mark.oldest_transformers


def test_fresh_model_initialisation():
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=8, head_dim=64, hidden_size=384, lambda_std_dev=0.1)
    model = DiffLlamaForCausalLM(config)
    lambdas = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if "lambda_" in n])
    assert lambdas.numel() == 8 * 4 * 64
    assert abs(lambdas.mean()) < 0.02 and 0.09 < lambdas.std() < 0.11
    q = model.model.layers[0].self_attn.q_proj.weight
    assert 0.018 < q.std() < 0.022  # initializer_range
    assert torch.all(model.model.norm.weight == 1)


def test_init_does_not_overwrite_loaded_lambdas(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[1].self_attn.differential_lambda.lambda_q2.fill_(0.123)
    model.save_pretrained(tmp_path)
    loaded = DiffLlamaForCausalLM.from_pretrained(tmp_path)
    assert torch.all(loaded.model.layers[1].self_attn.differential_lambda.lambda_q2 == 0.123)


def test_lambda_vectors_keep_the_spec_names_on_disk(tmp_path):
    # In memory λ lives in `self_attn.differential_lambda` (for PEFT); on disk it keeps the built-in model's names.
    tiny_model().save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    lambda_keys = sorted(k for k in saved if "lambda" in k)
    assert lambda_keys[:4] == [f"model.layers.0.self_attn.lambda_{n}" for n in ("k1", "k2", "q1", "q2")]
    assert not any("differential_lambda" in k for k in saved)



def _plain_load_state_dict(model, folder):
    result = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert not result.unexpected_keys
    assert all("lambda" not in key for key in result.missing_keys)


def _accelerates_loader(model, folder):
    from accelerate.utils import load_checkpoint_in_model

    load_checkpoint_in_model(model, folder)


@pytest.mark.parametrize("load", [_plain_load_state_dict, _accelerates_loader], ids=["load_state_dict", "accelerate"])
@pytest.mark.parametrize("version", [1, 2])
def test_a_saved_checkpoint_loads_lambda_outside_from_pretrained(tmp_path, version, load):
    # The Trainer resumes with a non-strict `load_state_dict` of the saved file, whose λ keys are the checkpoint
    # names, not the in-memory ones. accelerate's `load_checkpoint_in_model` without a device map goes through torch's
    # `set_model_state_dict`, which hands `load_state_dict` the file's λ under its checkpoint names and the model's
    # current λ under the in-memory names: the file's must win.
    trained = differential_model(version, dtype=torch.float32)
    trained.save_pretrained(tmp_path)
    fresh = tiny_model(torch.float32, seed=5, diff_version=version, num_attention_heads=6, num_key_value_heads=3,
                       num_hidden_layers=3)
    load(fresh, tmp_path)
    for name, param in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], param), name


@pytest.mark.parametrize("version", [1, 2])
def test_trainer_resume_restores_the_checkpoints_lambda(tmp_path, tokenizer, version):
    from transformers import Trainer, TrainingArguments

    model = differential_model(version, dtype=torch.float32, vocab_size=len(tokenizer))
    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[:, :32]
    data = [{"input_ids": ids[0], "labels": ids[0]}] * 4
    arguments = dict(output_dir=str(tmp_path), per_device_train_batch_size=1, learning_rate=5e-2, save_steps=2,
                     report_to=[], use_cpu=True, save_only_model=False, disable_tqdm=True)
    Trainer(model=model, args=TrainingArguments(max_steps=2, **arguments), train_dataset=data).train()
    saved = {name: param.detach().clone() for name, param in model.named_parameters() if "lambda" in name}
    # A new process: the model as it was before training, resumed from the step-2 checkpoint with nothing to train.
    resumed = differential_model(version, dtype=torch.float32, vocab_size=len(tokenizer))
    Trainer(model=resumed, args=TrainingArguments(max_steps=2, **arguments), train_dataset=data).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    for name, value in saved.items():
        assert torch.equal(resumed.get_parameter(name), value), name

def _enable_activation_checkpointing(model):
    # transformers 5.24 renamed gradient_checkpointing_enable; the oldest supported version has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def _batches(tokenizer, length=32):
    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[0]
    usable = ids[: (len(ids) // length) * length]
    return usable.view(-1, length)


def test_training_reduces_loss_and_reaches_every_weight(tokenizer):
    """(With activation checkpointing the gradients are these, to rounding: the test below.)"""
    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=6, num_key_value_heads=3).train()
    data = _batches(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        loss = model(data, labels=data).loss
        loss.backward()
        if step == 0:
            for name, param in model.named_parameters():
                assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reaches {name}"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-5, 1e-7), (torch.float64, 1e-10, 1e-12)])
def test_gradient_checkpointing_gives_same_gradients(version, dtype, rtol, atol):
    """Checkpointed gradients equal the plain ones, and reach every weight: so a checkpointed run trains as the plain
    run of the test above does."""
    model = differential_model(version, dtype).train()
    input_ids = random_batch()[0]
    model(input_ids, labels=input_ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _enable_activation_checkpointing(model)
    model(input_ids, labels=input_ids).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reaches {name}"
        torch.testing.assert_close(param.grad, plain[name], rtol=rtol, atol=atol)


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings(tmp_path, tie):
    model = tiny_model(tie_word_embeddings=tie)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tie
    model.save_pretrained(tmp_path)
    loaded = DiffLlamaForCausalLM.from_pretrained(tmp_path)
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) is tie
    input_ids = torch.randint(3, 128, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_resize_token_embeddings(tie):
    model = tiny_model(tie_word_embeddings=tie)
    input_ids = torch.randint(3, 128, (1, 8))
    with torch.no_grad():
        before = model(input_ids).logits
    model.resize_token_embeddings(140)
    assert model.config.vocab_size == 140
    assert model.model.embed_tokens.weight.shape[0] == 140 and model.lm_head.weight.shape[0] == 140
    with torch.no_grad():
        after = model(torch.cat([input_ids, torch.tensor([[139]])], 1)).logits
    torch.testing.assert_close(after[:, :8, :128], before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_loading(tmp_path, dtype):
    tiny_model().save_pretrained(tmp_path)
    loaded = DiffLlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert all(p.dtype == dtype for p in loaded.parameters())
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.randint(3, 128, (1, 8))).logits).all()


def test_device_map_auto_with_disk_offload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model()
    model.save_pretrained(tmp_path / "model")
    input_ids = torch.randint(3, 128, (1, 8))
    with torch.no_grad():
        expected = model(input_ids).logits
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": int(layer_bytes * 1.5)},
        offload_folder=tmp_path / "offload",
    )
    assert "disk" in set(loaded.hf_device_map.values())  # some layers really were offloaded
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 2), (4, 1), (8, 8)])
@pytest.mark.parametrize("kernel,function", [("paired_sdpa_cpu", CausalPairedAttentionCPU),
                                             ("blocked", BlockedDifferentialAttention)])
def test_sdpa_training_kernels_give_the_generic_gradients(heads, kv_heads, kernel, function):
    """CPU training with SDPA through each training kernel (no padding mask): same loss and gradients as the eager
    generic path, in float64, λ included. (tests/test_kernels.py covers padding masks and the kernel alone.)"""
    torch.manual_seed(0)
    input_ids = torch.randint(3, 128, (2, 16))
    grads = {}
    for attn in ("sdpa", "eager"):
        model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads).train()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lambda_" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        model.set_attn_implementation(attn)
        model.set_differential_kernel(kernel if attn == "sdpa" else "generic")
        with mock.patch.object(function, "apply", wraps=function.apply) as spy:
            loss = model(input_ids, labels=input_ids).loss
        assert spy.call_count == (model.config.num_hidden_layers if attn == "sdpa" else 0)
        loss.backward()
        grads[attn] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["sdpa"][0], grads["eager"][0], rtol=0, atol=1e-12)
    for name, grad in grads["eager"][1].items():
        torch.testing.assert_close(grads["sdpa"][1][name], grad, rtol=1e-9, atol=1e-11, msg=name)
