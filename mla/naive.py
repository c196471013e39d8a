"""Tier 1, naive: the paper's dataflow, einsum by einsum.

DeepSeek-V2 (arXiv:2405.04434), section 2.1 and appendix C, "Full Formulas of MLA". Equation
numbers below are appendix C's (37)-(47); section 2.1 writes the same as (9)-(19). Two RMSNorms
that the paper leaves out sit on the two latents in every checkpoint (q_a_layernorm,
kv_a_layernorm); we apply them where the checkpoints do.

What is cached: c_KV (normed, c numbers a token) and k_R (r numbers), nothing per head. Every
call up-projects the whole cached latent into per-head keys and values, which is exactly what
the absorbed tier avoids.

Shapes: b batch, s new tokens, t cached tokens (after this call's append), h heads, d nope dim,
r rope dim, v value dim, c kv_lora_rank, q q_lora_rank, x hidden (in einsum strings only).
"""

from __future__ import annotations

import torch

from .cache import LatentCache
from .base import MLAAttention
from .rope import apply_rope, rope_cos_sin
from .weights import MLAWeights


# ---- the query: eqs. (37)-(40) -------------------------------------------------------------
# --8<-- [start:query]
def query_latent(w: MLAWeights, x: torch.Tensor) -> torch.Tensor:
    """Eq. (37): c_Q = W^{DQ} h, then q_a_layernorm. (b, s, hidden) -> (b, s, q).

    Without query compression (q_lora_rank None, V2-Lite) the "latent" is the hidden state
    itself and W_UQ, W_QR map from hidden (the paper's W^Q).
    """
    if w.config.q_lora_rank is None:
        return x
    return w.q_a_layernorm(w.q_a_proj(x))


def query_nope(w: MLAWeights, c_q: torch.Tensor) -> torch.Tensor:
    """Eq. (38): q_C = W^{UQ} c_Q, per head. (b, s, q) -> q_nope (b, s, h, d)."""
    return torch.einsum("bsq,hdq->bshd", c_q, w.W_UQ)


