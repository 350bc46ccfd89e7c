"""Calibration and evaluation that run layer by layer, so memory stays at one layer plus activations.

Two token streams go through the model together:
- calibration text through the converted layers, where each layer's o_proj is refitted (least squares) so that its
  attention output matches the LLaMA's attention output on the same input;
- held-out text through both models, for the quality report (perplexity of each, KL between them).
"""

import math
import re
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from ..errors import UserError
from ..lambda_diff_llama import LAMBDA_CHECKPOINT_RENAMES
from ..modeling_diff_llama import (
    DiffLlamaDecoderLayer,
    DiffLlamaRMSNorm,
    DiffLlamaRotaryEmbedding,
)

BATCH = 4  # sequences per forward pass


def _module_name(checkpoint_name: str) -> str:
    """A layer's checkpoint name -> its module name, by the modeling file's own renaming (the λ vectors live in
    `self_attn.differential_lambda` in memory)."""
    for pattern, replacement in LAMBDA_CHECKPOINT_RENAMES.items():
        checkpoint_name = re.sub(pattern, replacement, "." + checkpoint_name)[1:]
    return checkpoint_name


@dataclass
class CalibrationSettings:
    method: str = "lstsq"  # "lstsq": per-layer least-squares o_proj; "scale": per-head scale only
    head_norm_headroom: float = 0.01  # r: head-norm epsilon set to (heads' mean square) / r; 0 keeps rms_norm_eps
    ridge: float = 1e-3


def head_norm_epsilon(mean_square: float, headroom: float) -> float:
    """The head norm's epsilon for heads of this mean square: mean_square / headroom, to 4 significant digits (the
    value the config stores and the calibration continues with)."""
    return float(f"{mean_square / headroom:.4g}")


def weight_only_head_norm_eps(v_proj: torch.Tensor, input_norm: torch.Tensor, headroom: float) -> float | None:
    """The head-norm epsilon without calibration text: the heads' mean square estimated from the weights alone.

    An attention output averages value vectors, so its mean square is at most the values' (Jensen); with the
    normalised hidden state of unit variance per channel, a value row k has mean square sum_c W_kc² w_c² (w: the
    input norm's weight). `v_proj` is in the converted layout (zero rows included). None when nothing is estimated.
    """
    if headroom <= 0:
        return None
    mean_square = (v_proj.double().pow(2) @ input_norm.double().pow(2)).mean().item()
    return head_norm_epsilon(mean_square, headroom) if mean_square > 0 else None


def fold_head_norm_gain(o_proj: torch.Tensor, eps: float, lambda_init: float) -> torch.Tensor:
    """o_proj times the inverse of the near-linear head norm's gain (1 - λ_init) / sqrt(eps)."""
    return o_proj * (math.sqrt(eps) / (1 - lambda_init))


def _sequences(ids: torch.Tensor, seq_len: int, max_tokens: int, plus_one: bool, stream: str) -> torch.Tensor:
    """Sequences of `seq_len` tokens (plus the next one, to score it, with `plus_one`) from the first `max_tokens` of
    `ids`; `stream` (calibration, eval) names the options that set them, for the error when not one fits."""
    count = min(max_tokens, len(ids) - int(plus_one)) // seq_len
    if count < 1:
        needed = seq_len + int(plus_one)
        if max_tokens < needed:
            raise UserError(f"one {stream} sequence takes {needed} tokens (--seq-len {seq_len}) and --{stream}-tokens "
                            f"is {max_tokens}: raise it to {needed} or more, or lower --seq-len")
        raise UserError(f"one {stream} sequence takes {needed} tokens (--seq-len {seq_len}) and the {stream} text has "
                        f"{len(ids)}: give a longer --{stream}-text, or lower --seq-len")
    width = seq_len + int(plus_one)
    return torch.stack([ids[i * seq_len : i * seq_len + width] for i in range(count)])


