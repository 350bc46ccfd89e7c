"""A Transformers LLaMA written as a GGUF file the way llama.cpp's converter writes one (its published conventions,
re-stated here): float32 tensors under GGUF's names, the query and key rows of each head reordered from halves to
interleaved pairs (weights and biases alike), biases where the model has them, and RoPE scaling as the file carries
it: Llama 3's ("llama3") as `rope_freqs.weight`, one divisor per frequency; linear as metadata. No vocabulary: the
tests that use these files convert without evaluation."""

import math
from pathlib import Path

import numpy as np
import torch

BLOCK_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def interleave_rotary_halves(tensor: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's RoPE rotates adjacent pairs, transformers' rotates halves: each head's rows are reordered."""
    return tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(
        tensor.shape)


def llama3_rope_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3's RoPE scaling as one divisor per frequency, from the published formula."""
    frequencies = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    original = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for frequency in frequencies:
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_llama_gguf(model, path: Path, extra_tensors: dict | None = None, rope_metadata: dict | None = None,
                     skip: tuple = (), file_type: bool = True) -> Path:
    """Write `model` (a LlamaForCausalLM) to `path`; `extra_tensors` adds tensors under their GGUF names, `skip`
    leaves some out, `rope_metadata` sets `llama.rope.scaling.*` fields ({"type": "linear", "factor": 2.0}), and
    `file_type=False` leaves out `general.file_type` (which llama.cpp writes; other writers may not)."""
    import gguf

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(str(path), "llama")
    if file_type:
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for key, value in (rope_metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_float32
        add(f"llama.rope.scaling.{key}", value)

    def tensor(name, value):
        if name not in skip:
            writer.add_tensor(name, np.ascontiguousarray(value.detach().to(torch.float32).numpy()))

    state = model.state_dict()
    tensor("token_embd.weight", state["model.embed_tokens.weight"])
    tensor("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        tensor("output.weight", state["lm_head.weight"])
    if rope.get("rope_type") == "llama3":
        tensor("rope_freqs.weight", torch.from_numpy(llama3_rope_divisors(rope, head_dim)))
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in BLOCK_TENSORS.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{layer}.{hf_name}.{kind}"
                if key not in state:
                    continue
                value = state[key].to(torch.float32).numpy()
                if gguf_name in ("attn_q", "attn_k"):
                    value = interleave_rotary_halves(value, heads if gguf_name == "attn_q" else kv_heads)
                tensor(f"blk.{layer}.{gguf_name}.{kind}", torch.from_numpy(np.ascontiguousarray(value)))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
