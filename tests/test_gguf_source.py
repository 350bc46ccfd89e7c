"""A LLaMA GGUF file converts to a model that computes the LLaMA's function, including what transformers' GGUF reader
alone leaves out: biases, Llama 3's RoPE scaling (`rope_freqs.weight`) and linear RoPE scaling. The oracle is the
Transformers LLaMA the file was written from (`gguf_files.write_llama_gguf`, llama.cpp's conventions), in float64;
what the file cannot carry as a LLaMA is refused by name, with nothing written."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from diff_llama.cli import main
from diff_llama.errors import UserError
from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
from gguf_files import write_llama_gguf

pytest.importorskip("gguf")
pytestmark = pytest.mark.oldest_transformers  # the GGUF loader and the RoPE config moved within 5.x

SHAPE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=16384)
LLAMA_3 = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)


def llama(seed=0, biases=(), **overrides) -> LlamaForCausalLM:
    """A small random LLaMA; `biases` names the linear layers whose (random, so nonzero) biases it keeps."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **overrides})).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) if name.split(".")[-2] in biases
                                else torch.zeros_like(parameter))
    return model


def converted_logits_match(source: LlamaForCausalLM, gguf_file, out, positions=300):
    """Converts `gguf_file` and compares the converted model with `source` in float64, over `positions` tokens (past
    Llama 3's short wavelengths, so that every RoPE band turns)."""
    convert_llama_to_diff_llama(str(gguf_file), str(out), ConversionOptions(evaluate=False), progress=False)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    input_ids = torch.randint(0, SHAPE["vocab_size"], (2, positions), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = source.double()(input_ids).logits
        logits = converted(input_ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    return converted


def test_transformers_alone_misreads_these_files(tmp_path):
    """Why the converter reads the file itself: transformers' GGUF reader skips the biases and the RoPE scaling (a
    plain file reads back with identical float32 logits, so any difference is the reading's)."""
    for name, source in {"biases": llama(biases=("q_proj", "up_proj"), attention_bias=True, mlp_bias=True),
                         "llama3": llama(rope_parameters=LLAMA_3)}.items():
        path = write_llama_gguf(source, tmp_path / f"{name}.gguf")
        read = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        input_ids = torch.arange(300).remainder(SHAPE["vocab_size"])[None]
        with torch.no_grad():
            difference = (read(input_ids).logits - source(input_ids).logits).abs().max().item()
        assert difference > 1e-5, name


@pytest.mark.parametrize("biases", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                    ("q_proj", "k_proj", "v_proj")])
def test_a_gguf_llama_with_biases_converts_exactly(tmp_path, biases):
    """All seven biases; and a query, key and value bias without an output one (the layout of a llamafied Qwen), where
    the file has no o_proj bias and the converted model's is zero."""
    mlp = "up_proj" in biases
    source = llama(biases=biases, attention_bias=True, mlp_bias=mlp)
    converted = converted_logits_match(source, write_llama_gguf(source, tmp_path / "llama.gguf"), tmp_path / "out")
    assert converted.config.attention_bias and converted.config.mlp_bias == mlp
    o_proj = converted.model.layers[1].self_attn.o_proj.bias
    assert torch.equal(o_proj, torch.zeros_like(o_proj)) != ("o_proj" in biases)


@pytest.mark.parametrize("rope", [
    LLAMA_3,  # Llama 3.2's published values
    {**LLAMA_3, "factor": 8.0, "original_max_position_embeddings": 2048},  # a band where Meta's values are wrong
    # two divisors between the edges, and a low factor other than 1
    {**LLAMA_3, "low_freq_factor": 2.0, "high_freq_factor": 64.0, "original_max_position_embeddings": 4096},
    {**LLAMA_3, "rope_theta": 10000.0, "original_max_position_embeddings": 1024},
], ids=["llama-3.2", "factor-8", "wide-band", "theta-10000"])
def test_llama_3_rope_scaling_is_read_from_rope_freqs(tmp_path, rope):
    source = llama(rope_parameters=rope)
    converted = converted_logits_match(source, write_llama_gguf(source, tmp_path / "llama.gguf"), tmp_path / "out")
    assert converted.config.rope_parameters["rope_type"] == "llama3"
    assert converted.config.rope_parameters["factor"] == rope["factor"]


def test_linear_rope_scaling_is_read_from_the_metadata(tmp_path):
    source = llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    gguf_file = write_llama_gguf(source, tmp_path / "llama.gguf", rope_metadata={"type": "linear", "factor": 4.0})
    converted = converted_logits_match(source, gguf_file, tmp_path / "out")
    assert converted.config.rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def test_the_commands_that_run_a_gguf_llama_read_it_whole_too(tmp_path):
    """evaluate, ruler, attention-map and adapt load their models through `load_causal_lm`: a GGUF LLaMA there is
    the LLaMA, biases and RoPE scaling included, so that a comparison with its conversion compares like with like."""
    from diff_llama.resolve import load_causal_lm

    source = llama(biases=("q_proj", "v_proj"), attention_bias=True, rope_parameters=LLAMA_3)
    loaded = load_causal_lm(write_llama_gguf(source, tmp_path / "llama.gguf"), dtype=torch.float64).eval()
    input_ids = torch.arange(300).remainder(SHAPE["vocab_size"])[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, source.double()(input_ids).logits, rtol=0, atol=1e-6)


def test_diff_llama_serve_loads_a_gguf_llama_whole(tmp_path):
    """`diff-llama serve model.gguf`: the server's loader (in the model's process) reads the file as convert does."""
    model_manager = pytest.importorskip("transformers.cli.serving.model_manager", exc_type=ImportError)
    if not hasattr(model_manager, "ModelLoader"):
        pytest.skip("transformers serve before 5.25 loads models without a ModelLoader, which diff-llama serve extends")
    from diff_llama.serving_loader import DiffLlamaModelLoader

    source = llama(biases=("q_proj", "v_proj"), attention_bias=True, rope_parameters=LLAMA_3)
    write_llama_gguf(source, tmp_path / "llama.gguf")
    served = DiffLlamaModelLoader(device="cpu", dtype="float32")._load_model(f"{tmp_path}:llama.gguf").eval()
    input_ids = torch.arange(300).remainder(SHAPE["vocab_size"])[None]
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids).logits, source(input_ids).logits, rtol=0, atol=1e-4)


