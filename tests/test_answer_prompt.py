"""The main job's answer: whole when the model ends it, marked as cut when it runs out of tokens first."""

import torch

from conftest import tiny_model
from diff_llama.commands import answer_prompt, encode_prompt


def saved_model(folder, tokenizer, eos_token_id):
    model = tiny_model(vocab_size=len(tokenizer), diff_version=2)
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def test_an_answer_cut_by_the_token_limit_says_so(tmp_path, tokenizer):
    saved_model(tmp_path, tokenizer, eos_token_id=len(tokenizer) + 5)  # a token the model can never emit
    assert answer_prompt(str(tmp_path), "Hello", max_new_tokens=4).endswith("[... cut at 4 tokens]")


def test_an_answer_the_model_ends_is_not_marked(tmp_path, tokenizer):
    model = saved_model(tmp_path, tokenizer, eos_token_id=None)
    inputs = encode_prompt(tokenizer, "Hello")
    with torch.no_grad():
        first = model(**inputs).logits[0, -1].argmax().item()  # greedy's first token: make it the end
    saved_model(tmp_path, tokenizer, eos_token_id=first)
    assert "cut at" not in answer_prompt(str(tmp_path), "Hello", max_new_tokens=1)
