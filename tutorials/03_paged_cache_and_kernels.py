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
# # 3. The paged cache and the kernels
#
# The paged tier is the production path: the same math as the absorbed tier (notebook 2), with
# the latent kept in fixed-size pages handed out by an allocator, new tokens written by the
# `concat_and_cache` kernel, and decode done by a Triton split-KV kernel. This notebook takes
# each piece apart on the CPU: the allocator and its block tables, the slot mapping, the
# concat-and-cache write, the Triton decode (run by Triton's interpreter here), the split-KV
# log-sum-exp merge by hand, and finally the whole paged tier against the absorbed tier.
#
# Everything runs in float32: Triton's CPU interpreter computes `tl.dot` on bf16 wrongly, so bf16
# belongs on a GPU (where the kernel is tested in bf16).

# %%
import inspect
import math

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap

import mla
from mla.kernels import (concat_and_cache, concat_and_cache_reference, mla_decode,
                         mla_decode_reference)
from mla.kernels.decode import choose_num_kv_splits, default_config
from mla.kernels.extension import concat_backend
from mla.paged import OutOfBlocksError, PagedLatentCache

torch.manual_seed(0)
print("Triton interpreter:", __import__("os").environ.get("TRITON_INTERPRET"),
      " CUDA:", torch.cuda.is_available())

# %% [markdown]
# ## Pages, block tables, slots
#
# One tensor holds every page: `kv_cache` of shape (num_blocks, n, c + r), one row of $c + r$
# values a token (`kv_c_normed`, then `k_pe`). Sequence $i$'s token at position `pos` lives in page
# `block_table[i, pos // n]`, row `pos % n`; its *slot* is the row index in the flattened cache:
#
# $$\text{slot} = \text{block\_table}[i, \lfloor pos / n \rfloor] \cdot n + pos \bmod n.$$
#
# A small cache: 4 rows (sequences), pages of $n = 4$ tokens, a pool of 24 pages, latent
# $c = 32$, $r = 8$ (the `tiny` preset's).

# %%
c, r, n = 32, 8, 4
cache = PagedLatentCache(batch_size=4, max_seq_len=40, kv_lora_rank=c, rope_dim=r,
                         block_size=n, num_blocks=24)
print(cache)
print("kv_cache", tuple(cache.kv_cache.shape), " block_table", tuple(cache.block_table.shape),
      " free pages", cache.num_free_blocks)

# %% [markdown]
# `append(kv_c, k_pe, seq_ids, new_lens)` takes the new tokens of several rows, laid out row after
# row; it allocates the pages they need (lazily: a page is taken when the next token does not
# fit), builds the slot mapping, writes the rows with `concat_and_cache`, and bumps `seq_lens`.
# It returns the slot mapping it used. A prefill of 6, 3 and 9 tokens:

# %%
def tokens(count):
    """Random latent rows, kv_c (T, c) and k_pe (T, r), as views of one (T, c + r) tensor."""
    rows = torch.randn(count, c + r)
    return rows[:, :c], rows[:, c:]

slots = cache.append(*tokens(6 + 3 + 9), seq_ids=[0, 1, 2], new_lens=[6, 3, 9])
print("slots   ", slots.tolist())
print("seq_lens", cache.seq_lens.tolist())
print("block_table\n", cache.block_table)

# %% [markdown]
# Now the life of a server: sequences decode one token at a time (interleaved, so their later
# pages are interleaved in the pool), sequence 1 finishes and is freed, and a new sequence takes
# its row and, first, its pages (the free list hands out the most recently freed page first).

# %%
for step in range(7):
    cache.append(*tokens(3), seq_ids=[0, 1, 2], new_lens=[1, 1, 1])
print("after 7 decode steps: seq_lens", cache.seq_lens.tolist(),
      " free", cache.num_free_blocks)
