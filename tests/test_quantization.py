"""Quantized loading (`from_pretrained(..., quantization_config=...)`) with the quantizers that run on a CPU, torchao's
int8 weights and bitsandbytes' 4-bit and 8-bit, a float16 load, and QLoRA (LoRA over a 4-bit base, λ trained in full).

DIFF V2's λ projection is left out of every quantizer (`_keep_in_fp32_modules`): λ weights a subtraction that
cancels most of the signal, and its float32 product cannot read a quantized weight type (under torchao, DIFF V2's
forward once failed: `Int8Tensor dispatch: ... aten.t`). The other linear layers are quantized as in any LLaMA.

The quantized checks run in `quantization_worker.py`, in a Python that can import the quantizers:
scripts/setup_env.sh installs them beside the environment (`QUANTIZERS_ASIDE`), since transformers and PEFT import
them wherever they are importable, and their imports' lines on a CPU torch would reach every other test's commands.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import QUANTIZERS_ASIDE, differential_model

HERE = Path(__file__).resolve().parent
QUANTIZERS = ["torchao-int8", "bnb-4bit", "bnb-8bit"]
# Widths that are multiples of the quantizers' block of 64 (bitsandbytes' CPU kernels need that).
SHAPE = dict(heads=8, kv_heads=2, hidden_size=128, intermediate_size=256, head_dim=16)


def quantization_configs() -> dict:
    from transformers import BitsAndBytesConfig, TorchAoConfig

    def torchao_int8():
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())

    return {
        "torchao-int8": torchao_int8,
        "bnb-4bit": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32),
        "bnb-8bit": lambda: BitsAndBytesConfig(load_in_8bit=True),
    }


def saved_model(tmp_path, version):
    model = differential_model(version, torch.float32, **SHAPE)
    model.save_pretrained(tmp_path / f"v{version}")
    return model, tmp_path / f"v{version}"


def is_plain_tensor(tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def dequantized_copy(model, quantized):
    """`model` with each linear layer's weight replaced by what `quantized` holds for it, dequantized."""
    plain = copy.deepcopy(model)
    quantized_modules = dict(quantized.named_modules())
    for name, module in plain.named_modules():
        weight = getattr(quantized_modules.get(name), "weight", None)
        if type(module) is not torch.nn.Linear or weight is None or is_plain_tensor(weight):
            continue
        if getattr(weight, "quant_state", None) is not None:  # bitsandbytes 4-bit
            import bitsandbytes

            weight = bitsandbytes.functional.dequantize_4bit(weight.data, weight.quant_state)
        else:  # torchao
            weight = weight.dequantize()
        module.weight.data = weight.float().reshape(module.weight.shape)
    return plain


