"""Tier 2, absorbed: W_UK folded into the query, W_UV into the output; attention as MQA over the latent.

The naive score of head i between a new token and cached token j is

    q_C,i · k_C,j = (W^{UQ}_i c_Q)^T (W^{UK}_i c_KV,j) = ((W^{UK}_i)^T W^{UQ}_i c_Q)^T c_KV,j

so one (c)-wide "latent query" q_lat,i = (W^{UK}_i)^T q_C,i scores every cached latent directly:
no per-head key is ever built. Likewise the output of head i,

    o_i = sum_j p_ij W^{UV}_i c_KV,j = W^{UV}_i (sum_j p_ij c_KV,j) = W^{UV}_i o_lat,i,

so the probabilities weight the latent itself and W^{UV} is applied once per new token. What
remains is multi-query attention: h query heads of width c + r against one shared key/value
head of width c + r (the value is the first c dims of the same cached row). The FLOPs of each
path and option are worked out in docs/derivations/absorption.md.
"""

from __future__ import annotations

import torch

from .cache import LatentCache
from .config import MLAConfig
from .base import MLAAttention, check_bool, check_choice
from .naive import (attend_up_projected, causal_mask, latent, padding_mask, positions_and_rope,
                    query_latent, query_nope, query_rope)
from .weights import MLAWeights

PREFILL_MODES = ("up-project", "absorbed")


def absorption_flops(config: MLAConfig) -> dict[str, int]:
    """FLOPs (2 x multiply-adds) per decode token, all heads, of the absorbed path's query and
    output maps, for each `precompute` option:

        query_factors   2·h·q·d + 2·h·d·c         c_Q -> q_nope (W_UQ) -> q_lat (W_UK)
        query_product   2·h·q·c                   c_Q -> q_lat (W_UQ·W_UK)
        output_factors  2·h·c·v + 2·h·v·hidden    o_lat -> o (W_UV) -> y (W_O)
        output_product  2·h·c·hidden              o_lat -> y (W_UV·W_O)

    q is q_lora_rank, or hidden without query compression (the query's input is x itself).
    """
    h, d, v, c = config.num_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    hidden = config.hidden_size
    q = hidden if config.q_lora_rank is None else config.q_lora_rank
    return dict(query_factors=2 * h * q * d + 2 * h * d * c, query_product=2 * h * q * c,
                output_factors=2 * h * c * v + 2 * h * v * hidden,
                output_product=2 * h * c * hidden)


# --8<-- [start:attend_absorbed]
def attend_absorbed(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                    k_pe: torch.Tensor, visible: torch.Tensor, softmax_scale: float
                    ) -> torch.Tensor:
    """MQA over the latent: h query heads of width c + r, one key/value head, value = kv_c.

    q_lat (b, s, h, c), q_pe (b, s, h, r), kv_c (b, t, c), k_pe (b, t, r), visible (b, s, t)
    -> o_lat (b, s, h, c) in float32 or wider.
    """
    f32 = torch.promote_types(q_lat.dtype, torch.float32)
    # score_ij = q_lat,i · c_KV,j + q_R,i · k_R,j   (= q_C,i · k_C,j + q_R,i · k_R,j)
    scores = (torch.einsum("bshc,btc->bsht", q_lat.to(f32), kv_c.to(f32))
              + torch.einsum("bshr,btr->bsht", q_pe.to(f32), k_pe.to(f32)))  # (b, s, h, t)
    scores = scores.mul(softmax_scale).masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # The value is the latent itself: o_lat,i = sum_j p_ij c_KV,j
    return torch.einsum("bsht,btc->bshc", probs, kv_c.to(f32))
# --8<-- [end:attend_absorbed]


