"""Tier 2, absorbed: W_UK folded into the query, W_UV into the output; attention as MQA over the latent.

The naive score of head i between a new token and cached token j is

    q_C,i · k_C,j = (W^{UQ}_i c_Q)^T (W^{UK}_i c_KV,j) = ((W^{UK}_i)^T W^{UQ}_i c_Q)^T c_KV,j

so one (c)-wide "latent query" q_lat,i = (W^{UK}_i)^T q_C,i scores every cached latent directly:
no per-head key is ever built. Likewise the output of head i,

    o_i = sum_j p_ij W^{UV}_i c_KV,j = W^{UV}_i (sum_j p_ij c_KV,j) = W^{UV}_i o_lat,i,

so the probabilities weight the latent itself and W^{UV} is applied once per new token. What
remains is multi-query attention: h query heads of width c + r against one shared key/value
head of width c + r (the value is the first c dims of the same cached row).

Decode rows attend this way and prefill rows, by default, up-project: the class docstring of
`AbsorbedMLA` gives the FLOPs per token of both paths.

`precompute=True` multiplies the factors once, W_UQ·W_UK (h, q, c) and W_UV·W_O (h, c, hidden),
so that the query and the output take one matmul each instead of two. This is the paper's
literal reading of absorption, but it does not save FLOPs: the products are wider than the
factors. Per decode token, all heads (`absorption_flops` computes these; V3: h 128, q 1536,
c 512, d 128, v 128, hidden 7168):

                  factors                              product
    query    2·h·q·d + 2·h·d·c      = 50.3M + 16.8M =  67M    2·h·q·c      = 201M
    output   2·h·c·v + 2·h·v·hidden = 16.8M + 235M  = 252M    2·h·c·hidden = 940M

and the products hold 101M + 470M values against the factors' 34M + 126M, all read once per
decode step, so they cost bytes too. A product is cheaper only when the head width passes
q·c/(q+c) (query; 384 at V3) or c·hidden/(c+hidden) (output; 478), far above DeepSeek's 128.
What precomputing buys is one GEMM a side instead of two (fewer kernel launches, no (b, s, h, d)
or (b, s, h, v) intermediate), which can pay only in small layers where launches dominate; here
it shows (and the tests check) that the folded matrices give the same outputs. DeepSeek's
inference code applies the factors per call (`precompute=False`, our default).
"""

from __future__ import annotations

import torch

from .cache import LatentCache
from .config import MLAConfig
from .base import MLAAttention
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

    Why each path where it is: FLOPs of the attention beyond the projections both paths share,
    for one new token over t cached ones, per head (`mla.memory.attention_flops` counts them
    exactly; c kv_lora_rank, d nope, r rope, v value width):

        up-projected  2·t·c·(d+v)     kv_b_proj over the whole cache, every call
                      + 2·t·(d+r+v)   MHA scores and values
        absorbed      2·c·(d+v)       W_UK into the query and W_UV on the output, once a token
                      + 2·t·(2c+r)    MQA over the (c + r)-wide latent, value = its first c

    Decode (one new token) pays the up-projection of all t cached tokens for a single query:
    at V3 sizes and t = 4096 that is 137.8 GFLOPs a token up-projected against 1.17 GFLOPs
    absorbed (117x fewer). A prefill of s tokens shares the up-projection among its s queries,
    and then the per-score cost decides: 2c + r = 1088 against d + r + v = 320, 3.4x. A
    4096-token prefill costs 201M FLOPs a token up-projected against 604M absorbed (3x more),
    so `prefill="up-project"` (the default) sends every row with more than one new token down
    the naive dataflow. By this count up-projection wins from about 168 new tokens over a
    4096-token context (`mla.memory.prefill_crossover`); the paged tier measures its own
    threshold. For the `precompute` option's FLOPs see the module docstring.

    Args:
        weights: the layer's MLAWeights (shared, not copied).
        precompute: multiply W_UQ·W_UK and W_UV·W_O once (refreshed when the weights change)
            instead of applying the factors per call.
        prefill: "up-project" (rows with more than one new token take the naive dataflow,
            cheaper for long chunks) or "absorbed" (every row attends over the latent).
        process_group: tensor parallelism (see `mla.base.MLAAttention`).
    """

    tier = "absorbed"

    def __init__(self, weights: MLAWeights, *, precompute: bool = False,
                 prefill: str = "up-project", process_group=None):
        super().__init__(weights, process_group=process_group)
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        self.precompute = bool(precompute)
        self.prefill = prefill
        self._products: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    # --8<-- [start:absorbed_products]
    def absorbed_products(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UQ·W_UK (h, q, c) and W_UV·W_O (h, c, hidden), recomputed after any weight update."""
        w = self.weights
        sources = (w._q_heads, w.kv_b_proj.weight, w.o_proj.weight)
        stamp = tuple((t.data_ptr(), t._version) for t in sources)
        if self._products is None or self._products[0] != stamp:
            W_UQ_UK = torch.einsum("hdq,hdc->hqc", w.W_UQ, w.W_UK)   # (h, q, c)
            W_UV_O = torch.einsum("hvc,xhv->hcx", w.W_UV, w.W_O)     # (h, c, hidden)
            self._products = (stamp, W_UQ_UK, W_UV_O)
        return self._products[1], self._products[2]
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