print("row 1 holds pages", cache.blocks_of(1))
cache.free(1)
print("freed row 1: free", cache.num_free_blocks, " next pages out:", cache.free_blocks[-3:][::-1])
slots_new = cache.append(*tokens(14), seq_ids=[1], new_lens=[14])
cache.append(*tokens(5), seq_ids=[3], new_lens=[5])
print("new row 1 holds pages", cache.blocks_of(1), " row 3", cache.blocks_of(3))
print("block_table\n", cache.block_table)

# %% [markdown]
# The slot mapping of that 14-token prefill of the new row 1, checked against the formula:

# %%
pos = torch.arange(14)
by_formula = cache.block_table_cpu[1, pos // n].long() * n + pos % n
print(slots_new.tolist())
assert torch.equal(slots_new, by_formula)

# %% [markdown]
# ### A picture
#
# Left: the pool of 24 pages, coloured by the sequence that owns them, each labelled with its
# place in that sequence (`s2 p3` = sequence 2's fourth page) and how many of its $n$ rows hold
# tokens. Right: the block tables, one row per sequence, holding page numbers; a sequence's pages
# are scattered over the pool and the table puts them back in order.

# %%
def draw(cache, title, cols=6):
    n = cache.block_size
    owner = torch.full((cache.num_blocks,), -1)
    label = [""] * cache.num_blocks
    for i in range(cache.batch_size):
        for j, page in enumerate(cache.blocks_of(i)):
            filled = min(n, int(cache.seq_lens[i]) - j * n)
            owner[page] = i
            label[page] = f"s{i} p{j}\n{filled}/{n}"
    colours = ListedColormap(["#eeeeee", "#4c72b0", "#dd8452", "#55a868", "#c44e52"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4),
                                      gridspec_kw={"width_ratios": [1, 1.3]})
    left.imshow((owner + 1).view(-1, cols), cmap=colours, vmin=0, vmax=4)
    for page in range(cache.num_blocks):
        y, x = divmod(page, cols)
        left.text(x, y, f"{page}\n{label[page] or 'free'}", ha="center", va="center", fontsize=8)
    left.set_title(f"{title}: the pool of pages (page number, owner)")
    left.set_xticks([]), left.set_yticks([])

    table = cache.block_table_cpu
    colour_rows = torch.where(table >= 0, torch.arange(cache.batch_size)[:, None] + 1, 0)
    right.imshow(colour_rows, cmap=colours, vmin=0, vmax=4, aspect="auto")
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            if table[i, j] >= 0:
                right.text(j, i, int(table[i, j]), ha="center", va="center", fontsize=9)
    right.set_yticks(range(cache.batch_size),
                     [f"seq {i} (len {int(cache.seq_lens[i])})" for i in range(cache.batch_size)])
    right.set_xticks(range(table.shape[1]))
    right.set_xlabel("logical block j (tokens j·n ... j·n + n - 1)")
    right.set_title("block_table[i, j] = page")
    fig.tight_layout()
    plt.show()

draw(cache, "after free and reuse")

# %% [markdown]
# Every call that changes the cache is all-or-nothing. Asking for more pages than are free raises
# `OutOfBlocksError` before a single page is taken:

# %%
before = (cache.block_table_cpu.clone(), list(cache.free_blocks), cache.seq_lens.clone())
print("free pages:", cache.num_free_blocks, " pages needed:",
      cache.blocks_needed(torch.tensor([0, 3]), torch.tensor([20, 25])).tolist())
try:
    cache.append(*tokens(20 + 25), seq_ids=[0, 3], new_lens=[20, 25])
except OutOfBlocksError as err:
    print("OutOfBlocksError:", err)
after = (cache.block_table_cpu, cache.free_blocks, cache.seq_lens)
assert torch.equal(before[0], after[0]) and before[1] == after[1] and torch.equal(before[2], after[2])
print("block tables, free list and seq_lens unchanged")

# %% [markdown]
# `gather(i)` reads a sequence back in token order through its block table, which is how the
# plain-torch references (the prefill reference and the reference decode) see the cache; the
# kernels read the pages through the block table themselves.

# %%
kv_c_1, k_pe_1 = cache.gather(1)
print("row 1 gathered:", tuple(kv_c_1.shape), tuple(k_pe_1.shape))

# %% [markdown]
# ## concat_and_cache
#
# The write itself: for every token with a slot $\ge 0$, copy `[kv_c | k_pe]` into that row of the
# flattened cache; slot $-1$ skips the token (padding). It is a CUDA kernel on a GPU and a C++
# twin on the CPU, one `torch.ops.mla.concat_and_cache_mla` op built by JIT on first use; if no
# compiler is around, the call falls back to the torch reference with a warning. Here:

# %%
print("backend on the CPU:", concat_backend("cpu"))

T = 10
kv_c, k_pe = tokens(T)                                   # row-strided views, as from one matmul
slot_mapping = torch.randperm(24 * n)[:T]
slot_mapping[[3, 7]] = -1                                 # two padding tokens
cache_a = torch.full((24, n, c + r), float("nan"))        # NaN: any row not written shows
cache_b = cache_a.clone()
concat_and_cache(kv_c, k_pe, cache_a, slot_mapping)
concat_and_cache_reference(kv_c, k_pe, cache_b, slot_mapping)
print("slots", slot_mapping.tolist())
print("bit-identical to the reference (NaN rows included):",
      torch.equal(cache_a.view(torch.int32), cache_b.view(torch.int32)))
flat = cache_a.view(-1, c + r)
print("written rows hold [kv_c | k_pe]:",
      torch.equal(flat[slot_mapping[slot_mapping >= 0]],
                  torch.cat([kv_c, k_pe], -1)[slot_mapping >= 0]),
      "  rows written:", int((~flat.isnan().any(-1)).sum()))

# %% [markdown]
# The same op can store an fp8 (e4m3) cache, $e4m3(\mathrm{clamp}(x / s, -448, 448))$, read back as
# $x \approx \text{cache} \cdot s$: half the bytes of bf16, at ~3 significant bits.

# %%
scale = 0.05
fp8_a = torch.zeros(24, n, c + r, dtype=torch.float8_e4m3fn)
fp8_b = fp8_a.clone()
concat_and_cache(kv_c, k_pe, fp8_a, slot_mapping, kv_cache_dtype="fp8", scale=scale)
concat_and_cache_reference(kv_c, k_pe, fp8_b, slot_mapping, kv_cache_dtype="fp8", scale=scale)
real = slot_mapping >= 0
back = fp8_a.view(-1, c + r)[slot_mapping[real]].float() * scale
exact = torch.cat([kv_c, k_pe], -1)[real]
print("fp8: bit-identical to the reference:", torch.equal(fp8_a.view(torch.uint8), fp8_b.view(torch.uint8)),
      f"  max relative error of the values read back: "
      f"{float(((back - exact).abs() / exact.abs().clamp_min(1e-3)).max()):.3f}")

# %% [markdown]
# ## The Triton decode kernel against its reference
#
# In the absorbed form, one decode step is multi-query attention over the cached rows: the query
# of head $i$ is $[q^{\text{lat}}_i; q^R_i]$ ($c + r$ wide), the key is the whole cached row and the
# value its first $c$ values:
#
# $$ s_{ij} = \tau\, q_i \cdot \text{row}_j, \qquad
#    \text{out}_i = \sum_j \mathrm{softmax}_j(s_{ij})\, \text{row}_j[{:}c], \qquad
#    \text{lse}_i = \log \sum_j e^{s_{ij}}. $$
#
# `mla_decode` reads the pages through the block table; `mla_decode_reference` gathers each
# sequence's pages with plain torch and computes in float64. We run both on the cache above,
# with 16 heads, after poisoning every page no sequence owns with NaN: a kernel that read
# outside a sequence's pages would return NaN.

# %%
h = 16
kv_cache = cache.kv_cache.clone()
owned = {p for i in range(cache.batch_size) for p in cache.blocks_of(i)}
for page in set(range(cache.num_blocks)) - owned:
    kv_cache[page] = float("nan")
block_table = cache.block_table
seq_lens = cache.seq_lens.to(torch.int32)
q = torch.randn(cache.batch_size, h, c + r)
softmax_scale = mla.MLAConfig.from_preset("tiny").softmax_scale
args = dict(kv_lora_rank=c, softmax_scale=softmax_scale)

out, lse = mla_decode(q, kv_cache, block_table, seq_lens, **args)
ref_out, ref_lse = mla_decode_reference(q, kv_cache, block_table, seq_lens, **args)
print("seq_lens", seq_lens.tolist(), " out", tuple(out.shape), " lse", tuple(lse.shape))
print(f"Triton (interpreted) vs float64 reference: max |out diff| = "
      f"{float((out - ref_out).abs().max()):.1e}, max |lse diff| = "
      f"{float((lse - ref_lse).abs().max()):.1e}")

# %% [markdown]
# ## Split-KV and the log-sum-exp merge
#
# With a small batch, one program per (sequence, head block) leaves most of a GPU idle, so the
# kernel cuts every sequence into `num_kv_splits` pieces, computes each piece's softmax-weighted
# output and its own lse in a separate program, and merges. The merge is exact because a softmax
# over the union of disjoint key sets $S_1, \dots, S_K$ is a weighted mix of the softmaxes over
# each set:
#
# $$ \text{lse} = \log \sum_k e^{\text{lse}_k}, \qquad
#    \text{out} = \sum_k e^{\text{lse}_k - \text{lse}}\, \text{out}_k, $$
#
# since $e^{\text{lse}_k - \text{lse}}$ is exactly the share of the total softmax mass that falls
# in $S_k$. We do it by hand. A piece that starts at a page boundary is itself a paged sequence:
# its block table is the tail of the original one from that page on, its length what is left
# (clamped to the piece's size, and 0 where the sequence is shorter: lse $= -\infty$, weight 0).
# So `mla_decode_reference` on those sub-tables gives each piece's out and lse.

# %%
split_tokens = n                                       # each piece: one page
num_splits = math.ceil(int(seq_lens.max()) / split_tokens)
parts_out, parts_lse = [], []
for k in range(num_splits):
    start = k * split_tokens
    sub_table = block_table[:, start // n:].contiguous()
    sub_lens = (seq_lens - start).clamp(0, split_tokens).to(torch.int32)
    o_k, lse_k = mla_decode_reference(q, kv_cache, sub_table, sub_lens, **args)
    parts_out.append(o_k.double())
    parts_lse.append(lse_k.double())
    print(f"piece {k}: tokens {start:2d}..{start + split_tokens - 1:2d}, lengths "
          f"{sub_lens.tolist()}, lse[:, 0] = {[round(x, 3) for x in lse_k[:, 0].tolist()]}")

parts_out = torch.stack(parts_out)                     # (K, b, h, c)
parts_lse = torch.stack(parts_lse)                     # (K, b, h)
merged_lse = torch.logsumexp(parts_lse, dim=0)         # (b, h)
weights = torch.exp(parts_lse - merged_lse)            # (K, b, h): each piece's share, sums to 1
merged_out = (weights[..., None] * parts_out).sum(0)   # (b, h, c)
print("shares of sequence 0, head 0:", [round(x, 3) for x in weights[:, 0, 0].tolist()])
print(f"merged vs whole-sequence reference: max |out diff| = "
      f"{float((merged_out - ref_out.double()).abs().max()):.1e}, max |lse diff| = "
      f"{float((merged_lse - ref_lse.double()).abs().max()):.1e}")

# %% [markdown]
# The kernel does the same in two stages (stage 1 writes per-split partial outputs and lse into a
# float32 workspace, stage 2 merges them); any split count gives the same answer:

# %%
for splits in (1, 2, 3, 8):
    o_s, lse_s = mla_decode(q, kv_cache, block_table, seq_lens, num_kv_splits=splits, **args)
    print(f"num_kv_splits={splits}: max |out - reference| = "
          f"{float((o_s - ref_out).abs().max()):.1e}, max |lse - reference| = "
          f"{float((lse_s - ref_lse).abs().max()):.1e}")

# %% [markdown]
# How many splits the kernel picks by itself (`num_kv_splits=None`) is
# `choose_num_kv_splits(b, h, t, num_sms)`. Stage 1 runs $P = b \lceil h / \text{BLOCK\_H} \rceil$
# programs per split, and the rule depends on the head block that `default_config(h)` gives:
#
# - **small head blocks** (BLOCK_H < 64: memory bound, a program's tile is small and several
#   programs share an SM, each with its loads in flight) aim at a fixed number of programs per
#   SM, in one wave: the most splits whose $P \cdot$ splits programs fit that target (a few
#   programs past it would run a second round alone), then the fewest splits that cut the
#   longest sequence into the same number of whole tiles each;
# - **64-head blocks** (compute bound, one program an SM): 1 split if $P$ already covers the SMs,
#   otherwise the smallest count whose programs keep at least 90% of the SMs busy over all their
#   waves, $P s / (\lceil P s / \text{SMs} \rceil \cdot \text{SMs})$.
#
# Either way every split keeps at least `min_tiles_per_split` tiles of BLOCK_N tokens of the
# longest sequence, and there are at most `max_splits`. On the CPU there are no SMs to count, so
# we pass an H100/H200's 132, as `mla_decode` does there. Our toy batch is too short to split at
# all; at DeepSeek sizes (the last two columns are what each rule looks at):

# %%
SMS = 132
print("defaults:", {k: v.default for k, v in inspect.signature(choose_num_kv_splits).parameters.items()
                    if k in ("min_tiles_per_split", "max_splits")})
print(f"{'b':>4s} {'h':>4s} {'t':>7s} {'BLOCK_H':>8s} {'BLOCK_N':>8s} {'programs':>9s} "
      f"{'splits':>7s} {'programs/SM':>12s} {'wave use':>9s}")
for b_, h_, t_ in [(4, 16, 22), (1, 16, 32768), (1, 128, 32768), (8, 16, 4096),
                   (48, 16, 8192), (64, 16, 4096), (64, 128, 4096), (132, 16, 1024)]:
    cfg_ = default_config(h_)
    programs = b_ * math.ceil(h_ / cfg_["BLOCK_H"])
    splits = choose_num_kv_splits(b_, h_, t_, SMS)
    total = programs * splits
    use = total / (math.ceil(total / SMS) * SMS)
    print(f"{b_:>4d} {h_:>4d} {t_:>7d} {cfg_['BLOCK_H']:>8d} {cfg_['BLOCK_N']:>8d} {programs:>9d} "
          f"{splits:>7d} {total / SMS:>12.2f} {use:>9.0%}")

# %% [markdown]
# The rule plans from the longest sequence, and the Triton kernel cuts every sequence of the
# batch into that many pieces, so in a batch whose lengths differ the short sequences' programs
# finish early and the longest one's set the time. On a Hopper GPU at many heads, the CUDA
# stage 1 (`"cuda-sm90"`) deals instead: it lines up the batch's tiles, sequence after
# sequence, and gives each of its b x splits programs an equal run of them, so a long sequence
# is spread over many programs and a program may finish one sequence and start the next. A
# sequence that ends up in several pieces is merged by the same log-sum-exp rule as above.
# Derivation 5 of the documentation has the details and the times beside FlashMLA.

# %% [markdown]
# ## The paged tier against the absorbed tier
#
# `mla.build(weights, "paged")` puts it all together behind the common call: the projections of
# notebook 1, `cache.append` (allocator, slot mapping, `concat_and_cache`), decode rows through
# `mla_decode` with $W^{UK}$ absorbed into the query and $W^{UV}$ into the output. Prefill rows (more
# than one new token) go the way `paged.prefill_path(new_len, context_len)` says: under the
# default `prefill="auto"`, a row with fewer than `prefill_crossover` new tokens (a threshold
# measured on an H200 by benchmarks/lab/prefill_crossover.py) attends absorbed, in MQA mode,
# through the same decode kernel, which takes up to 8 new tokens a sequence, causal among
# themselves (longer rows in pieces of 8). A longer row is up-projected, in MHA mode (keys and
# values per head, as in notebook 1), through the tiled prefill kernel `mla_prefill`: the new
# tokens over themselves causally, and over their cached context gathered from the pages and
# up-projected `workspace_tokens` tokens at a time, the pieces merged by log-sum-exp. Neither
# path stores a (query, key) score. `prefill="absorbed"` or `"up-project"` forces one path for
# every row.
#
# Same weights, same inputs, against the absorbed tier: a ragged prefill of at most 12 tokens,
# then decode steps; pages of 4 tokens, handed out in a shuffled order so that no sequence's
# pages are contiguous. 12 tokens is below the crossover, so under "auto" the prefill goes the
# absorbed path; a second paged layer with `prefill="up-project"` runs the other path on the
# same calls. (The absorbed tier itself up-projects prefill rows by default, so that second
# layer's prefill is the one computed the same way as the reference.)

# %%
config = mla.MLAConfig.from_preset("tiny")
weights = mla.MLAWeights(config, dtype=torch.float32, seed=0).requires_grad_(False)
absorbed = mla.build(weights, "absorbed")
paged = mla.build(weights, "paged", block_size=4, shuffle=1)
paged_up = mla.build(weights, "paged", block_size=4, shuffle=1, prefill="up-project")
print(f"prefill={paged.prefill!r}, prefill_crossover={paged.prefill_crossover}:",
      {s_: paged.prefill_path(s_, 0) for s_ in (5, 9, 12, paged.prefill_crossover)})
print(f"prefill={paged_up.prefill!r}:", {s_: paged_up.prefill_path(s_, 0) for s_ in (5, 9, 12)})

b = 3
caches = {"absorbed": absorbed.new_cache(b, 64), "paged": paged.new_cache(b, 64),
          "paged_up": paged_up.new_cache(b, 64)}
gen = torch.Generator().manual_seed(2)
calls = [(torch.randn(b, 12, config.hidden_size, generator=gen), torch.tensor([12, 5, 9]))]
calls += [(torch.randn(b, 1, config.hidden_size, generator=gen), None) for _ in range(8)]
worst = {(name, step): 0.0 for name in ("paged", "paged_up") for step in ("prefill", "decode")}
for x, lengths in calls:
    step = "prefill" if x.shape[1] > 1 else "decode"
    y_abs = absorbed(x, caches["absorbed"], lengths)
    for name, layer in (("paged", paged), ("paged_up", paged_up)):
        y = layer(x, caches[name], lengths)
        rel = float((y - y_abs).abs().max() / y_abs.abs().max())
        worst[name, step] = max(worst[name, step], rel)
print("paged vs absorbed, max relative difference:      the prefill   8 decode steps")
for name, label in (("paged", "prefill='auto' (prefill absorbed)"),
                    ("paged_up", "prefill='up-project'")):
    print(f"  {label:34s} {worst[name, 'prefill']:>14.1e} {worst[name, 'decode']:>16.1e}")
print("paged cache:", caches["paged"])
print("its block table (shuffled pages)\n", caches["paged"].block_table)

# %%
draw(caches["paged"], "the paged tier's cache", cols=8)

# %% [markdown]
# The three tiers agree, each tested against the one below it: naive against HF (notebook 1),
# absorbed against naive (notebook 2), paged against absorbed (here). Notebook 4 measures what
# the latent cache saves in memory and what the kernels reach on a GPU.
