import copy
import hashlib
import os
import sys
from pathlib import Path

# Tests never touch the network: the Hub is unreachable here, and a test that needs it is a defect.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import diff_llama  # noqa: E402,F401  (registers the Auto classes)
from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM  # noqa: E402

# Two threads at most: the tiny models gain nothing from more. Under pytest-xdist the workers share the cores, so
# each takes its share (two workers on two cores: one thread each, not two fighting over every core), and so do the
# processes the tests start (servers, fresh Pythons, the benchmark's dry runs): OpenMP threads that outnumber the
# cores spin at barriers and slow the test running beside them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

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


# (H, G) layouts the model is checked on against the reference.
# Version 1: odd G, G = 1 (multi-query), H/2 odd, G = H, even G with H/2 odd.
LAYOUTS = [(6, 3), (6, 1), (2, 1), (8, 4), (8, 1), (6, 6), (12, 3), (10, 2)]
# DIFF V2 (G divides H/2): H/2 odd (the SmolLM2 conversion has H/2 = 9), G = 1, G = H/2, several groups.
V2_LAYOUTS = [(6, 3), (6, 1), (2, 1), (8, 4), (8, 2), (18, 3), (12, 2)]

# Where scripts/setup_env.sh installs torchao and bitsandbytes for the test environment, beside it rather than in it:
# transformers and PEFT import them wherever they can, and on a CPU torch their imports print lines of their own.
# tests/test_quantization.py and the docs' blocks marked `quantizers` run a Python that sees them.
QUANTIZERS_ASIDE = Path(sys.prefix) / "quantizers-aside"

# What the oldest declared torch (2.6) lacks that transformers' own Llama needs too, probed with a plain
# LlamaForCausalLM under transformers 5.16.1: torch.compile with fullgraph (2.6 fails a compiled forward and compiled
# static-cache generate, 2.7 the forward; 2.8 neither), and tensor parallelism and FSDP2 (transformers asks for 2.7).
from transformers.utils import is_torch_greater_or_equal  # noqa: E402

needs_fullgraph_compile = pytest.mark.skipif(
    not is_torch_greater_or_equal("2.8", accept_dev=True),
    reason="transformers' own Llama does not compile with fullgraph before torch 2.8")
needs_torch_distributed_of_transformers = pytest.mark.skipif(
    not is_torch_greater_or_equal("2.7", accept_dev=True),
    reason="tensor parallelism and FSDP2 need torch 2.7, as transformers' own do")


def randomise_lambdas(model, seed=3):
    """Non-trivial version 1 λ vectors, so that λ differs from λ_init and from layer to layer."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lambda_" in name:
            param.data = torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.4


def randomise_lambda_proj(model, seed=7):
    """A random DIFF V2 λ projection: λ well away from 0.5 and different per token and head, so that a layout
    mistake in λ shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        weight = layer.self_attn.differential_lambda.lambda_proj.weight
        weight.data = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)


def differential_model(version=1, dtype=torch.float64, heads=6, kv_heads=3, layers=3, seed=0, **overrides):
    """A tiny model of either `diff_version` whose λ is far from its initial value (see `randomise_lambdas` and
    `randomise_lambda_proj`)."""
    model = tiny_model(dtype, seed=seed, diff_version=version, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, num_hidden_layers=layers, **overrides)
    if version == 1:
        randomise_lambdas(model)
    else:
        randomise_lambda_proj(model, seed=seed + 7)
    return model


def random_batch(seed=1, batch=3, length=9, vocab=128):
    """Token ids and an attention mask with left padding: row 1 has 4 padded positions, row 2 (if any) one."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, :4] = 0
    if batch > 2:
        attention_mask[2, :1] = 0
    return input_ids, attention_mask


def grouped_attention_inputs(heads, kv_heads, query_len, dtype, batch=3, key_len=11, head_dim=8, device="cpu",
                             causal=True):
    """An attention call's inputs after the cache: queries (batch, H, q, d), keys and values (batch, G, k, d), and
    transformers' SDPA mask of a left-padded batch (row 1 has 4 padded keys, row 2 one): (batch, 1, q, k) with the
    queries the last `query_len` positions, causal among themselves; or, not `causal`, one row (batch, 1, 1, k) that
    every query shares. Drawn in float64, then cast."""
    generator = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + query_len)
    query = torch.randn(batch, heads, query_len, head_dim, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(batch, kv_heads, key_len, head_dim, generator=generator, dtype=torch.float64)
                  for _ in range(2))
    real = torch.ones(batch, key_len, dtype=torch.bool)
    real[1, :4] = real[2, :1] = False
    if causal:
        mask = real[:, None, None, :] & (torch.arange(key_len) <= torch.arange(key_len - query_len, key_len)[:, None])
    else:
        mask = real[:, None, None, :]
    return (*(tensor.to(device, dtype) for tensor in (query, key, value)), mask.to(device))


def padded_labels(input_ids, attention_mask):
    """Labels with no loss on padded positions or on the outputs of padded query rows: a fully masked row has no
    defined output, and transformers' backends differ there (eager averages every value, SDPA does not)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, 1:].masked_fill_(attention_mask[:, :-1] == 0, -100)
    return labels


