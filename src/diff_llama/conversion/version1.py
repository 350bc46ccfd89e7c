"""Version 1, the paper's differential attention: where each LLaMA head goes, how λ starts and what is calibrated.

A DiffLlama with H query heads has H/2 differential heads; differential head i subtracts map i + H/2 from map i
and reads the value pair (v_kv(i), v_kv(i + H/2)). A `HeadLayout` says, for every query position and every KV
position of the converted layer, which LLaMA head fills it (None: a zero head, used for padding): `expand_layout`
doubles the attention width, `split_layout` keeps it. λ starts at 0 (or the paper's initialisation), and the head
norm is absorbed by calibration on text (calibration.py) or estimated from the weights.
"""

from dataclasses import dataclass

import torch

from ..lambda_diff_llama import LAMBDA_VECTOR_NAMES, lambda_init_fn
from .base import LAMBDA_VECTORS, VersionConversion, attention_projections, gather_head_rows
from .calibration import CalibrationSettings, fold_head_norm_gain, weight_only_head_norm_eps
from .errors import ConversionError

# Options that shape only a version 1 conversion: given to a DIFF V2 conversion they would be silently ignored.
VERSION_1_OPTIONS = ("head_layout", "pad_odd_heads", "lambda_start", "calibration", "calibration_text",
                     "calibration_tokens", "head_norm_headroom")


