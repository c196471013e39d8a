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
# # 1. From the paper to the code: the naive tier
#
# DeepSeek-V2 (arXiv:2405.04434) writes Multi-head Latent Attention out in full in its
# appendix C, equations (37)-(47). `mla.naive` is that appendix as code, one function per block.
# This notebook calls those functions one at a time on the `tiny` preset, prints every shape,
# and at the end checks the whole layer against transformers' `DeepseekV3Attention` with the
# same weights.
#
# Shape letters, the same all over the package: $b$ batch, $s$ new tokens, $t$ cached tokens,
# $h$ heads, $d$ the per-head query/key width without position (`qk_nope_head_dim`), $r$ the
# rotary width (`qk_rope_head_dim`), $v$ the value width, $c$ the KV latent (`kv_lora_rank`),
# $q$ the query latent (`q_lora_rank`).
#
# How the paper's symbols map onto ours: $d_c = c$, $d_c' = q$, $d_h^R = r$, $n_h = h$, and the
# paper's $d_h$ is both our $d$ and our $v$ (they are equal in every released checkpoint, not in
# `tiny`).

# %%
import torch

import mla
from mla import naive

torch.manual_seed(0)
torch.set_printoptions(precision=4, sci_mode=False)

config = mla.MLAConfig.from_preset("tiny")
h, d, r, v, c, q = (config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                    config.v_head_dim, config.kv_lora_rank, config.q_lora_rank)
print(config)
print(f"h={h} d={d} r={r} v={v} c={c} q={q} hidden={config.hidden_size}")

# %% [markdown]
# ## The weights
#
# `mla.MLAWeights` holds one layer's parameters under the names of HF's checkpoints, and exposes
# the paper's matrices as per-head *views* of them (no copies). Random weights here, seeded; a
# real checkpoint loads with `MLAWeights.from_pretrained(path)`. We work in float64 so that every
# comparison below is exact to ~1e-12.

# %%
w = mla.MLAWeights(config, dtype=torch.float64, seed=0).requires_grad_(False)
for name, p in w.state_dict().items():
    print(f"{name:28s} {tuple(p.shape)}")
print()
for name in ("W_UQ", "W_QR", "W_DKV", "W_KR", "W_UK", "W_UV", "W_O"):
    print(f"{name:5s} {tuple(getattr(w, name).shape)}")

# %% [markdown]
# `q_b_proj` is $[W^{UQ}; W^{QR}]$ stacked per head, `kv_a_proj_with_mqa` is $[W^{DKV}; W^{KR}]$
# and `kv_b_proj` is $[W^{UK}; W^{UV}]$ per head. A view is a view: writing to `W_UK` would write
# to `kv_b_proj.weight`.

# %%
assert w.W_UK.data_ptr() == w.kv_b_proj.weight.data_ptr()
assert torch.equal(w.W_UK[1], w.kv_b_proj.weight[(d + v) * 1:(d + v) * 1 + d])

# %% [markdown]
# ## An input, its positions and the rotary angles
#
# Two sequences of five tokens each, on an empty cache: positions $0..4$. `positions_and_rope`
# turns the cache's `seq_lens` into positions and returns $\cos(m\theta_i)$, $\sin(m\theta_i)$ for
# the $r/2$ rotary pairs, YaRN included (the `tiny` preset has it on).

# %%
b, s = 2, 5
x = torch.randn(b, s, config.hidden_size, dtype=torch.float64)     # the paper's h_t
seq_lens = torch.zeros(b, dtype=torch.int64)                        # nothing cached yet
positions, cos, sin = naive.positions_and_rope(w, seq_lens, s, x.dtype, x.device)
print("x", tuple(x.shape), " positions", tuple(positions.shape), " cos", tuple(cos.shape))
print(positions)

# %% [markdown]
# ## The query: equations (37)-(40)
#
# $$c_t^Q = W^{DQ} h_t \tag{37}$$
#
# The query is first compressed into a $q$-wide latent. The checkpoints add an RMSNorm
# (`q_a_layernorm`) that the paper leaves out; `query_latent` applies it.

# %%
c_q = naive.query_latent(w, x)
print("c_Q", tuple(c_q.shape), "  (b, s, q)")

# %% [markdown]
# $$[q_{t,1}^C; q_{t,2}^C; \dots; q_{t,n_h}^C] = q_t^C = W^{UQ} c_t^Q \tag{38}$$
#
# Up-projection into $h$ heads of width $d$. In einsum letters: `bsq,hdq->bshd`. We check head 1
# against a plain matrix product with that head's slice of `W_UQ`.

