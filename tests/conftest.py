import hashlib
import os
from pathlib import Path

# Tests never touch the network: the Hub is unreachable here, and a test that needs it is a defect.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import diff_llama  # noqa: E402,F401  (registers the Auto classes)
from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

SAMPLE_TEXT = (
    "The differential transformer subtracts one softmax attention map from another to cancel attention noise. "
    "Large language models read text as tokens and predict the next token. "
    "A converter keeps what the original model knew while changing how it attends. "
    "Quick brown foxes jump over lazy dogs while the cat sleeps in the warm sun. "
) * 4


def tiny_config(**overrides) -> DiffLlamaConfig:
    values = dict(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return DiffLlamaConfig(**values)


def tiny_model(dtype=torch.float32, seed=0, **overrides) -> DiffLlamaForCausalLM:
    torch.manual_seed(seed)
    model = DiffLlamaForCausalLM(tiny_config(**overrides)).to(dtype)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A real byte-level BPE tokenizer trained on the sample text (the Hub's tokenizers are unreachable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=128,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([SAMPLE_TEXT], trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert tok.pad_token_id == 0 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    return tok


# Version 1 conversion options that keep calibration and evaluation short on the tiny checkpoints below.
FAST = dict(diff_version=1, calibration_tokens=2048, eval_tokens=1024, seq_len=128)


def make_llama(folder: Path, tokenizer, dtype=torch.float32, max_shard_size=None, seed=0, **overrides) -> Path:
    """A small random LLaMA (odd H = 9 over G = 3 by default) saved by transformers, with the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(
        vocab_size=len(tokenizer), hidden_size=72, intermediate_size=144, num_hidden_layers=3,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**values)).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def llama_dir(tmp_path, tokenizer):
    return make_llama(tmp_path / "llama", tokenizer)


def folder_checksum(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
            digest.update(str(file.stat().st_mtime_ns).encode())
    return digest.hexdigest()
