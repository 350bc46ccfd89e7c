"""Where each LLaMA attention head goes in the converted DiffLlama.

A DiffLlama with H query heads has H/2 differential heads; differential head i subtracts map i + H/2 from map i
and reads the value pair (v_kv(i), v_kv(i + H/2)). A `HeadLayout` says, for every query position and every KV
position of the converted layer, which LLaMA head fills it (None: a zero head, used for padding).
"""

from dataclasses import dataclass

import torch


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


def gather_head_rows(weight: torch.Tensor, sources, head_dim: int) -> torch.Tensor:
    """Rows of a q/k/v projection, head by head (source head index, or zero rows for None)."""
    blocks = weight.view(-1, head_dim, *weight.shape[1:])
    zero = torch.zeros_like(blocks[0])
    return torch.cat([zero if s is None else blocks[s] for s in sources], dim=0)


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