@dataclass(frozen=True)
class HeadLayout:
    query_sources: tuple  # length H: LLaMA query head at each position, or None for a zero head
    kv_sources: tuple  # length G: LLaMA KV head at each position, or None for a zero KV head

    @property
    def num_heads(self) -> int:
        return len(self.query_sources)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_sources)

    def validate(self, source_heads: int, source_kv_heads: int) -> None:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if heads % 2 or heads % kv_heads:
            raise ValueError(f"layout has {heads} query heads over {kv_heads} KV heads: need even H and G | H")
        per_kv, source_per_kv = heads // kv_heads, source_heads // source_kv_heads
        if per_kv != source_per_kv:
            raise ValueError("a layout must keep the LLaMA's number of query heads per KV head")
        for position, source in enumerate(self.query_sources):
            kv_source = self.kv_sources[position // per_kv]
            if source is None:
                continue
            if kv_source != source // source_per_kv:
                raise ValueError(f"query position {position} holds LLaMA head {source} but its KV head is {kv_source}")
        used = [s for s in self.query_sources if s is not None]
        if sorted(used) != list(range(source_heads)):
            raise ValueError("every LLaMA query head must appear exactly once")


def split_layout(source_heads: int, source_kv_heads: int) -> HeadLayout:
    """Same width as the LLaMA: LLaMA head i is the first map of differential head i, head i + H/2 the second.

    Odd H gets one extra KV group of zero heads at the end (docs/conversion.md).
    """
    per_kv = source_heads // source_kv_heads
    groups = list(range(source_kv_heads))
    if source_heads % 2:
        groups.append(None)
    kv_sources = tuple(groups)
    query_sources = tuple(
        None if group is None else group * per_kv + offset for group in kv_sources for offset in range(per_kv)
    )
    return HeadLayout(query_sources, kv_sources)


def expand_layout(source_heads: int, source_kv_heads: int) -> HeadLayout:
    """Twice the LLaMA's attention width: every LLaMA head is the first map of a differential head of its own, whose
    second map and second value half start as zero heads. Nothing of the LLaMA is dropped."""
    per_kv = source_heads // source_kv_heads
    kv_sources = tuple(range(source_kv_heads)) + (None,) * source_kv_heads
    query_sources = tuple(range(source_heads)) + (None,) * source_heads
    assert len(query_sources) == per_kv * len(kv_sources)
    return HeadLayout(query_sources, kv_sources)


def make_layout(source_heads: int, source_kv_heads: int, options) -> HeadLayout | None:
    """Version 1's head layout, as `options` (a `ConversionOptions`) choose it; None for DIFF V2, whose layout is
    fixed (see version2.py)."""
    if options.diff_version == 2:
        return None
    if options.head_layout == "expand":
        layout = expand_layout(source_heads, source_kv_heads)
    elif options.head_layout == "split":
        if source_heads % 2 and not options.pad_odd_heads:
            raise ConversionError(
                f"the LLaMA has an odd number of query heads ({source_heads}), which cannot be split into pairs; "
                "allow padding with a zero KV group (drop --no-pad-odd-heads) or use --head-layout expand."
            )
        layout = split_layout(source_heads, source_kv_heads)
    else:
        raise ConversionError(f"unknown head layout {options.head_layout!r}; use 'expand' or 'split'.")
    layout.validate(source_heads, source_kv_heads)
    return layout


def permute_o_proj(o_proj: torch.Tensor, layout: HeadLayout, head_dim: int) -> torch.Tensor:
    """o_proj columns in DiffLlama's order.

    Differential head i outputs (A1 - λA2) [v_kv(i), v_kv(j)], j = i + H/2. With λ = 0 the first half stands in for
    the LLaMA head at position i and the second half for the head at position j, so each half keeps the o_proj
    columns that head was trained with (zero columns for a zero head).
    """
    half = layout.num_heads // 2
    hidden = o_proj.shape[0]
    o_blocks = o_proj.view(hidden, -1, head_dim)
    zero = torch.zeros(hidden, head_dim, dtype=o_proj.dtype)
    columns = []
    for i in range(half):
        for position in (i, i + half):
            source = layout.query_sources[position]
            columns.append(zero if source is None else o_blocks[:, source])
    return torch.cat(columns, dim=1)


def convert_attention_weights(
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    v_proj: torch.Tensor,
    o_proj: torch.Tensor,
    layout: HeadLayout,
    head_dim: int,
) -> dict:
    """LLaMA q/k/v/o weights rearranged into DiffLlama's layout."""
    return {
        "q_proj": gather_head_rows(q_proj, layout.query_sources, head_dim),
        "k_proj": gather_head_rows(k_proj, layout.kv_sources, head_dim),
        "v_proj": gather_head_rows(v_proj, layout.kv_sources, head_dim),
        "o_proj": permute_o_proj(o_proj, layout, head_dim),
    }


def zero_lambda_vectors(lambda_init: float, head_dim: int, dtype=torch.float32, seed: int = 0) -> dict:
    """λ vectors that give λ = 0 exactly, with a non-zero gradient for every vector, and that Adam moves slowly.

    λ = exp(q1·k1) - exp(q2·k2) + λ_init is 0 when q1·k1 = 0 and q2·k2 = b = log(1 + λ_init). All four vectors are
    non-zero, so dλ/dq1 = exp(q1·k1) k1 and the other three partial derivatives are non-zero: unlike all-zero
    vectors, this λ = 0 is not a saddle point and training can make the model differential.

    Each vector has one non-zero channel (q1 = 0.25 e_i, k1 = 0.25 e_j with i != j, q2 = k2 = sqrt(b) e_m). Adam's
    first steps move every channel with a non-zero gradient by about the learning rate whatever the gradient's size,
    and all channels of a vector pull λ the same way, so one step moves λ by about lr times the vectors' L1 norms:
    with dense vectors of norm 0.5-1 over 64 channels that is ~20 lr (0.2 per step at diff-llama train's λ learning
    rate 1e-2, enough to wreck a fresh conversion in 3 steps); with these it is 2·0.25 + 2·sqrt(b)·(1 + λ_init) < 3.3 lr.
    """
    generator = torch.Generator().manual_seed(seed)
    i, j, m = torch.randperm(head_dim, generator=generator)[:3].tolist()
    b = torch.log(torch.tensor(1.0 + lambda_init, dtype=torch.float64))
    q1, k1, q2, k2 = torch.zeros(4, head_dim, dtype=torch.float64)
    q1[i], k1[j] = 0.25, 0.25
    q2[m] = k2[m] = b.sqrt()
    vectors = {"lambda_q1": q1, "lambda_k1": k1, "lambda_q2": q2, "lambda_k2": k2}
    return {name: v.to(dtype) for name, v in vectors.items()}


class DiffV1Conversion(VersionConversion):
    """The paper's differential attention: LLaMA heads placed by a head layout, λ vectors started at 0 (or the paper's
    initialisation), and the head norm absorbed by calibration on text (lstsq or scale) or estimated from the weights."""

    added_tensors = LAMBDA_VECTORS

    def __init__(self, source_config, options, layout: HeadLayout):
        self.layout = layout
        self.query_sources, self.kv_sources = layout.query_sources, layout.kv_sources
        super().__init__(source_config, options)
        self.calibrating = options.calibration != "none"
        self.settings = CalibrationSettings(method=options.calibration, head_norm_headroom=options.head_norm_headroom)
        self.head_norm_eps = []  # per layer
        self._weight_only_eps = None  # of the layer in progress, without calibration text

    def heads(self) -> dict:
        return dict(num_attention_heads=self.layout.num_heads, num_key_value_heads=self.layout.num_kv_heads)

    def lambda_vectors(self, layer: int) -> dict:
        """The layer's four λ vectors, keyed by checkpoint name."""
        head_dim, seed = self.config.head_dim, self.options.seed + layer
        if self.options.lambda_start == "zero":
            vectors = zero_lambda_vectors(lambda_init_fn(layer), head_dim, seed=seed)
        else:
            generator = torch.Generator().manual_seed(seed)
            vectors = {name: torch.randn(head_dim, generator=generator) * self.config.lambda_std_dev
                       for name in LAMBDA_VECTOR_NAMES}
        return {f"self_attn.{name}": vector for name, vector in vectors.items()}

    def weight_only_calibration(self, converted: dict, layer: int) -> float | None:
        """Without calibration text: the head-norm epsilon estimated from the weights, its gain folded into o_proj (in
        `converted`, in place). Returns the epsilon, None when `--head-norm-headroom 0` keeps rms_norm_eps."""
        eps = weight_only_head_norm_eps(converted["self_attn.v_proj.weight"], converted["input_layernorm.weight"],
                                        self.options.head_norm_headroom)
        if eps is not None:
            o_proj = converted["self_attn.o_proj.weight"]
            converted["self_attn.o_proj.weight"] = fold_head_norm_gain(o_proj.float(), eps,
                                                                       lambda_init_fn(layer)).to(o_proj.dtype)
        return eps

    def streamed_tensors(self, layer, prefix, src, dtype):
        head_dim, layout = self.config.head_dim, self.layout
        attention = {
            "self_attn.o_proj.weight": permute_o_proj(src.get(prefix + "self_attn.o_proj.weight"), layout, head_dim),
            "self_attn.v_proj.weight": gather_head_rows(src.get(prefix + "self_attn.v_proj.weight"),
                                                        layout.kv_sources, head_dim),
            "input_layernorm.weight": src.get(prefix + "input_layernorm.weight"),
        }
        eps = self.weight_only_calibration(attention, layer)
        self.head_norm_eps.append(eps or self.source_config.rms_norm_eps)
        return {"self_attn.o_proj.weight": attention["self_attn.o_proj.weight"], **self.lambda_vectors(layer)}

    def convert_attention(self, layer, attention):
        converted = {f"self_attn.{name}.weight": tensor for name, tensor in
                     convert_attention_weights(*attention_projections(attention), self.layout,
                                               self.source_config.head_dim).items()}
        converted.update(self.lambda_vectors(layer))
        self._weight_only_eps = None
        if not self.calibrating:  # folded into o_proj before the layer is built, so that it runs what is written
            work = {**converted, "input_layernorm.weight": attention["input_layernorm.weight"]}
            self._weight_only_eps = self.weight_only_calibration(work, layer)
            converted["self_attn.o_proj.weight"] = work["self_attn.o_proj.weight"]
        return converted

    def fit_layer(self, layer, converted, runner, source_layer, converted_layer, dtype):
        diagnostics = None
        if self.calibrating:
            diagnostics = {"layer": layer, **runner.calibrate(source_layer, converted_layer, self.settings)}
            fitted = converted_layer.self_attn.o_proj.weight.detach()
            converted["self_attn.o_proj.weight"] = fitted.to(dtype)
            # continue the streams with exactly the weights that are written
            converted_layer.self_attn.o_proj.weight.data = converted["self_attn.o_proj.weight"].float()
        else:
            eps = self._weight_only_eps
            converted_layer.self_attn.head_norm.eps = eps if eps is not None else self.source_config.rms_norm_eps
        self.head_norm_eps.append(converted_layer.self_attn.head_norm.eps)
        return diagnostics

    def finish_config(self) -> None:
        rms_norm_eps = self.source_config.rms_norm_eps
        if self.head_norm_eps and self.head_norm_eps != [rms_norm_eps] * len(self.head_norm_eps):
            self.config.head_norm_eps = self.head_norm_eps
