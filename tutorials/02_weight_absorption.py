# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. Weight absorption
#
# The naive tier (notebook 1) caches only the $c + r$ latent numbers per token, but every call
# up-projects the whole cache into per-head keys and values: for DeepSeek-V3 that is
# $h(d + v) = 32768$ numbers built per cached token per step, to score *one* new token. Section
# 2.1.2 of the DeepSeek-V2 paper notes that matrix associativity lets $W^{UK}$ be absorbed into
# the query and $W^{UV}$ into the output, so that attention runs over the latent itself. This
# notebook verifies that derivation one identity at a time, runs the absorbed tier against the
# naive one, and then counts what it saves and where it stops paying.

# %%
import matplotlib.pyplot as plt
import torch

import mla
from mla import memory, naive
from mla.absorbed import attend_absorbed

torch.manual_seed(0)
config = mla.MLAConfig.from_preset("tiny")
h, d, r, v, c, q = (config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                    config.v_head_dim, config.kv_lora_rank, config.q_lora_rank)
w = mla.MLAWeights(config, dtype=torch.float64, seed=0).requires_grad_(False)

# One new token (a decode step) over t = 12 cached tokens: the latents of all 12, the queries of
# the last one. The pieces come from mla.naive, exactly as the tiers compute them.
b, t = 2, 12
x = torch.randn(b, t, config.hidden_size, dtype=torch.float64)
positions, cos, sin = naive.positions_and_rope(w, torch.zeros(b, dtype=torch.int64), t,
                                               x.dtype, x.device)
kv_c, k_pe = naive.latent(w, x, cos, sin)                          # (b, t, c), (b, t, r)
c_q = naive.query_latent(w, x[:, -1:])                             # (b, 1, q)
q_nope = naive.query_nope(w, c_q)                                  # (b, 1, h, d)
q_pe = naive.query_rope(w, c_q, cos[:, -1:], sin[:, -1:])          # (b, 1, h, r)
print("kv_c", tuple(kv_c.shape), " k_pe", tuple(k_pe.shape), " q_nope", tuple(q_nope.shape),
      " q_pe", tuple(q_pe.shape))

# %% [markdown]
# ## Step 1: absorb $W^{UK}$ into the query
#
# The non-rotary part of head $i$'s score between the new token and cached token $j$ is
#
# $$ q_{i}^{C\,T} k_{j,i}^C = (W_i^{UQ} c^Q)^T (W_i^{UK} c_j^{KV})
#    = \underbrace{\left((W_i^{UK})^T q_i^C\right)^T}_{q^{\text{lat}}_i\ (c\text{ wide})} c_j^{KV}. $$
#
# The left side builds a $d$-wide key for every cached token and head; the right side multiplies
# the query once by $(W^{UK}_i)^T$ and then scores the cached latents directly.

# %%
k_nope = torch.einsum("btc,hdc->bthd", kv_c, w.W_UK)               # (b, t, h, d) built per token
lhs = torch.einsum("bshd,bthd->bsht", q_nope, k_nope)              # q_C · k_C
q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w.W_UK)             # (b, 1, h, c) built once
rhs = torch.einsum("bshc,btc->bsht", q_lat, kv_c)                  # (W_UK^T q_C) · c_KV
print("q_lat", tuple(q_lat.shape), " scores", tuple(lhs.shape),
      f" max |lhs - rhs| = {float((lhs - rhs).abs().max()):.1e}")
torch.testing.assert_close(rhs, lhs)  # float64: equal up to round-off (rtol, atol 1e-7)

# %% [markdown]
# ## Step 2: the rotary part cannot be absorbed, and does not need to be
#
# RoPE puts a position-dependent rotation $R_m$ between $W^{QR}$ and $W^{KR}$:
# $q^{R\,T} k^R_j = (R_m W^{QR} c^Q)^T R_{n_j} W^{KR} h_j$, and $R_m^T R_{n_j}$ changes with every
# pair of positions, so no fixed matrix can be folded. That is why MLA *decouples* RoPE: $r$
# extra dims per head for the query and one shared $r$-wide key, cached as is. The full score is
# the absorbed part plus the rotary part, and a softmax over it gives the naive tier's weights.

