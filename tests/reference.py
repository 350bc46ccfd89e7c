"""An independent float64 reference of DiffLlama written from the equations in docs/maths.md.

It reads only the state dict and the config, loops over heads explicitly and shares no code with the model, so
that a layout mistake in the model (wrong head pairing, wrong value half, wrong λ_init) cannot hide in both.
"""

import math

import torch


def rms_norm(x, eps, weight=None):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope(x, positions, theta):
    """x: (T, d), positions: (T,). rotate_half convention: channel c pairs with c + d/2.

    The frequencies are rounded to float32 as transformers stores them (every LLaMA checkpoint was trained with
    them); everything after that is float64.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    inv_freq = inv_freq.double()
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    rotated = torch.cat([-x[:, d // 2 :], x[:, : d // 2]], -1)
    return x * cos + rotated * sin


def lambda_init(layer):
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def layer_lambda(sd, prefix, layer):
    g = lambda name: sd[f"{prefix}.self_attn.lambda_{name}"].double()
    lam = torch.exp(g("q1") @ g("k1")) - torch.exp(g("q2") @ g("k2")) + lambda_init(layer)
    return lam if lam.requires_grad else lam.item()  # a tensor only where a test differentiates the reference


def softmax_maps(q, k, allowed, d):
    """q: (T, d), k: (S, d), allowed: (T, S) bool -> (T, S) softmax map."""
    scores = (q @ k.T) / math.sqrt(d)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1)


def checkpoint_state_dict(model):
    """The model's weights under their checkpoint names (what save_pretrained writes), e.g. `self_attn.lambda_q1`."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def v1_attention(sd, p, layer, x_normed, qs, ks, vs, allowed, d, eps):
    """Version 1: differential head i pairs maps i and i + H/2 over the value pair (v_kv(i), v_kv(i + H/2)), a scalar
    λ per layer, a per-head RMSNorm and the (1 - λ_init) factor. Returns the heads' outputs and (A1, A2) per head."""
    H, G = len(qs), len(vs)
    n_rep = H // G
    lam = layer_lambda(sd, p, layer)
    heads, layer_maps = [], []
    for i in range(H // 2):
        j = i + H // 2
        a1 = softmax_maps(qs[i], ks[i // n_rep], allowed, d)
        a2 = softmax_maps(qs[j], ks[j // n_rep], allowed, d)
        value_pair = torch.cat([vs[i // n_rep], vs[j // n_rep]], -1)
        out = (a1 - lam * a2) @ value_pair
        heads.append((1 - lambda_init(layer)) * rms_norm(out, eps))
        layer_maps.append((a1, a2))
    return heads, (layer_maps, lam)


def v2_attention(sd, p, layer, x_normed, qs, ks, vs, allowed, d, eps):
    """DIFF V2: O_m = A_m v_kv(m) for every map m; differential head i is O_2i − λ_{t,i} O_2i+1 with
    λ_{t,i} = sigmoid(x_t · lambda_proj[i]); no head norm. Returns the heads' outputs and (A_2i, A_2i+1, λ_i) per head."""
    H, G = len(qs), len(vs)
    n_rep = H // G
    lambda_proj = sd[f"{p}.self_attn.lambda_proj.weight"]
    heads, layer_maps = [], []
    for i in range(H // 2):
        a, b = 2 * i, 2 * i + 1
        a1 = softmax_maps(qs[a], ks[a // n_rep], allowed, d)
        a2 = softmax_maps(qs[b], ks[b // n_rep], allowed, d)
        lam = torch.sigmoid(x_normed @ lambda_proj[i])  # (T,)
        heads.append(a1 @ vs[a // n_rep] - lam[:, None] * (a2 @ vs[b // n_rep]))
        layer_maps.append((a1, a2, lam))
    return heads, layer_maps


def reference_forward(config, state_dict, input_ids, attention_mask=None, return_maps=False):
    """Logits (B, T, V) in float64 for a DiffLlamaForCausalLM state dict (either `diff_version`); optionally the
    per-layer maps and λ (see `v1_attention` and `v2_attention`). Differentiable in the weights that require grad.

    Padding follows transformers' conventions: a padded key is never attended to; positions count from 0 at the
    first real token of each row (left padding), as `generate` does.
    """
    # Weights that require grad (a test's leaves) stay in the graph: the reference's gradients are then autograd's
    # through these equations.
    sd = {k: (v if v.requires_grad else v.detach()).double() for k, v in state_dict.items()}
    H, G = config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim
    eps = config.rms_norm_eps
    theta = config.rope_parameters["rope_theta"]
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, T, dtype=torch.long)
    embed = sd["model.embed_tokens.weight"]
    lm_head = sd["lm_head.weight"] if "lm_head.weight" in sd and not config.tie_word_embeddings else embed
    all_logits, maps = [], []
    for b in range(B):
        keep = attention_mask[b].bool()
        positions = (attention_mask[b].cumsum(0) - 1).clamp(min=0)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        allowed = causal & keep[None, :]
        allowed = allowed | ~keep[:, None]  # a padded query row attends to everything; its output is ignored
        x = embed[input_ids[b]]
        row_maps = []
        for layer in range(config.num_hidden_layers):
            p = f"model.layers.{layer}"
            h = rms_norm(x, eps, sd[f"{p}.input_layernorm.weight"])
            q = h @ sd[f"{p}.self_attn.q_proj.weight"].T
            k = h @ sd[f"{p}.self_attn.k_proj.weight"].T
            v = h @ sd[f"{p}.self_attn.v_proj.weight"].T
            qs = [rope(q[:, i * d : (i + 1) * d], positions, theta) for i in range(H)]
            ks = [rope(k[:, g * d : (g + 1) * d], positions, theta) for g in range(G)]
            vs = [v[:, g * d : (g + 1) * d] for g in range(G)]
            attention = v2_attention if getattr(config, "diff_version", 1) == 2 else v1_attention
            heads, layer_maps = attention(sd, p, layer, h, qs, ks, vs, allowed, d, eps)
            row_maps.append(layer_maps)
            x = x + torch.cat(heads, -1) @ sd[f"{p}.self_attn.o_proj.weight"].T
            h = rms_norm(x, eps, sd[f"{p}.post_attention_layernorm.weight"])
            gate = h @ sd[f"{p}.mlp.gate_proj.weight"].T
            up = h @ sd[f"{p}.mlp.up_proj.weight"].T
            x = x + (gate * torch.sigmoid(gate) * up) @ sd[f"{p}.mlp.down_proj.weight"].T
        x = rms_norm(x, eps, sd["model.norm.weight"])
        all_logits.append(x @ lm_head.T)
        maps.append(row_maps)
    logits = torch.stack(all_logits)
    return (logits, maps) if return_maps else logits


def grouped_query_attention(query, key, value, allowed):
    """One attention call as DIFF V2 makes it, before the pairs are subtracted: query (B, H, q, d), keys and values
    (B, G, k, d), `allowed` (B, 1, q, k) bool -> (B, q, H, d) in float64; query head h reads key/value head
    h // (H/G), as `v2_attention` does."""
    batch, heads, _, d = query.shape
    n_rep = heads // key.shape[1]
    query, key, value = query.double(), key.double(), value.double()
    return torch.stack([
        torch.stack([softmax_maps(query[b, h], key[b, h // n_rep], allowed[b, 0], d) @ value[b, h // n_rep]
                     for h in range(heads)], dim=1)
        for b in range(batch)])
