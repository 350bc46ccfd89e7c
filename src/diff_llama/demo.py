"""A self-contained tour of the model: train a small fresh DiffLlama, save it, reload it through the Auto
classes, and generate with `pipeline`. It needs no download: text and tokenizer come from the standard library."""

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, pipeline

from .configuration_diff_llama import DiffLlamaConfig
from .corpus import HELD_OUT_MODULES, TRAINING_MODULES, stdlib_docstrings
from .evaluation import perplexity
from .modeling_diff_llama import DiffLlamaForCausalLM


def train_tokenizer(text: str, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def run_demo(output_dir: str | Path, steps: int = 300, seq_len: int = 128, batch_size: int = 8, seed: int = 0,
             final_dir: str | Path | None = None):
    """Train, save into `output_dir`, reload, generate; print what happened. `final_dir` is where the folder ends up
    when `output_dir` is a temporary one swapped in afterwards (`--overwrite`): the folder the user should open."""
    torch.manual_seed(seed)
    held_out_text = stdlib_docstrings(HELD_OUT_MODULES)
    train_text = stdlib_docstrings(TRAINING_MODULES, exclude=held_out_text)
    tokenizer = train_tokenizer(train_text)
    config = DiffLlamaConfig(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=3, head_dim=32, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    model = DiffLlamaForCausalLM(config)
    print(f"Fresh DiffLlama: {model.num_parameters() / 1e6:.2f}M parameters, H=6 softmax maps, G=3 KV heads (odd G)")

    train_ids = tokenizer(train_text, return_tensors="pt").input_ids[0]
    held_out_ids = tokenizer(held_out_text, return_tensors="pt").input_ids[0][:8192]
    ppl_before = perplexity(model, held_out_ids)

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    started = time.perf_counter()
    for _ in (bar := tqdm(range(steps), desc="training", mininterval=2)):
        starts = torch.randint(0, len(train_ids) - seq_len, (batch_size,))
        batch = torch.stack([train_ids[s : s + seq_len] for s in starts])
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    train_seconds = time.perf_counter() - started

    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir)
    ppl_after = perplexity(reloaded, held_out_ids)
    lambdas = reloaded.get_lambdas().tolist()

    generator = pipeline("text-generation", model=reloaded, tokenizer=AutoTokenizer.from_pretrained(output_dir))
    prompt = "Return a new list"
    # Plain greedy decoding sends a model this small and this briefly trained into a run of newlines; a repetition
    # penalty keeps the sample showing what it learned.
    text = generator(prompt, max_new_tokens=40, do_sample=False, repetition_penalty=1.3)[0]["generated_text"]

    print(f"\nSaved to {final_dir or output_dir} (loads with AutoModelForCausalLM, or trust_remote_code=True "
          "without this package)")
    print(f"Held-out perplexity (stdlib docstrings of {', '.join(HELD_OUT_MODULES)}):")
    print(f"  fresh model    {ppl_before:10.1f}")
    print(f"  after {steps} steps {ppl_after:10.1f}   ({train_seconds:.0f} s of CPU training)")
    print(f"λ per layer: {', '.join(f'{v:.3f}' for v in lambdas)}")
    print(f"Generation (greedy, repetition penalty 1.3): {text!r}")
    return {"perplexity_before": ppl_before, "perplexity_after": ppl_after, "generated": text}
