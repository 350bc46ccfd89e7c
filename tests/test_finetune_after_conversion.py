"""A converted model must fine-tune like its source (issue 9): weights at the LLaMA's scale, so that an ordinary
optimiser step moves the conversion about as far as it moves the source.

A small LLaMA is trained a little (so that it is not random and fine-tuning has something to keep), converted with
each calibration the converter offers, and then both models get the same few steps of an ordinary recipe. The
converted model's held-out perplexity must end within 1.05x of the source's. With the old calibration (v_proj shrunk
about 300x until the head norm's input was tiny) five full fine-tuning steps ended at 1.16x the source's perplexity
(42.7 against 36.7) for `lstsq` and `scale`, and the value projections differed from the source's.
"""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
from diff_llama.corpus import HELD_OUT_MODULES, stdlib_docstrings
from diff_llama.evaluation import perplexity
from diff_llama.training import optimizer_for

BLOCK = 64


def _text_ids(tokenizer, modules, limit):
    text = stdlib_docstrings(modules)[: 4 * limit]
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0][:limit]


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.blocks = ids[: len(ids) // BLOCK * BLOCK].view(-1, BLOCK)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread (and far faster than on two busy ones)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory, tokenizer):
    """A 2-layer LLaMA trained for 80 steps on standard-library docstrings: perplexity well below random."""
    folder = tmp_path_factory.mktemp("finetune") / "llama"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    blocks = Blocks(_text_ids(tokenizer, ("argparse", "collections", "functools", "pathlib"), 20_000)).blocks
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(80):
        batch = blocks[torch.randint(len(blocks), (8,), generator=generator)]
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _fine_tuned_perplexity(folder, train_data, held_out, recipe, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    learning_rate = 1e-3
    if recipe.endswith("lora"):
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                       "o_proj"]))
        learning_rate = 3e-3
    args = TrainingArguments(str(tmp_path / "run"), max_steps=5, per_device_train_batch_size=8, learning_rate=learning_rate,
                             lr_scheduler_type="constant", save_strategy="no", report_to="none", seed=0)
    # "diff-llama train": its optimiser, with λ at its own learning rate (1e-2); otherwise the Trainer's own AdamW.
    optimizers = (optimizer_for(model, learning_rate, lambda_learning_rate=1e-2), None) if "train" in recipe else (None, None)
    Trainer(model=model, args=args, train_dataset=train_data, optimizers=optimizers).train()
    return perplexity(model, held_out, window=128)


@pytest.mark.parametrize("calibration", ["lstsq", "scale", "none"])
def test_a_fresh_conversion_fine_tunes_like_its_source(tmp_path, tokenizer, trained_llama, calibration):
    # A user's fine-tune: text of one domain, scored on held-out text of it (the tokens after it).
    ids = _text_ids(tokenizer, HELD_OUT_MODULES, 1025 + 8 * 5 * BLOCK)
    train_data, held_out = Blocks(ids[1025:]), ids[:1025]
    converted = tmp_path / "converted"
    options = ConversionOptions(diff_version=1, calibration=calibration, calibration_tokens=4096, eval_tokens=1024,
                                seq_len=128)
    convert_llama_to_diff_llama(str(trained_llama), str(converted), options, progress=False)

    source_model = AutoModelForCausalLM.from_pretrained(trained_llama)
    converted_model = AutoModelForCausalLM.from_pretrained(converted)
    source_before = perplexity(source_model, held_out, window=128)
    converted_before = perplexity(converted_model, held_out, window=128)
    assert source_before < 0.5 * len(tokenizer)  # the source learned something
    assert converted_before < 1.1 * source_before  # the conversion keeps it

    for recipe in ("full", "lora", "diff-llama train"):
        source_after = _fine_tuned_perplexity(trained_llama, train_data, held_out, recipe, tmp_path)
        converted_after = _fine_tuned_perplexity(converted, train_data, held_out, recipe, tmp_path)
        assert source_after < source_before  # the recipe does something
        assert converted_after <= 1.05 * source_after, (
            f"{recipe}: source {source_before:.2f} -> {source_after:.2f}, converted ({calibration}) "
            f"{converted_before:.2f} -> {converted_after:.2f}"
        )
        assert math.isfinite(converted_after)

    # Weights at the LLaMA's scale: the conversion changes no value projection.
    for layer in range(2):
        source_v = source_model.model.layers[layer].self_attn.v_proj.weight
        converted_v = converted_model.model.layers[layer].self_attn.v_proj.weight
        torch.testing.assert_close(converted_v[: len(source_v)], source_v)