# %%
q_nope = naive.query_nope(w, c_q)
print("q_C", tuple(q_nope.shape), "  (b, s, h, d)")
assert torch.allclose(q_nope[:, :, 1], c_q @ w.W_UQ[1].T)

# %% [markdown]
# $$[q_{t,1}^R; q_{t,2}^R; \dots; q_{t,n_h}^R] = q_t^R = \mathrm{RoPE}(W^{QR} c_t^Q) \tag{39}$$
#
# The *decoupled* rotary query: $r$ more dims per head, the only part of the query that sees the
# position.

# %%
q_pe = naive.query_rope(w, c_q, cos, sin)
print("q_R", tuple(q_pe.shape), "  (b, s, h, r)")

# %% [markdown]
# RoPE is a rotation of $r/2$ pairs, so a score between a rotated query at position $m$ and a
# rotated key at position $n$ depends on $m - n$ only. DeepSeek rotates *neighbouring* pairs
# $(x_0, x_1), (x_2, x_3), \dots$; we check the relative-position property with `mla.rope` itself
# (YaRN's attention factor scales cos and sin, so both sides carry it equally). The angles are
# computed in float32, as the checkpoints were trained, so the three agree to ~1e-7, not 1e-16.

# %%
from mla.rope import apply_rope, rope_cos_sin

qv, kv_vec = torch.randn(r, dtype=torch.float64), torch.randn(r, dtype=torch.float64)
def rotated_score(m, n):
    cm, sm = rope_cos_sin(config, torch.tensor(m), torch.float64)
    cn, sn = rope_cos_sin(config, torch.tensor(n), torch.float64)
    return float(apply_rope(qv, cm, sm) @ apply_rope(kv_vec, cn, sn))
print([round(rotated_score(m, n), 6) for m, n in [(7, 3), (20, 16), (150, 146)]])

# %% [markdown]
# $$q_{t,i} = [q_{t,i}^C; q_{t,i}^R] \tag{40}$$
#
# The code never concatenates: a dot product of two concatenations is the sum of the two dot
# products, and keeping the parts apart is what lets the absorbed tier treat them differently.
#
# ## The latent: equations (41) and (43), what the cache keeps
#
# $$c_t^{KV} = W^{DKV} h_t \tag{41}$$
# $$k_t^R = \mathrm{RoPE}(W^{KR} h_t) \tag{43}$$
#
# One projection (`kv_a_proj_with_mqa`) computes both; `kv_a_layernorm` normalises the latent.
# $k^R$ is a single rotary key shared by all heads. These $c + r$ numbers per token are the whole
# KV cache.

# %%
kv_c_normed, k_pe = naive.latent(w, x, cos, sin)
print("c_KV", tuple(kv_c_normed.shape), "  (b, s, c)")
print("k_R ", tuple(k_pe.shape), "  (b, s, r)")
print(f"cached per token: c + r = {config.latent_dim} numbers; "
      f"MHA would cache 2·h·(d + r) = {2 * h * (d + r)}")

# %% [markdown]
# ## Attention: equations (42), (44)-(46)
#
# $$[k_{t,1}^C; \dots; k_{t,n_h}^C] = k_t^C = W^{UK} c_t^{KV} \tag{42}$$
# $$k_{t,i} = [k_{t,i}^C; k_t^R] \tag{44}$$
# $$[v_{t,1}^C; \dots; v_{t,n_h}^C] = v_t^C = W^{UV} c_t^{KV} \tag{45}$$
# $$o_{t,i} = \sum_{j=1}^{t} \mathrm{Softmax}_j\left(\frac{q_{t,i}^T k_{j,i}}{\sqrt{d_h + d_h^R}}\right) v_{j,i}^C \tag{46}$$
#
# `attend_up_projected` does all four: it up-projects every cached latent into per-head keys and
# values (that is the expensive part the absorbed tier removes), scores, masks causally,
# softmaxes and sums. The keys it builds internally are these:

# %%
k_nope = torch.einsum("btc,hdc->bthd", kv_c_normed, w.W_UK)
values = torch.einsum("btc,hvc->bthv", kv_c_normed, w.W_UV)
print("k_C", tuple(k_nope.shape), "  (b, t, h, d)    v_C", tuple(values.shape), "  (b, t, h, v)")