def check_quantized_load(folder, quantizer: str) -> None:
    """The projections are quantized, λ is not: λ's parameters load as the plain tensors that were saved, and DIFF
    V2's λ is the float64 equations' sigmoid(x · lambda_proj) on the quantized model's own inputs. With weights-only
    quantization the model computes the DiffLlama of its dequantized weights, far closer to it than quantizing moved
    the logits; bitsandbytes' 8-bit also rounds the activations (LLM.int8), so there the logits only stay near the
    unquantized model's. Greedy generation runs. (Run by quantization_worker.py.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    quantized = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization_configs()[quantizer]())
    attention = quantized.model.layers[0].self_attn
    q_proj = attention.q_proj
    assert type(q_proj) is not torch.nn.Linear or not is_plain_tensor(q_proj.weight)  # the test quantized something
    for name, param in attention.differential_lambda.named_parameters():
        saved = model.model.layers[0].self_attn.differential_lambda.get_parameter(name)
        assert is_plain_tensor(param) and torch.equal(param, saved), name

    input_ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    # Dequantized first: bitsandbytes' CPU kernels repack a 4-bit weight in place at its first forward.
    dequantized = dequantized_copy(model, quantized)
    with torch.no_grad():
        outputs = quantized(input_ids, output_hidden_states=True)
        unquantized = model(input_ids).logits
    assert torch.isfinite(outputs.logits).all()
    moved = (outputs.logits - unquantized).abs().max().item()
    if quantizer == "bnb-8bit":
        assert moved < 0.1 * unquantized.abs().max().item(), moved
    else:
        with torch.no_grad():
            expected = dequantized(input_ids).logits
        error = (outputs.logits - expected).abs().max().item()
        assert error < 0.1 * moved, (error, moved)
    if model.config.diff_version == 2:
        for layer, lambdas in zip(quantized.model.layers, quantized.differential_lambdas(outputs)):
            weight = layer.self_attn.differential_lambda.lambda_proj.weight
            with torch.no_grad():
                inputs = layer.input_layernorm(outputs.hidden_states[layer.self_attn.layer_idx])
            assert lambdas.dtype == torch.float32
            torch.testing.assert_close(lambdas.double(), torch.sigmoid(inputs.double() @ weight.double().T),
                                       rtol=0, atol=1e-5)
    generated = quantized.generate(input_ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 16)


def check_qlora(folder, adapter) -> None:
    """QLoRA as PEFT's guide runs it: a 4-bit base, `prepare_model_for_kbit_training`, `lora_config()`. Three steps
    train the LoRA weights and λ (in `modules_to_save`) and leave the quantized base as it was; the saved adapter,
    loaded onto a fresh 4-bit base, gives the trained model's logits."""
    from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    from diff_llama.training import lora_config, optimizer_for

    def quantized_base():
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization_configs()["bnb-4bit"]())

    model = get_peft_model(prepare_model_for_kbit_training(quantized_base()), lora_config())
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = optimizer_for(model, learning_rate=1e-2, lambda_learning_rate=1e-1)
    input_ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    model.train()
    for _ in range(3):
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss)
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert changed == trainable  # LoRA's weights and λ, nothing else
    assert any("lora_" in name for name in changed)
    assert any("differential_lambda.modules_to_save" in name for name in changed)

    model.eval().save_pretrained(adapter)
    loaded = PeftModel.from_pretrained(quantized_base(), adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=1e-5)


def in_worker(*arguments: str) -> str:
    """Run quantization_worker.py with the quantizers importable; its output."""
    assert QUANTIZERS_ASIDE.is_dir(), f"{QUANTIZERS_ASIDE} is missing: run bash scripts/setup_env.sh {sys.prefix} test"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(QUANTIZERS_ASIDE), str(HERE)])}
    out = subprocess.run([sys.executable, str(HERE / "quantization_worker.py"), *arguments], capture_output=True,
                         text=True, env=environment, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    return out.stdout


@pytest.mark.parametrize("version", [1, 2])
def test_a_quantized_load_keeps_lambda_exact_and_runs(tmp_path, version):
    """torchao's int8 weights and bitsandbytes' 4-bit and 8-bit (`check_quantized_load`; DIFF V2's forward once failed
    under torchao)."""
    output = in_worker("load", str(saved_model(tmp_path, version)[1]), *QUANTIZERS)
    assert [f"checked {quantizer}" for quantizer in QUANTIZERS] == output.split("\n")[-len(QUANTIZERS) - 1 : -1]


@pytest.mark.parametrize("version", [1, 2])
def test_qlora_trains_lambda_over_a_4bit_base_and_its_adapter_loads_again(tmp_path, version):
    """LoRA over bitsandbytes' 4-bit base, λ trained in full (`check_qlora`)."""
    output = in_worker("qlora", str(saved_model(tmp_path, version)[1]), str(tmp_path / "adapter"))
    assert output.endswith("checked qlora\n")


def test_a_float16_load_keeps_the_lambda_projection_in_float32(tmp_path):
    """`dtype=torch.float16` casts every weight but DIFF V2's λ projection (transformers' `_keep_in_fp32_modules`), and
    the model still computes λ from it in float32; bfloat16, whose range is float32's, casts it too, as transformers
    does for every model."""
    from transformers import AutoModelForCausalLM

    model, folder = saved_model(tmp_path, 2)
    input_ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    for dtype, lambda_dtype in [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)]:
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        attention = loaded.model.layers[0].self_attn
        assert attention.q_proj.weight.dtype == dtype
        assert attention.differential_lambda.lambda_proj.weight.dtype == lambda_dtype
        with torch.no_grad():
            outputs = loaded(input_ids, output_hidden_states=True)
        assert outputs.logits.dtype == dtype and torch.isfinite(outputs.logits).all()
        assert all(lambdas.dtype == torch.float32 for lambdas in loaded.differential_lambdas(outputs))
