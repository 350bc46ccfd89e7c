"""The monitoring callback with the real Trainer on a tiny model."""

import math

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from conftest import SAMPLE_TEXT, tiny_model
from diff_llama.monitoring import (
    DifferentialAttentionCallback,
    differential_attention_stats,
    plot_differential_attention,
)


def test_stats_follow_their_definitions():
    model = tiny_model(num_attention_heads=4, num_key_value_heads=2)
    probe = torch.randint(3, 128, (1, 12))
    stats = differential_attention_stats(model, probe)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(probe, output_attentions=True).attentions
    lambdas = model.get_lambdas()
    for layer in range(3):
        a1, a2 = attentions[layer][0, :2], attentions[layer][0, 2:]
        m = a1 - lambdas[layer] * a2
        assert stats[f"diff_attn/lambda/layer_{layer}"] == pytest.approx(lambdas[layer].item())
        assert stats[f"diff_attn/first_token_mass/layer_{layer}"] == pytest.approx(m[..., 0].mean().item(), rel=1e-5)
        negative = m.clamp_max(0).abs().sum() / m.abs().sum()
        assert stats[f"diff_attn/negative_share/layer_{layer}"] == pytest.approx(negative.item(), rel=1e-5)
        assert 0 <= stats[f"diff_attn/entropy/layer_{layer}"] <= math.log(12)
    assert model.config._attn_implementation == "eager"  # set by this test, restored by the function below
    model.set_attn_implementation("sdpa")
    differential_attention_stats(model, probe)
    assert model.config._attn_implementation == "sdpa"


def test_stats_of_diff_v2_use_the_per_token_maps():
    model = tiny_model(diff_version=2, num_attention_heads=4, num_key_value_heads=2)
    probe = torch.randint(3, 128, (1, 12))
    stats = differential_attention_stats(model, probe)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(probe, output_attentions=True, output_hidden_states=True)
    for layer in range(3):
        attention = model.model.layers[layer]
        lam = attention.self_attn.differential_lambda(attention.input_layernorm(out.hidden_states[layer]))[0]
        pairs = out.attentions[layer][0].view(2, 2, 12, 12)  # (differential head, map, q, k)
        m = pairs[:, 0] - lam.T[:, :, None] * pairs[:, 1]
        assert stats[f"diff_attn/lambda/layer_{layer}"] == pytest.approx(lam.mean().item(), rel=1e-5)
        assert stats[f"diff_attn/first_token_mass/layer_{layer}"] == pytest.approx(m[..., 0].mean().item(), rel=1e-5)


def test_callback_logs_through_the_real_trainer(tmp_path, tokenizer):
    model = tiny_model(vocab_size=len(tokenizer)).train()
    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[0]
    blocks = ids[: (len(ids) // 32) * 32].view(-1, 32)
    dataset = [{"input_ids": block, "labels": block} for block in blocks]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=6, logging_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    probe = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids

    class Recorder(TrainerCallback):  # stands in for a report_to integration, which runs before user callbacks
        seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs))

    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Recorder()])
    DifferentialAttentionCallback.attach(trainer, probe)
    trainer.train()
    assert sum("diff_attn/mean_abs_lambda" in logs for logs in Recorder.seen) >= 3
    logged = [e for e in trainer.state.log_history if "diff_attn/mean_abs_lambda" in e]
    assert len(logged) >= 3 and all("loss" in e for e in logged[:3])
    assert logged[0]["diff_attn/lambda/layer_1"] != logged[-1]["diff_attn/lambda/layer_1"]  # λ is being trained
    path = plot_differential_attention(trainer.state.log_history, tmp_path / "lambda.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_console_gets_summaries_and_log_history_every_layer(tmp_path, tokenizer, capsys):
    model = tiny_model(vocab_size=len(tokenizer), num_hidden_layers=4).train()
    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[0]
    blocks = ids[: (len(ids) // 32) * 32].view(-1, 32)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,  # disable_tqdm: logs are printed
    )
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": b, "labels": b} for b in blocks])
    DifferentialAttentionCallback.attach(trainer, blocks[0, :16])
    capsys.readouterr()
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "diff_attn" in line]
    assert len(printed) >= 2  # every logging step (and the final summary)
    assert all("diff_attn/mean_abs_lambda" in line and "diff_attn/min_lambda" in line for line in printed)
    assert not any("layer_" in line for line in printed)  # 4 values x layers would flood every line
    logged = [e for e in trainer.state.log_history if "diff_attn/mean_abs_lambda" in e]
    assert len(logged) >= 2 and all(f"diff_attn/entropy/layer_{layer}" in logged[0] for layer in range(4))
    lambdas = [logged[-1][f"diff_attn/lambda/layer_{layer}"] for layer in range(4)]
    assert logged[-1]["diff_attn/min_lambda"] == pytest.approx(min(lambdas))