# %% [markdown]
# The softmax scale is $1/\sqrt{d + r}$, times $\text{mscale}^2$ under YaRN (from
# `mscale_all_dim`), as HF and DeepSeek's code do. With nothing cached before, $t = s$ and the
# causal mask is lower-triangular.

# %%
visible = naive.causal_mask(positions, s)                              # (b, s, t)
print("softmax scale", config.softmax_scale, " vs (d + r)^-0.5 =", (d + r) ** -0.5)
print("visible[0]\n", visible[0].int())
o = naive.attend_up_projected(w, q_nope, q_pe, kv_c_normed, k_pe, visible, config.softmax_scale)
print("o", tuple(o.shape), "  (b, s, h, v)")

# %% [markdown]
# Equation (46) for one score, by hand: head 2, query token 4, key token 1, from the pieces above.
# The rotary key is the same for every head.

# %%
i, tq, tk = 2, 4, 1
score = (q_nope[0, tq, i] @ k_nope[0, tk, i] + q_pe[0, tq, i] @ k_pe[0, tk]) * config.softmax_scale
scores_row = ((q_nope[0, tq, i] @ k_nope[0, :tq + 1, i].T + q_pe[0, tq, i] @ k_pe[0, :tq + 1].T)
              * config.softmax_scale)
p = torch.softmax(scores_row, dim=-1)
print("score", float(score), " softmax weights", p)
assert torch.allclose(p @ values[0, :tq + 1, i], o[0, tq, i])

# %% [markdown]
# ## The output: equation (47)
#
# $$u_t = W^O [o_{t,1}; o_{t,2}; \dots; o_{t,n_h}] \tag{47}$$

# %%
attn = mla.build(w, "naive")
u = attn.output_projection(o)
print("u", tuple(u.shape), "  (b, s, hidden)")

# %% [markdown]
# ## The same through the layer
#
# `NaiveMLA.forward` is exactly the sequence above, plus the cache write between (43) and (42).
# Every tier has the same call: `cache = attn.new_cache(b, max_len)`, `y = attn(x, cache)`.

# %%
cache = attn.new_cache(batch_size=b, max_seq_len=16)
y = attn(x, cache)
print("y", tuple(y.shape), " cache.kv_c", tuple(cache.kv_c.shape), " seq_lens", cache.seq_lens)
print("max |y - u| =", float((y - u).abs().max()))
assert torch.allclose(y, u, atol=1e-12)

# %% [markdown]
# The cache makes decoding incremental: feeding the same five tokens as a prefill of three and
# two single-token decodes gives the same outputs, because position $j$ only ever attends to
# positions $\le j$.

# %%
cache = attn.new_cache(b, 16)
pieces = [attn(x[:, :3], cache), attn(x[:, 3:4], cache), attn(x[:, 4:5], cache)]
print("prefill 3 + decode + decode, max diff:", float((torch.cat(pieces, 1) - y).abs().max()))

# %% [markdown]
# Rows of different lengths share one call through `lengths` (right padding); padded positions
# come back as zeros and are not cached.

# %%
cache = attn.new_cache(b, 16)
y_ragged = attn(x, cache, lengths=torch.tensor([5, 2]))
print("seq_lens", cache.seq_lens.tolist(), " row 1 padded outputs are zero:",
      bool((y_ragged[1, 2:] == 0).all()), " real ones match:",
      bool(torch.allclose(y_ragged[1, :2], y[1, :2])))

# %% [markdown]
# ## Swapping the tier
#
# The three tiers are built from the same weights with one argument; notebook 2 derives why the
# absorbed tier computes the same thing without ever building $k^C$ or $v^C$. By default the
# absorbed tier sends prefill rows (more than one new token) down this naive dataflow, because it
# is cheaper there, so its prefill output is bit-identical; `prefill="absorbed"` forces the
# absorbed dataflow and differs by round-off only. The paged tier's kernels take bf16, fp16 or
# fp32, so it gets a float32 copy of the same weights (same seed, same values).

# %%
y_absorbed = mla.build(w, "absorbed")(x, attn.new_cache(b, 16))
print(f"absorbed                    vs naive: max |diff| = {float((y_absorbed - y).abs().max()):.1e}")
forced = mla.build(w, "absorbed", prefill="absorbed")
print(f"absorbed, prefill=absorbed  vs naive: "
      f"max |diff| = {float((forced(x, forced.new_cache(b, 16)) - y).abs().max()):.1e}")