class LayerwiseRunner:
    """Holds the hidden states of the streams and pushes them through one layer at a time."""

    def __init__(self, source_config, diff_config, embed: torch.Tensor, calibration_ids, held_out_ids, seq_len=512,
                 calibration_tokens=8192, eval_tokens=2048):
        self.source_config = source_config
        self.diff_config = diff_config
        self.calibrating = calibration_ids is not None
        self.evaluating = held_out_ids is not None
        embed = embed.float()
        positions = torch.arange(seq_len)[None]
        probe = torch.zeros(1, dtype=torch.float32)
        self.source_rope = LlamaRotaryEmbedding(source_config)(probe, positions)
        self.diff_rope = DiffLlamaRotaryEmbedding(diff_config)(probe, positions)
        if self.calibrating:
            self.calibration = embed[_sequences(calibration_ids, seq_len, calibration_tokens, False, "calibration")]
        if self.evaluating:
            windows = _sequences(held_out_ids, seq_len, eval_tokens, True, "eval")
            self.eval_targets = windows[:, 1:]
            self.eval_source = embed[windows[:, :-1]]
            self.eval_converted = self.eval_source.clone()

    @staticmethod
    def _run(layer, hidden, rope):
        return torch.cat([layer(hidden[i : i + BATCH], position_embeddings=rope) for i in range(0, len(hidden), BATCH)])

    def build_layers(self, layer_idx, source_tensors: dict, converted_tensors: dict):
        source = LlamaDecoderLayer(self.source_config, layer_idx)
        source.load_state_dict({k: v.float() for k, v in source_tensors.items()})
        converted = DiffLlamaDecoderLayer(self.diff_config, layer_idx)
        converted.load_state_dict({_module_name(k): v.float() for k, v in converted_tensors.items()})
        return source.eval(), converted.eval()

    @torch.no_grad()
    def calibrate(self, source, converted, settings: CalibrationSettings) -> dict:
        """Set the converted layer's head-norm epsilon and refit its o_proj, in place; returns per-layer diagnostics."""
        attention = converted.self_attn
        captured = {}
        hooks = [
            attention.head_norm.register_forward_hook(lambda m, inputs, out: captured.setdefault("z", []).append(inputs[0])),
            attention.o_proj.register_forward_hook(lambda m, inputs, out: captured.setdefault("f", []).append(inputs[0])),
        ]
        try:
            normed = [converted.input_layernorm(self.calibration[i : i + BATCH]) for i in range(0, len(self.calibration), BATCH)]

            def head_outputs():
                captured.clear()
                for chunk in normed:
                    attention(chunk, self.diff_rope, None)
                return torch.cat(captured["z"]), torch.cat(captured["f"])

            z, _ = head_outputs()
            mean_square = z.pow(2).mean().item()
            if settings.head_norm_headroom > 0 and mean_square > 0:
                # RMSNorm(x) = x / sqrt(mean(x²) + eps) is nearly linear, x / sqrt(eps), where mean(x²) is well below
                # eps: the norm then keeps each head's per-token magnitude, which the LLaMA relied on. The epsilon is
                # raised to meet the heads' natural scale (it goes into the config), so every weight keeps the LLaMA's
                # scale and fine-tunes like it; o_proj absorbs the norm's gain 1 / sqrt(eps) below.
                attention.head_norm.eps = head_norm_epsilon(mean_square, settings.head_norm_headroom)
            eps = attention.head_norm.eps
            head_rms = z.pow(2).mean(-1).add(eps).sqrt().mean((0, 1))  # per differential head
            scale = head_rms / (1 - attention.differential_lambda.lambda_init)
            weight = attention.o_proj.weight
            weight.copy_((weight.view(weight.shape[0], -1, weight.shape[1] // len(scale)) * scale[None, :, None]).view_as(weight))
            diagnostics = {"head_norm_eps": eps, "head_mean_square": mean_square, "mean_head_rms": head_rms.mean().item()}

            if settings.method == "lstsq":
                _, features = head_outputs()
                gram = torch.zeros(weight.shape[1], weight.shape[1], dtype=torch.float64)
                cross = torch.zeros(weight.shape[1], weight.shape[0], dtype=torch.float64)
                target_energy = 0.0
                for chunk, feature in zip(normed, features.split(BATCH)):
                    target, _ = source.self_attn(chunk, self.source_rope, None)
                    f = feature.reshape(-1, feature.shape[-1]).double()
                    t = target.reshape(-1, target.shape[-1]).double()
                    gram += f.T @ f
                    cross += f.T @ t
                    target_energy += t.pow(2).sum().item()
                ridge = settings.ridge * gram.diagonal().mean()
                prior = weight.double().T
                eye = torch.eye(gram.shape[0], dtype=torch.float64)
                solution = torch.linalg.solve(gram + ridge * eye, cross + ridge * prior)
                residual = target_energy - 2 * (solution * cross).sum() + (solution * (gram @ solution)).sum()
                weight.copy_(solution.T.to(weight.dtype))
                diagnostics["attention_fit_r2"] = 1 - residual.item() / max(target_energy, 1e-30)
        finally:
            for hook in hooks:
                hook.remove()
        return diagnostics

    @torch.no_grad()
    def advance(self, source, converted):
        if self.calibrating:
            self.calibration = self._run(converted, self.calibration, self.diff_rope)
        if self.evaluating:
            self.eval_source = self._run(source, self.eval_source, self.source_rope)
            self.eval_converted = self._run(converted, self.eval_converted, self.diff_rope)

    @torch.no_grad()
    def quality(self, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float) -> dict:
        """Held-out perplexity of source and converted model and the mean per-token KL(source || converted)."""
        norm = DiffLlamaRMSNorm(norm_weight.shape[0], eps=eps)
        norm.weight.data = norm_weight.float()
        lm_head = lm_head.float()

        def logits(hidden):
            return norm(hidden) @ lm_head.T

        nll_source = nll_converted = kl = 0.0
        count = 0
        for b in range(len(self.eval_targets)):
            for start in range(0, self.eval_targets.shape[1], 128):
                targets = self.eval_targets[b, start : start + 128]
                log_p = torch.log_softmax(logits(self.eval_source[b, start : start + 128]), -1)
                log_q = torch.log_softmax(logits(self.eval_converted[b, start : start + 128]), -1)
                nll_source -= log_p.gather(-1, targets[:, None]).sum().item()
                nll_converted -= log_q.gather(-1, targets[:, None]).sum().item()
                kl += (log_p.exp() * (log_p - log_q)).sum().item()
                count += len(targets)
        return {
            "source_perplexity": math.exp(nll_source / count),
            "converted_perplexity": math.exp(nll_converted / count),
            "kl_source_to_converted": kl / count,
            "eval_tokens": count,
        }