def test_a_plain_gguf_llama_still_converts_exactly(tmp_path):
    source = llama(tie_word_embeddings=True)
    converted = converted_logits_match(source, write_llama_gguf(source, tmp_path / "llama.gguf"), tmp_path / "out")
    assert converted.config.rope_parameters["rope_type"] == "default" and not converted.config.attention_bias


def test_a_gguf_file_without_a_vocabulary_or_file_type_is_told_from_an_unreadable_one(tmp_path, capsys):
    """A file that states no licence, file type or vocabulary still states its architecture: it has no tokenizer
    (the converter's one line naming the flag), where it was a traceback from transformers' tokenizer builder."""
    source = llama()
    gguf_file = write_llama_gguf(source, tmp_path / "bare.gguf", file_type=False)
    assert main(["convert", str(gguf_file), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{gguf_file} has no tokenizer, which evaluation needs; add the "
                                                    "tokenizer files or pass --no-evaluate.")
    converted_logits_match(source, gguf_file, tmp_path / "out")


def test_the_commands_that_run_a_gguf_file_refuse_it_in_the_same_one_line(tmp_path, capsys):
    """evaluate, on a file with a tensor a LLaMA lacks: convert's line, not "cannot be read ... download it again";
    and on a file without a vocabulary, which it needs to read text: a line that says so."""
    import numpy as np

    gguf_file = write_llama_gguf(llama(), tmp_path / "moe.gguf", extra_tensors={
        "blk.0.ffn_gate_inp.weight": np.zeros((4, SHAPE["hidden_size"]), dtype=np.float32)})
    from diff_llama.resolve import load_causal_lm

    with pytest.raises(UserError, match=r"holds tensors a LLaMA does not have \(blk\.0\.ffn_gate_inp\.weight\)"):
        load_causal_lm(gguf_file)
    assert main(["evaluate", str(gguf_file), "--output", str(tmp_path / "evaluated")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"{gguf_file} holds no vocabulary (no tokenizer.ggml.model), which this command needs to read text; give the "
        "model's GGUF file with its tokenizer, or its folder.")
    assert not (tmp_path / "evaluated").exists()


def _refused(tmp_path, capsys, gguf_file) -> str:
    """convert's one line for `gguf_file`, after its `diff-llama convert: error: <file>`; nothing written."""
    assert main(["convert", str(gguf_file), str(tmp_path / "out"), "--no-evaluate"]) == 2
    assert not (tmp_path / "out").exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    prefix = f"diff-llama convert: error: {gguf_file} "
    assert line.startswith(prefix), line
    return line[len(prefix):]


def test_a_tensor_a_llama_does_not_have_is_refused_by_name(tmp_path, capsys):
    import numpy as np

    gguf_file = write_llama_gguf(llama(), tmp_path / "moe.gguf", extra_tensors={
        "blk.0.ffn_gate_inp.weight": np.zeros((4, SHAPE["hidden_size"]), dtype=np.float32)})
    assert _refused(tmp_path, capsys, gguf_file) == (
        "holds tensors a LLaMA does not have (blk.0.ffn_gate_inp.weight), which transformers' GGUF "
        "reader would skip, so the model would lose them; use the model's Transformers checkpoint (its "
        "folder or Hub id) instead.")


def test_a_rope_scaling_it_cannot_read_is_refused(tmp_path, capsys):
    gguf_file = write_llama_gguf(llama(), tmp_path / "yarn.gguf", rope_metadata={"type": "yarn", "factor": 4.0})
    assert _refused(tmp_path, capsys, gguf_file) == (
        "uses RoPE scaling 'yarn' (llama.rope.scaling.type), which diff-llama cannot read from "
        "a GGUF file; use the model's Transformers checkpoint (its folder or Hub id) instead.")


def test_linear_rope_scaling_without_a_factor_is_refused(tmp_path, capsys):
    gguf_file = write_llama_gguf(llama(), tmp_path / "linear.gguf", rope_metadata={"type": "linear"})
    assert _refused(tmp_path, capsys, gguf_file).startswith("uses RoPE scaling 'linear' without a factor ")


def test_rope_divisors_no_llama_3_scaling_gives_are_refused(tmp_path, capsys):
    import numpy as np

    source = llama()
    divisors = np.linspace(1, 9, SHAPE["head_dim"] // 2, dtype=np.float32)[::-1].copy()  # largest at short wavelengths
    gguf_file = write_llama_gguf(source, tmp_path / "odd.gguf", extra_tensors={"rope_freqs.weight": divisors})
    assert _refused(tmp_path, capsys, gguf_file) == (
        "scales RoPE by rope_freqs.weight in a way Llama 3's RoPE scaling does not reproduce; "
        "use the model's Transformers checkpoint (its folder or Hub id) instead.")


def test_a_file_missing_a_weight_is_refused_as_incomplete(tmp_path, capsys):
    source = llama()
    gguf_file = write_llama_gguf(source, tmp_path / "cut.gguf", skip=("blk.1.ffn_up.weight",))
    assert _refused(tmp_path, capsys, gguf_file) == (
        "lacks tensors every LLaMA has (model.layers.1.mlp.up_proj.weight); if it is truncated or "
        "corrupt, download it again.")