def query_rope(w: MLAWeights, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> torch.Tensor:
    """Eq. (39): q_R = RoPE(W^{QR} c_Q), per head. (b, s, q), cos/sin (b, s, r/2) -> (b, s, h, r).

    Eq. (40), q = [q_C; q_R], is kept as the two parts: the score adds their dot products.
    """
    q_pe = torch.einsum("bsq,hrq->bshr", c_q, w.W_QR)
    return apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
# --8<-- [end:query]


# ---- the latent: eqs. (41) and (43), what the cache keeps ----------------------------------
# --8<-- [start:latent]
def latent(w: MLAWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (41): c_KV = W^{DKV} h (then kv_a_layernorm); eq. (43): k_R = RoPE(W^{KR} h).

    One projection, kv_a_proj_with_mqa, computes both: (b, s, hidden) -> (b, s, c + r).
    Returns kv_c_normed (b, s, c) and k_pe (b, s, r): the c + r numbers a token caches.
    """
    c = w.config.kv_lora_rank
    kv = w.kv_a_proj_with_mqa(x)  # (b, s, c+r)
    kv_c_normed = w.kv_a_layernorm(kv[..., :c])
    k_pe = apply_rope(kv[..., c:], cos, sin)  # one rope key for all heads
    return kv_c_normed, k_pe
# --8<-- [end:latent]


# --8<-- [start:attend_up_projected]
def attend_up_projected(w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor,
                       kv_c: torch.Tensor, k_pe: torch.Tensor, visible: torch.Tensor,
                       softmax_scale: float) -> torch.Tensor:
    """Eqs. (42), (44)-(46): attention with keys and values up-projected from the cached latent.

    q_nope (b, s, h, d), q_pe (b, s, h, r), kv_c (b, t, c), k_pe (b, t, r), visible (b, s, t)
    -> o (b, s, h, v) in float32 or wider.
    """
    # Eq. (42): k_C = W^{UK} c_KV and eq. (45): v_C = W^{UV} c_KV, per head, for every cached
    # token: h·(d+v) numbers a token materialised from c.
    k_nope = torch.einsum("btc,hdc->bthd", kv_c, w.W_UK)        # (b, t, h, d)
    v = torch.einsum("btc,hvc->bthv", kv_c, w.W_UV)             # (b, t, h, v)

    # Eqs. (44), (46): k = [k_C; k_R], softmax_j(q_i·k_j / sqrt(d + r)); q·k = q_C·k_C + q_R·k_R,
    # and the rope key k_R is shared by all heads.
    f32 = torch.promote_types(q_nope.dtype, torch.float32)
    scores = (torch.einsum("bshd,bthd->bsht", q_nope.to(f32), k_nope.to(f32))
              + torch.einsum("bshr,btr->bsht", q_pe.to(f32), k_pe.to(f32)))  # (b, s, h, t)
    scores = scores * softmax_scale
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bsht,bthv->bshv", probs, v.to(f32))  # (b, s, h, v)
# --8<-- [end:attend_up_projected]


def positions_and_rope(w: MLAWeights, cache: LatentCache | torch.Tensor, s: int,
                       dtype: torch.dtype, device: torch.device):
    """Positions of the new tokens, seq_lens[i] + j: (b, s) int64, and their cos/sin (b, s, r/2).

    `cache` is the LatentCache the tokens go into, or its seq_lens (b,) int64 on the CPU.
    """
    seq_lens = cache if isinstance(cache, torch.Tensor) else cache.seq_lens
    positions = seq_lens[:, None] + torch.arange(s)  # (b, s)
    positions = positions.to(device)
    cos, sin = rope_cos_sin(w.config, positions, dtype)
    return positions, cos, sin


def causal_mask(positions: torch.Tensor, t: int) -> torch.Tensor:
    """(b, s, t) bool: key position j is visible to the query at position p iff j <= p."""
    keys = torch.arange(t, device=positions.device)
    return keys[None, None, :] <= positions[:, :, None]


def padding_mask(lengths: torch.Tensor, s: int, device: torch.device) -> torch.Tensor:
    """(b, s, 1, 1) bool: True at real tokens, False at right padding."""
    real = torch.arange(s)[None, :] < lengths[:, None]
    return real.to(device)[:, :, None, None]


class NaiveMLA(MLAAttention):
    """The paper's MLA: cache the latent, up-project it into per-head keys and values every call.

    Compute runs in float32 or wider (softmax included) whatever the parameter dtype; the output
    is cast back to the input's dtype.
    """

    tier = "naive"

    # --8<-- [start:forward]
    def forward(self, x: torch.Tensor, cache: LatentCache, lengths=None) -> torch.Tensor:
        lengths = self.check_inputs(x, cache, lengths)
        w = self.weights
        b, s, _ = x.shape

        positions, cos, sin = positions_and_rope(w, cache, s, x.dtype, x.device)
        c_q = query_latent(w, x)                                  # (37) (b, s, q)
        q_nope = query_nope(w, c_q)                               # (38) (b, s, h, d)
        q_pe = query_rope(w, c_q, cos, sin)                       # (39) (b, s, h, r)
        kv_c_normed, k_pe_new = latent(w, x, cos, sin)            # (41), (43) (b, s, c), (b, s, r)

        cache.append(kv_c_normed, k_pe_new, lengths)
        t = int(cache.seq_lens.max())
        kv_c, k_pe = cache.kv_c[:, :t], cache.k_pe[:, :t]         # (b, t, c), (b, t, r)

        o = attend_up_projected(w, q_nope, q_pe, kv_c, k_pe, causal_mask(positions, t),
                                self.softmax_scale)               # (42), (44)-(46) (b, s, h, v)
        real = padding_mask(lengths, s, x.device)                 # (b, s, 1, 1)
        o = torch.where(real, o, 0.0).to(x.dtype)

        # Eq. (47): u = W^O [o_1; ...; o_h]
        y = self.output_projection(o)                             # (b, s, hidden)
        return torch.where(real[..., 0], y, 0.0)
    # --8<-- [end:forward]