w32 = mla.MLAWeights(config, dtype=torch.float32, seed=0).requires_grad_(False)
paged = mla.build(w32, "paged", block_size=4)
y_paged = paged(x.float(), paged.new_cache(b, 16))
print(f"paged (float32)             vs naive: max |diff| = {float((y_paged - y).abs().max()):.1e}")

# %% [markdown]
# ## Against an outside reference: transformers' DeepseekV3Attention
#
# HF's implementation is written independently of ours. We build it offline from our config
# (`to_hf_dict` spells the fields as a `config.json` would; the MoE fields are required by the
# config class but unused by attention), copy our weights into it by name, and compare over 80
# tokens, past the YaRN preset's `original_max_position_embeddings` of 64.

# %%
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

transformers.logging.set_verbosity_error()
fields = config.to_hf_dict()
fields.update(vocab_size=32, num_hidden_layers=1, intermediate_size=32, moe_intermediate_size=16,
              n_routed_experts=4, num_experts_per_tok=2, num_key_value_heads=config.num_heads)
hf_config = transformers.DeepseekV3Config(**fields)
hf_config._attn_implementation = "eager"
hf_attn = hf_v3.DeepseekV3Attention(hf_config, layer_idx=0).double().eval()
hf_rope = hf_v3.DeepseekV3RotaryEmbedding(hf_config)
hf_attn.load_state_dict(w.state_dict())           # our names are HF's names
print(sorted(hf_attn.state_dict()) == sorted(w.state_dict()))

# %%
def hf_forward(x):
    """HF's causal attention over whole rows x (b, s, hidden)."""
    b, s, _ = x.shape
    position_ids = torch.arange(s)[None].expand(b, s)
    mask = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)[None, None].expand(b, 1, s, s)
    out, _ = hf_attn(x, position_embeddings=hf_rope(x, position_ids), attention_mask=mask)
    return out

s_long = 80
x_long = torch.randn(b, s_long, config.hidden_size, dtype=torch.float64)
with torch.no_grad():
    ref = hf_forward(x_long)
    ours = attn(x_long, attn.new_cache(b, s_long))
    # chunked prefill then decode steps: the same numbers
    cache = attn.new_cache(b, s_long)
    steps = [attn(x_long[:, :50], cache)] + [attn(x_long[:, j:j + 1], cache)
                                             for j in range(50, s_long)]
rel = lambda a, b: float((a - b).norm() / b.norm())
print(f"one prefill        vs HF: relative error {rel(ours, ref):.1e}")
print(f"prefill 50 + 30x1  vs HF: relative error {rel(torch.cat(steps, 1), ref):.1e}")
assert rel(ours, ref) < 1e-6 and rel(torch.cat(steps, 1), ref) < 1e-6

# %% [markdown]
# Why $10^{-7}$ and not $10^{-16}$ in float64: HF's `DeepseekV3RMSNorm` always normalises in
# float32 (`hidden_states.to(torch.float32)`), ours in float32 *or wider*. The two RMSNorms on the
# latents are the only place the two implementations round differently; the rotary tables agree
# exactly.

# %%
with torch.no_grad():
    latent_in = w.kv_a_proj_with_mqa(x_long)[..., :c]
    print("kv_a_layernorm, ours vs HF's, max |diff|:",
          f"{float((w.kv_a_layernorm(latent_in) - hf_attn.kv_a_layernorm(latent_in)).abs().max()):.1e}")

# %% [markdown]
# ### Why the interleaved RoPE matters
#
# HF's class can also rotate the rotary dims as two halves, Llama's `rotate_half`
# ($(x_0, x_{r/2}), (x_1, x_{r/2+1}), \dots$). That is still a perfectly good RoPE, and a model
# trained with it would work, but it is not what DeepSeek's checkpoints were trained with: flip
# the switch and the same weights give a different layer.

# %%
hf_config.rope_interleave = False
with torch.no_grad():
    print(f"rotate-half RoPE vs ours: relative error {rel(ours, hf_forward(x_long)):.2f}")
hf_config.rope_interleave = True

# %% [markdown]
# The naive tier agrees with HF to float32 round-off, in one prefill and in chunked decode. That is
# the anchor: notebook 2 tests the absorbed tier against this one, notebook 3 the paged tier
# against the absorbed.