class AbsorbedMLA(MLAAttention):
    """MLA with weight absorption for decode rows; prefill rows up-project (or absorb, by option).

    A decode row absorbs: up-projecting would rebuild every cached token's keys and values for a
    single query (117x the FLOPs at V3 sizes over 4096 cached tokens). A long prefill row shares
    that up-projection among its queries, and each score is then 3.4x cheaper up-projected
    (d + r + v = 320 multiply-adds against 2c + r = 1088), so by default rows with more than one
    new token take the naive dataflow (`mla.memory.prefill_crossover` gives the break-even).

    Args:
        weights: the layer's MLAWeights (shared, not copied).
        precompute: True multiplies W_UQ·W_UK (h, q, c) and W_UV·W_O (h, c, hidden) once per
            call, so the query and the output take one matmul each instead of two. The products
            are never kept across calls, so they always follow the weights, however those are
            written, and gradients flow through them.
        prefill: "up-project" (rows with more than one new token take the naive dataflow) or
            "absorbed" (every row attends over the latent).
        process_group: tensor parallelism (see `mla.base.MLAAttention`).
    """

    tier = "absorbed"

    def __init__(self, weights: MLAWeights, *, precompute: bool = False,
                 prefill: str = "up-project", process_group=None):
        super().__init__(weights, process_group=process_group)
        self.precompute = check_bool("precompute", precompute)
        self.prefill = check_choice("prefill", prefill, PREFILL_MODES)

    # --8<-- [start:absorbed_products]
    def absorbed_products(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UQ·W_UK (h, q, c) and W_UV·W_O (h, c, hidden), from the current weights.

        Computed on every call, never cached: a cache could not see weights written through
        `param.data`, which no version counter records, and it would hold one call's autograd
        graph. The cost is the products' FLOPs once per call, whatever the batch.
        """
        w = self.weights
        W_UQ_UK = torch.einsum("hdq,hdc->hqc", w.W_UQ, w.W_UK)   # (h, q, c)
        W_UV_O = torch.einsum("hvc,xhv->hcx", w.W_UV, w.W_O)     # (h, c, hidden)
        return W_UQ_UK, W_UV_O
    # --8<-- [end:absorbed_products]

    def forward(self, x: torch.Tensor, cache: LatentCache, lengths=None) -> torch.Tensor:
        lengths = self.check_inputs(x, cache, lengths)
        w = self.weights
        b, s, _ = x.shape

        # The query and the latent are the naive tier's, eqs. (37)-(43).
        positions, cos, sin = positions_and_rope(w, cache, s, x.dtype, x.device)
        c_q = query_latent(w, x)                                  # (b, s, q)
        q_pe = query_rope(w, c_q, cos, sin)                       # (b, s, h, r)
        kv_c_normed, k_pe_new = latent(w, x, cos, sin)            # (b, s, c), (b, s, r)

        cache.append(kv_c_normed, k_pe_new, lengths)
        t = int(cache.seq_lens.max())
        kv_c, k_pe = cache.kv_c[:, :t], cache.k_pe[:, :t]         # (b, t, c), (b, t, r)
        visible = causal_mask(positions, t)                       # (b, s, t)
        real = padding_mask(lengths, s, x.device)                 # (b, s, 1, 1)

        # Decode rows absorb; with prefill="up-project", longer rows up-project. Each path
        # returns this rank's heads' share of W_O o; the shares are summed over the process
        # group once for the whole call, whichever paths ran (every rank reaches it once).
        up_project = (lengths > 1) if self.prefill == "up-project" else torch.zeros_like(lengths,
                                                                                      dtype=bool)
        y = x.new_zeros(b, s, self.config.hidden_size)
        for rows, attend in ((~up_project & (lengths > 0), self._absorbed),
                             (up_project, self._up_projected)):
            if bool(rows.any()):
                i = torch.nonzero(rows).flatten().to(x.device)
                y[i] = attend(c_q[i], q_pe[i], kv_c[i], k_pe[i], visible[i], real[i])
        y = self.reduce_and_bias(y)                               # all-reduce, o_proj's bias
        return torch.where(real[..., 0], y, 0.0)

    # --8<-- [start:absorbed_path]
    def _absorbed(self, c_q, q_pe, kv_c, k_pe, visible, real) -> torch.Tensor:
        w = self.weights
        if self.precompute:
            W_UQ_UK, W_UV_O = self.absorbed_products()
            q_lat = torch.einsum("bsq,hqc->bshc", c_q, W_UQ_UK)     # (b, s, h, c)
        else:
            # Absorb W_UK into the query: q_lat,i = (W^{UK}_i)^T q_C,i
            q_lat = torch.einsum("bshd,hdc->bshc", query_nope(w, c_q), w.W_UK)
        o_lat = attend_absorbed(q_lat, q_pe, kv_c, k_pe, visible, self.softmax_scale)
        o_lat = torch.where(real, o_lat, 0.0).to(c_q.dtype)       # (b, s, h, c)
        if self.precompute:
            return torch.einsum("bshc,hcx->bsx", o_lat, W_UV_O)     # W_UV and W_O in one
        # Absorb W_UV on the way out: o_i = W^{UV}_i o_lat,i, then eq. (47) (forward reduces)
        o = torch.einsum("bshc,hvc->bshv", o_lat, w.W_UV)           # (b, s, h, v)
        return torch.einsum("bshv,xhv->bsx", o, w.W_O)
    # --8<-- [end:absorbed_path]

    def _up_projected(self, c_q, q_pe, kv_c, k_pe, visible, real) -> torch.Tensor:
        o = attend_up_projected(self.weights, query_nope(self.weights, c_q), q_pe, kv_c, k_pe,
                                visible, self.softmax_scale)
        o = torch.where(real, o, 0.0).to(c_q.dtype)
        return torch.einsum("bshv,xhv->bsx", o, self.weights.W_O)  # eq. (47); forward reduces