def prefill_then_decode(model, input_ids, attention_mask, prefix=5, cache=None):
    """Logits (batch, length, vocab) of a padded prefill of `prefix` tokens, then one token at a time with a cache
    (a new DynamicCache unless one is given)."""
    from transformers import DynamicCache

    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        logits = [model(input_ids[:, :prefix], attention_mask=attention_mask[:, :prefix],
                        position_ids=positions[:, :prefix], cache=cache, use_cache=True).logits]
        for t in range(prefix, input_ids.shape[1]):
            logits.append(model(input_ids[:, t : t + 1], attention_mask=attention_mask[:, : t + 1],
                                position_ids=positions[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


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
    return _shared(tok)


_shared_tokenizers = []  # (tokenizer, its state when made): what the guard below checks after each test


def _tokenizer_state(tok):
    return tok.chat_template, len(tok), tok.padding_side, tok.truncation_side, str(tok.special_tokens_map)


def _shared(tok):
    """`tok`, a session fixture's tokenizer, put under the guard below."""
    _shared_tokenizers.append((tok, _tokenizer_state(tok)))
    return tok


@pytest.fixture(autouse=True)
def _shared_tokenizer_left_alone():
    """The `tokenizer` and `chatml_tokenizer` fixtures are shared by the whole session, so a test that changes one (a
    chat template, a token, a padding side) changes what the tests after it see, and the outcome comes to depend on
    their order: fail the test that did it (`with_chat_template` makes a copy to change)."""
    yield
    for index, (tok, state) in enumerate(_shared_tokenizers):
        now = _tokenizer_state(tok)
        _shared_tokenizers[index] = (tok, now)  # only the test that changed it fails, not every test after it
        assert now == state, "this test changed a tokenizer the session shares; change a copy (copy.deepcopy)"


# SmolLM2-135M-Instruct's chat template as its conversion ships it (chat_template.jinja): ChatML, with a default
# system turn when the conversation has none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(autouse=True)
def _hub_reachability_asked_anew():
    """Each test asks anew whether a Hub answers: a port that nothing listened on in one test may be a fake Hub's in
    the next (the system hands freed ports out again)."""
    from diff_llama import hub

    yield
    hub._answers.clear()


def skip_unless_serving():
    """Skip the calling test module where `diff-llama serve` cannot run: without the serving extras, or on a
    transformers whose server it refuses. Returns the `openai` client package."""
    openai = pytest.importorskip("openai", reason="serving needs transformers[serving]")
    pytest.importorskip("fastapi", reason="serving needs transformers[serving]")
    pytest.importorskip("uvicorn", reason="serving needs transformers[serving]")
    try:  # the package supports transformers 5.16.1, whose server `diff-llama serve` refuses in one line
        from diff_llama.serving import require_supported_server

        require_supported_server()
    except ImportError as error:
        pytest.skip(str(error), allow_module_level=True)
    return openai


def with_chat_template(tokenizer, template: str, special_tokens=()):
    """A copy of `tokenizer` that chats with `template` (and has `special_tokens`). A copy, because the `tokenizer`
    fixture is shared by the whole session: a template set on it would change what later tests see."""
    chat = copy.deepcopy(tokenizer)
    if special_tokens:
        chat.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    chat.chat_template = template
    return chat


@pytest.fixture(scope="session")
def chatml_tokenizer(tokenizer):
    """The test tokenizer made to chat like SmolLM2-135M-Instruct's: its ChatML markers as special tokens (one id
    each, as in SmolLM2) and its chat template."""
    return _shared(with_chat_template(tokenizer, SMOLLM2_CHAT_TEMPLATE, ["<|im_start|>", "<|im_end|>"]))


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


class LayerZeroQueries:
    """Watches the commands' models from inside: `watch(monkeypatch)` hooks layer 0's q_proj of the model that `train`
    and `recover` train ("student", as it goes to `with_lora`) and of recover's source ("source"), and `seen` gets
    (who, dtype, device type) of each forward the Trainer runs (autograd on) and of every forward of the source."""

    def __init__(self):
        self.seen = []

    def hook(self, model, who: str):
        def record(module, args, out):
            if torch.is_grad_enabled() or who == "source":
                self.seen.append((who, out.dtype, out.device.type))

        model.model.layers[0].self_attn.q_proj.register_forward_hook(record)
        return model

    def watch(self, monkeypatch):
        import diff_llama.recovery as recovery
        import diff_llama.training as training

        with_lora, load_teacher = training.with_lora, recovery.load_teacher
        hooked_lora = lambda model, options: with_lora(self.hook(model, "student"), options)  # noqa: E731
        monkeypatch.setattr(training, "with_lora", hooked_lora)
        monkeypatch.setattr(recovery, "with_lora", hooked_lora)
        monkeypatch.setattr(recovery, "load_teacher", lambda *a, **k: self.hook(load_teacher(*a, **k), "source"))
        return self

    def of(self, who: str) -> list:
        return [(dtype, device) for name, dtype, device in self.seen if name == who]


def folder_checksum(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
            digest.update(str(file.stat().st_mtime_ns).encode())
    return digest.hexdigest()


def bytes_saved_for_backward(model) -> int:
    """Bytes of every storage autograd keeps for backward in one training forward, parameters left out."""
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.train().model(ids)
    return sum(saved.values())