# %%
scale = config.softmax_scale
scores_naive = (lhs + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * scale
scores_absorbed = (rhs + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * scale
p = torch.softmax(scores_absorbed, dim=-1)                         # (b, 1, h, t)
print(f"max |scores_naive - scores_absorbed| = {float((scores_naive - scores_absorbed).abs().max()):.1e}")
torch.testing.assert_close(scores_absorbed, scores_naive)

# %% [markdown]
# ## Step 3: absorb $W^{UV}$ into the output
#
# $$ o_i = \sum_j p_{ij}\, W_i^{UV} c_j^{KV} = W_i^{UV} \underbrace{\Big(\sum_j p_{ij}\, c_j^{KV}\Big)}_{o^{\text{lat}}_i\ (c\text{ wide})} $$
#
# The probabilities weight the latent itself; $W^{UV}$ is applied once per new token instead of
# once per cached token.

# %%
values = torch.einsum("btc,hvc->bthv", kv_c, w.W_UV)               # (b, t, h, v) built per token
o_naive = torch.einsum("bsht,bthv->bshv", p, values)
o_lat = torch.einsum("bsht,btc->bshc", p, kv_c)                    # (b, 1, h, c)
o_absorbed = torch.einsum("bshc,hvc->bshv", o_lat, w.W_UV)
print("o_lat", tuple(o_lat.shape), f" max |o_naive - W_UV·o_lat| = "
      f"{float((o_naive - o_absorbed).abs().max()):.1e}")
torch.testing.assert_close(o_absorbed, o_naive)

# %% [markdown]
# What is left is **multi-query attention**: $h$ query heads of width $c + r$
# ($[q^{\text{lat}}_i; q^R_i]$) against a single key/value head of width $c + r$, whose value is
# the first $c$ dims of the same row. `mla.absorbed.attend_absorbed` is that, and the naive tier's
# `attend_up_projected` must agree with it once $W^{UV}$ is applied:

# %%
visible = naive.causal_mask(positions[:, -1:], t)                  # (b, 1, t): all visible
o_lat_lib = attend_absorbed(q_lat, q_pe, kv_c, k_pe, visible, scale)
o_up_lib = naive.attend_up_projected(w, q_nope, q_pe, kv_c, k_pe, visible, scale)
o_up_absorbed = torch.einsum("bshc,hvc->bshv", o_lat_lib, w.W_UV)
print(f"attend_absorbed vs our o_lat: {float((o_lat_lib - o_lat).abs().max()):.1e};  "
      f"W_UV·attend_absorbed vs attend_up_projected: "
      f"{float((o_up_absorbed - o_up_lib).abs().max()):.1e}")
torch.testing.assert_close(o_lat_lib, o_lat)
torch.testing.assert_close(o_up_absorbed, o_up_lib)

# %% [markdown]
# ## Step 4: multiplying the factors out
#
# Absorption can go one step further and multiply the matrices once: $W^{UQ}_i{}^T W^{UK}_i$
# maps the query latent straight to $q^{\text{lat}}_i$, and $W^{UV}_i{}^T W^{O}_i$ maps
# $o^{\text{lat}}_i$ straight to the hidden size. `AbsorbedMLA(precompute=True)` does that, and
# `absorbed_products()` returns the two products:

# %%
absorbed_pre = mla.build(w, "absorbed", precompute=True)
W_UQ_UK, W_UV_O = absorbed_pre.absorbed_products()
print("W_UQ·W_UK", tuple(W_UQ_UK.shape), " (h, q, c)     W_UV·W_O", tuple(W_UV_O.shape),
      " (h, c, hidden)")
q_lat_pre = torch.einsum("bsq,hqc->bshc", c_q, W_UQ_UK)
print(f"c_Q · (W_UQ·W_UK) vs q_lat: {float((q_lat_pre - q_lat).abs().max()):.1e}")
torch.testing.assert_close(q_lat_pre, q_lat)

# %% [markdown]
# Is that worth it? At DeepSeek-V3's sizes the products are larger than the factors they
# replace, and since $d = v = 128$ is smaller than both $c = 512$ and $q = 1536$, they also take
# *more* FLOPs per token: one matmul instead of two, nothing more. DeepSeek's own inference code
# keeps the factors (`precompute=False`, our default).

# %%
def factor_vs_product(cfg):
    h, d, v, c, q, x = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
                        cfg.q_lora_rank, cfg.hidden_size)
    return [("query: W_UQ, W_UK", h * d * q + h * d * c, 2 * (h * q * d + h * d * c)),
            ("query: W_UQ·W_UK", h * q * c, 2 * h * q * c),
            ("output: W_UV, W_O", h * v * c + x * h * v, 2 * (h * c * v + h * v * x)),
            ("output: W_UV·W_O", h * c * x, 2 * h * c * x)]

v3 = mla.MLAConfig.from_preset("deepseek-v3")
print(f"{'DeepSeek-V3, per layer':24s} {'values':>12s} {'FLOPs/token':>12s}")
for name, values_, flops in factor_vs_product(v3):
    print(f"{name:24s} {values_ / 1e6:>10.1f} M {flops / 1e6:>10.1f} M")
factors_q, product_q, factors_o, product_o = factor_vs_product(v3)
assert product_q[1:] > factors_q[1:] and product_o[1:] > factors_o[1:]  # more values, FLOPs

# %% [markdown]
# ## The absorbed tier against the naive tier
#
# Same weights, same calls: a ragged prefill, then decode steps. The absorbed tier's default
# sends prefill rows down the naive (up-projected) dataflow, the cheaper one there (see the
# crossover below), and absorbs decode rows; `prefill="absorbed"` absorbs everything.

# %%
def run(attn, steps):
    cache = attn.new_cache(b, 32)
    return torch.cat([attn(x_step, cache, lengths) for x_step, lengths in steps], dim=1)

gen = torch.Generator().manual_seed(1)
steps = [(torch.randn(b, 10, config.hidden_size, generator=gen, dtype=torch.float64),
          torch.tensor([10, 7]))]
steps += [(torch.randn(b, 1, config.hidden_size, generator=gen, dtype=torch.float64), None)
          for _ in range(6)]

reference = run(mla.build(w, "naive"), steps)
for options in ({}, {"prefill": "absorbed"}, {"precompute": True},
                {"precompute": True, "prefill": "absorbed"}):
    out = run(mla.build(w, "absorbed", **options), steps)
    print(f"absorbed {str(options):45s} vs naive: max |diff| = "
          f"{float((out - reference).abs().max()):.1e}")
    torch.testing.assert_close(out, reference)

# %% [markdown]
# ## What absorption saves: FLOPs and bytes
#
# `mla.memory.attention_flops(config, s, t)` counts one layer's attention FLOPs for $s$ new tokens
# over $t$ cached ones (the new ones included, causal), beyond the projections both dataflows
# share:
#
# $$ \text{up-projected} = 2\,t\,c\,h(d + v) + 2\,P\,h\,(d + r + v), \qquad
#    \text{absorbed} = 2\,s\,h\,c\,(d + v) + 2\,P\,h\,(2c + r), $$
#
# with $P = s(t - s) + s(s+1)/2$ the (query, key) pairs. Up-projection pays per *cached* token,
# absorption per *new* token but with wider heads ($2c + r = 1088$ against $d + r + v = 320$).
#
# Bytes per layer and sequence (bf16): both read the latent cache, $t(c + r)$ values; the
# up-projected dataflow also writes and reads back $t\,h\,(d + r + v)$ values of per-head keys and
# values (what `mla.memory` calls `mla-expanded`: the cache an implementation that caches after
# `kv_b_proj` would hold). V2 and V3 have the same attention sizes ($h = 128$, $c = 512$,
# $d = v = 128$, $r = 64$), so their rows coincide; V2-Lite has $h = 16$.

# %%
def cost_rows(preset, shapes, bytes_per_element=2):
    cfg = mla.MLAConfig.from_preset(preset)
    latent = memory.cache_elements_per_token(cfg, "mla")           # c + r
    expanded = memory.cache_elements_per_token(cfg, "mla-expanded")  # h (d + r + v)
    rows = []
    for kind, s, t in shapes:
        f = memory.attention_flops(cfg, s, t)
        cache_bytes = t * latent * bytes_per_element
        kv_bytes = 2 * t * expanded * bytes_per_element             # written, then read
        rows.append((preset, kind, s, t, f.up_projected / 1e9, f.absorbed / 1e9,
                     f.up_projected / f.absorbed, cache_bytes / 1e6,
                     (cache_bytes + kv_bytes) / 1e6))
    return rows

shapes = [("decode", 1, 4096), ("decode", 1, 32768), ("prefill", 4096, 4096),
          ("extend", 512, 32768)]
print(f"{'preset':17s} {'kind':8s} {'s':>6s} {'t':>6s} {'GFLOP up':>9s} {'GFLOP abs':>9s} "
      f"{'up/abs':>7s} {'MB abs':>8s} {'MB up':>8s}")
for preset in ("deepseek-v2", "deepseek-v3", "deepseek-v2-lite"):
    for row in cost_rows(preset, shapes):
        print(f"{row[0]:17s} {row[1]:8s} {row[2]:>6d} {row[3]:>6d} {row[4]:>9.2f} {row[5]:>9.2f} "
              f"{row[6]:>7.2f} {row[7]:>8.2f} {row[8]:>8.1f}")
decode = cost_rows("deepseek-v3", [("decode", 1, 4096)])[0]
print(f"\nV3 decode at t=4096: {decode[6]:.0f}x fewer FLOPs and {decode[8] / decode[7]:.0f}x fewer "
      f"bytes absorbed")
empty_cache_prefill = cost_rows("deepseek-v3", [("prefill", 4096, 4096)])[0]
assert decode[6] > 1 > empty_cache_prefill[6]  # absorb the decode step, up-project this prefill

# %% [markdown]
# For a decode step absorption needs ~117x fewer FLOPs and moves ~140x fewer bytes (V3 sizes):
# the up-projected keys and values are $h(d+r+v)/(c+r) = 71$ times the latent, and they are
# written and read.
# For a prefill on an empty cache it is the other way round: $t = s$, so both dataflows pay the
# same projection cost, $2sc\,h(d+v)$, and the up-projected heads are 3.4x narrower.
#
# ## Where absorption stops paying
#
# With $S$ new tokens over a context of $C$ cached ones ($t = C + S$), up-projection wins once
#
# $$ 2(C + S)\,c\,(d+v) + 2P(d+r+v) < 2S\,c\,(d+v) + 2P(2c+r). $$
#
# $h$ cancels, so the crossover depends on $c, d, r, v$ only: V2, V3 and V2-Lite share it. For a
# long context ($C \gg S$, $P \approx SC$) it tends to $S^* = c(d+v)/(2c - d - v) = 170.7$.
# `mla.memory.prefill_crossover(config, context)` finds the smallest $S$ by counting:

# %%
v2 = mla.MLAConfig.from_preset("deepseek-v2")
contexts = [0, 16, 64, 256, 1024, 4096, 16384, 65536, 131072]
crossover = {name: [memory.prefill_crossover(mla.MLAConfig.from_preset(name), C) for C in contexts]
             for name in ("deepseek-v2", "deepseek-v3", "deepseek-v2-lite", "tiny")}
for name, values_ in crossover.items():
    print(f"{name:17s}", values_)
limit = v2.kv_lora_rank * (v2.qk_nope_head_dim + v2.v_head_dim) / (
    2 * v2.kv_lora_rank - v2.qk_nope_head_dim - v2.v_head_dim)
print(f"long-context limit c(d+v)/(2c-d-v) = {limit:.1f}")
# h cancels: V2, V3 and V2-Lite share one curve, from 1 on an empty cache up to the limit
assert crossover["deepseek-v2"] == crossover["deepseek-v3"] == crossover["deepseek-v2-lite"]
assert crossover["deepseek-v2"][0] == 1 and max(crossover["deepseek-v2"]) == round(limit)

# %% [markdown]
# On an empty cache up-projection is cheaper at any length (crossover 1); as the context grows,
# a chunk needs more and more new tokens before up-projecting the context pays for itself, up
# to ~171. Below the curve, absorb; above it, up-project. Decode ($S = 1$) is far below it at
# any context, which is the whole point.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
ctx = [2 ** k for k in range(0, 18)]
ax1.plot(ctx, [memory.prefill_crossover(v2, C) for C in ctx], "o-", label="V2 / V3 / V2-Lite")
ax1.plot(ctx, [memory.prefill_crossover(config, C) for C in ctx], "s--", label="tiny")
ax1.axhline(limit, color="grey", lw=0.8, ls=":", label=f"limit {limit:.1f}")
ax1.set_xscale("log", base=2)
ax1.set_xlabel("cached context C (tokens)")
ax1.set_ylabel("new tokens S where up-projection wins")
ax1.fill_between(ctx, 0, [memory.prefill_crossover(v2, C) for C in ctx], alpha=0.12,
                 label="absorb (V2/V3)")
ax1.set_title("prefill_crossover(config, C)")
ax1.legend()

news = [2 ** k for k in range(0, 14)]
for C in (0, 1024, 8192, 65536):
    ratio = []
    for S in news:
        f = memory.attention_flops(v2, S, C + S)
        ratio.append(f.absorbed / f.up_projected)
    ax2.plot(news, ratio, "o-", ms=3, label=f"context {C}")
ax2.axhline(1.0, color="grey", lw=0.8)
ax2.set_xscale("log", base=2)
ax2.set_yscale("log")
ax2.set_xlabel("new tokens S")
ax2.set_ylabel("absorbed FLOPs / up-projected FLOPs")
ax2.set_title("DeepSeek-V2/V3: above 1, up-projection is cheaper")
ax2.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The ratio rises from ~1/117 at $S = 1$ to its ceiling $(2c + r)/(d + r + v) = 3.4$ for long
# chunks.
#
# The paged tier (notebook 3) applies this per row, with a measured threshold instead of the
# model's: decode rows (one new token) go to the absorbed Triton decode kernel; a prefill or
# extend row, under the default `prefill="auto"`, attends absorbed while it has fewer than
# `prefill_crossover` new tokens and is up-projected from there on. That threshold
# (`PREFILL_CROSSOVER` in mla/paged/layer.py) was timed on an H200 at V3 sizes over 4096 cached
# tokens (benchmarks/lab/prefill_crossover.py) and does not depend on the context; the FLOP count
# leaves out that the absorbed path's float32 scores over $c + r$-wide rows cost more than
# their FLOPs, and the up-projection (one GEMM) less:

# %%
paged = mla.build(mla.MLAWeights(config, dtype=torch.float32, seed=0), "paged")
print(f"paged tier, prefill={paged.prefill!r}: absorbed below {paged.prefill_crossover} new "
      f"tokens (measured); the FLOP model at C = 4096, V3 sizes: "
      f"{memory.prefill_crossover(mla.MLAConfig.from_preset('deepseek-v3'), 4096)}")
paths = {S: paged.prefill_path(S, 4096) for S in (2, paged.prefill_crossover - 1,
                                                  paged.prefill_crossover, 1024)}
print(paths)
assert [paths[S] == "absorbed" for S in paths] == [S < paged.prefill_crossover for S in paths]
