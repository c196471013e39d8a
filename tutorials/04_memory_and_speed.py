# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 4. Memory and speed
#
# What MLA is for: a KV cache small enough that long contexts and big batches fit, and a decode
# step that reads little. The first half of this notebook is arithmetic from `mla.memory`: cache
# sizes per token and per sequence for MHA, GQA, MQA and MLA at DeepSeek-V2/V3 sizes. The second
# half plots the GPU measurements committed under `benchmarks/results/` (whatever is there when
# the notebook runs) and says how to produce them again.

# %%
import copy
import json
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import mla
from mla import memory

SCHEMES = ("mha", "gqa-8", "mqa", "mla", "mla-expanded")
LABELS = {"mha": "MHA", "gqa-8": "GQA, 8 groups", "mqa": "MQA", "mla": "MLA (latent)",
          "mla-expanded": "MLA, cached after kv_b_proj"}

# %% [markdown]
# ## KV cache per token
#
# Elements a layer caches per token (DeepSeek-V2 paper, table 1), at each preset's head count $h$
# and head width $d_h = 128$:
#
# $$ \text{MHA } 2 h d_h, \quad \text{GQA } 2 n_g d_h, \quad \text{MQA } 2 d_h, \quad
#    \text{MLA } c + r = \tfrac{9}{2} d_h. $$
#
# "MLA, cached after kv_b_proj" is what an implementation that caches the up-projected keys and
# values would hold, $h(d + r + v)$: MLA's weights do not make a cache small, caching the latent
# does. Bytes are bf16, summed over the model's layers (`mla.memory.NUM_LAYERS`).

# %%
def kib(x):
    return f"{x / 1024:,.1f}"

for preset in ("deepseek-v2", "deepseek-v3", "deepseek-v2-lite"):
    cfg = mla.MLAConfig.from_preset(preset)
    layers = memory.NUM_LAYERS[preset]
    rows = memory.kv_cache_table(cfg, seq_len=32768, num_layers=layers, schemes=SCHEMES)
    mla_bytes = next(row["bytes_per_token"] for row in rows if row["scheme"] == "mla")
    print(f"{preset}: {layers} layers, h = {cfg.num_heads}, bf16")
    print(f"  {'scheme':30s} {'elem/token/layer':>16s} {'KiB/token':>10s} {'GiB @ 32k':>10s} "
          f"{'vs MLA':>7s}")
    for row in rows:
        print(f"  {LABELS[row['scheme']]:30s} {row['elements_per_token_layer']:>16,d} "
              f"{kib(row['bytes_per_token']):>10s} {row['bytes_per_sequence'] / 2**30:>10.2f} "
              f"{row['bytes_per_token'] / mla_bytes:>6.1f}x")
    print()
    elements = {row["scheme"]: row["elements_per_token_layer"] for row in rows}
    assert elements["mla"] == 9 * 128 // 2 and elements["mha"] == 2 * cfg.num_heads * 128

v2 = mla.MLAConfig.from_preset("deepseek-v2")
print(f"MLA caches as much as GQA with {memory.mla_equivalent_gqa_groups(v2):g} groups "
      "(the paper: 2.25)")
print(f"DeepSeek-V2 vs DeepSeek 67B: {memory.paper_kv_reduction_vs_67b():.1%} less KV cache with "
      f"V2's cache at ~6 bits an element (the paper's 93.3%), "
      f"{memory.paper_kv_reduction_vs_67b(16):.1%} with both in bf16")
assert memory.mla_equivalent_gqa_groups(v2) == 2.25
assert f"{memory.paper_kv_reduction_vs_67b():.1%}" == "93.3%"

# %% [markdown]
# ## KV cache per sequence, across context lengths
#
# The cache of one sequence grows linearly with its length; the slope is the per-token figure
# above. The dashed line is the memory of one H200 (141 GB) for scale: at DeepSeek-V3 sizes one
# 128k-token MHA sequence would not fit on it, while MLA's cache of the same sequence is ~9 GB.

# %%
contexts = [2 ** k for k in range(10, 18)]                          # 1k ... 128k tokens
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
for ax, preset in zip(axes, ("deepseek-v2", "deepseek-v3")):
    cfg, layers = mla.MLAConfig.from_preset(preset), memory.NUM_LAYERS[preset]
    for scheme in SCHEMES:
        gb = [memory.kv_cache_table(cfg, t, layers, schemes=(scheme,))[0]["bytes_per_sequence"] / 1e9
              for t in contexts]
        ax.plot(contexts, gb, "o-", ms=3, label=LABELS[scheme])
    ax.axhline(141, color="grey", ls="--", lw=0.8)
    ax.text(contexts[0], 160, "one H200 (141 GB)", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the sequence")
    ax.set_title(f"{preset}: {layers} layers, bf16")
axes[0].set_ylabel("KV cache of one sequence (GB)")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()
# one 128k-token sequence at DeepSeek-V3 sizes: MHA's cache is past one H200, MLA's ~9 GB
v3 = mla.MLAConfig.from_preset("deepseek-v3")
gb = {row["scheme"]: row["bytes_per_sequence"] / 1e9
      for row in memory.kv_cache_table(v3, 2**17, memory.NUM_LAYERS["deepseek-v3"])}
assert gb["mha"] > 141 and 8.5 < gb["mla"] < 9.5

# %% [markdown]
# Or turned around: how many tokens of cache fit in a budget, say 100 GB left for the cache after
# the weights (the weights of a 671B-parameter model span many GPUs; the point is the ratio).

# %%
for row in memory.kv_cache_table(v3, 1, memory.NUM_LAYERS["deepseek-v3"], schemes=SCHEMES):
    print(f"{LABELS[row['scheme']]:30s} {100e9 / row['bytes_per_token']:>12,.0f} tokens in 100 GB")

# %% [markdown]
# ## The cache in fp8
#
# MLA's cache can shrink further: the paged tier stores the latent in 8-bit floats when built
# with `kv_cache_dtype` (derivation 8 of the documentation). `"fp8_e4m3"` keeps each of the
# $c + r$ values in one byte with one scale for the whole cache; `"fp8_ds_mla"`, FlashMLA's
# token, keeps the latent in e4m3 with one float32 scale per 128 values and the rope part in
# bf16. Bytes a token in one layer, and what they mean for DeepSeek-V3's 61 layers:

# %%
layers = memory.NUM_LAYERS["deepseek-v3"]
print(f"{'kv_cache_dtype':16s} {'bytes/token/layer':>18s} {'KiB/token':>10s} "
      f"{'GiB @ 128k':>11s} {'tokens in 100 GB':>17s}")
fp8_bytes = {}
for kind in ("auto", "fp8_e4m3", "fp8_ds_mla"):
    per_layer = memory.latent_cache_bytes_per_token(v3, kind)      # "auto": bf16
    fp8_bytes[kind] = per_layer
    per_token = per_layer * layers
    print(f"{kind:16s} {per_layer:>18,.0f} {per_token / 1024:>10.1f} "
          f"{per_token * 2**17 / 2**30:>11.2f} {100e9 / per_token:>17,.0f}")
assert (fp8_bytes["auto"], fp8_bytes["fp8_e4m3"], fp8_bytes["fp8_ds_mla"]) == (1152, 576, 656)

# %% [markdown]
# The price is precision: e4m3 keeps 3 bits of mantissa, so a stored value moves by up to
# $2^{-4}$ of itself. The cell below builds one small layer (the "tiny" preset with a
# 128-wide latent, so that `"fp8_ds_mla"` has a whole group of 128), runs the same ragged prefill
# and decode steps through the naive tier in float32 and through the paged tier on each
# cache layout, and prints the bytes the cache tensor really holds a token and the output's
# relative error.

# %%
torch.manual_seed(0)
small = mla.MLAConfig.from_preset("tiny").replace(kv_lora_rank=128)
small_weights = mla.MLAWeights(small, dtype=torch.float32, seed=0).requires_grad_(False)
naive_small = mla.build(small_weights, "naive")
calls = [([24, 9, 17], 24)] + [([1, 1, 1], 1)] * 4           # a ragged prefill, 4 decode steps
inputs = [torch.randn(3, s, small.hidden_size) for _, s in calls]
reference_cache = naive_small.new_cache(3, 64)
with torch.no_grad():
    references = [naive_small(x, reference_cache, n) for x, (n, _) in zip(inputs, calls)]

print(f"{'kv_cache_dtype':16s} {'cache tensor':>28s} {'bytes/token':>12s} {'max rel err':>12s}")
fp8_errors = {}
for kind in ("auto", "fp8_e4m3", "fp8_ds_mla"):
    paged = mla.build(small_weights, "paged", kv_cache_dtype=kind, block_size=16)
    cache = paged.new_cache(3, 64)
    with torch.no_grad():
        errors = [float((paged(x, cache, n) - ref).norm() / ref.norm())
                  for x, ref, (n, _) in zip(inputs, references, calls)]
    fp8_errors[kind] = max(errors)
    per_token = cache.kv_cache.nbytes // (cache.num_blocks * cache.block_size)
    tensor = f"{str(cache.kv_cache.dtype).removeprefix('torch.')} {tuple(cache.kv_cache.shape)}"
    print(f"{kind:16s} {tensor:>28s} {per_token:>12d} {fp8_errors[kind]:>12.1e}")
assert fp8_errors["auto"] < 1e-5 and max(fp8_errors.values()) < 2**-4

# %% [markdown]
# The float32 cache ("auto" with float32 weights: 4 bytes a value) agrees with the naive tier to
# float32 rounding; both fp8 caches are a few percent off, about the rms error of one value
# rounded to e4m3, and within the $2^{-4}$ the tests hold them to. `"fp8_e4m3"` is the worse
# of the two because it also rounds the rope part, whose pairs carry position.
# `benchmarks/accuracy_fp8.py` measures the same at DeepSeek-V3's size, and the documentation's
# fp8 page shows its table. How fast a decode step reads each layout on the GPU is in the
# decode section below, once `python -m mla bench decode --kv-cache-dtype ...` has run there.

# %% [markdown]
# ## What a decode step costs, on this machine
#
# A decode step of the naive tier up-projects the whole cached latent; the absorbed tier reads
# it once (notebook 2 counts the FLOPs). A CPU is not the target, but the difference in how the
# two grow with the context shows anywhere. One sequence at DeepSeek-V2-Lite sizes (16 heads,
# float32, random weights); the cache is filled with random latents (what they hold does not
# change the time), then one decode step is timed on a fresh copy of it, median of three.

# %%
torch.manual_seed(0)
lite = mla.MLAConfig.from_preset("deepseek-v2-lite")
weights = mla.MLAWeights(lite, dtype=torch.float32).requires_grad_(False)
tiers = {tier: mla.build(weights, tier) for tier in ("naive", "absorbed")}
step = torch.randn(1, 1, lite.hidden_size)

def decode_ms(attn, context, repeats=3):
    filled = attn.new_cache(1, context + 1)
    filled.kv_c[:, :context] = torch.randn(1, context, lite.kv_lora_rank)
    filled.k_pe[:, :context] = torch.randn(1, context, lite.qk_rope_head_dim)
    filled.seq_lens[:] = context
    runs = []
    with torch.no_grad():
        for _ in range(repeats):
            cache = copy.deepcopy(filled)
            start = time.perf_counter()
            attn(step, cache)
            runs.append(time.perf_counter() - start)
    return 1e3 * sorted(runs)[repeats // 2]

print(f"torch threads: {torch.get_num_threads()}")
print(f"{'context':>8s} {'naive ms':>9s} {'absorbed ms':>12s} {'speed-up':>9s} {'FLOPs ratio':>12s}")
for context in (256, 1024, 4096, 16384):
    naive_ms, absorbed_ms = (decode_ms(tiers[t_], context) for t_ in ("naive", "absorbed"))
    flops = memory.attention_flops(lite, 1, context + 1)
    print(f"{context:>8d} {naive_ms:>9.1f} {absorbed_ms:>12.1f} {naive_ms / absorbed_ms:>8.1f}x "
          f"{flops.up_projected / flops.absorbed:>11.0f}x")

# %% [markdown]
# The absorbed step grows far more slowly with the context than the naive one, which
# up-projects every cached token again at every step (timings on a shared CPU are noisy; the
# trend is what to read). The measured speed-up stays below the attention-FLOPs
# ratio because both tiers also pay the same projections (`q_proj`, `kv_a_proj_with_mqa`,
# `o_proj`) and per-call overheads, which the ratio leaves out.

# %% [markdown]
# ## Inside a real model: transformers' generate() with a tier swapped in
#
# Hugging Face transformers runs DeepSeek-V2/V3 with an attention that caches the latent but
# up-projects all of it every decode step, as the naive tier does. `mla.hf.swap_attention` puts
# a tier in its place, built from each layer's own projections (no copy), and `generate()` runs
# unchanged: same call, same tokens. A small random DeepSeek-V3-shaped model (the "tiny"
# preset's attention, 2 layers, float32) and three prompts of different lengths, left-padded as
# transformers wants them:

# %%
from mla import hf

tiny = mla.MLAConfig.from_preset("tiny")
model = hf.random_model(tiny, num_layers=2, vocab_size=256, seed=0)
lengths = [24, 15, 7]
gen = torch.Generator().manual_seed(0)
ids = torch.randint(3, 256, (3, max(lengths)), generator=gen)
mask = (torch.arange(max(lengths))[None, :]
        >= max(lengths) - torch.tensor(lengths)[:, None]).long()
batch = dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask)

generated = {}
with torch.no_grad():
    for kind in ("transformers", "naive", "absorbed", "paged"):
        if kind != "transformers":
            hf.swap_attention(model, kind)
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
        if kind != "transformers":
            hf.swap_back(model)
        generated[kind] = out[:, max(lengths):]
        same = torch.equal(generated[kind], generated["transformers"])
        print(f"{kind:>12s}: same tokens as transformers: {'yes' if same else 'NO'}, "
              f"{seconds:.2f} s")
print("(on a CPU the paged tier's decode kernel runs in Triton's interpreter: slow by design)")

# %% [markdown]
# What each decode step costs at DeepSeek-V3's width, one layer, one sequence, as the context
# grows (`mla.hf.decode_step_costs`: attention FLOPs beyond the shared projections, and the
# intermediates the step holds). transformers' step makes the per-head keys and values of the
# whole context again; the absorbed and paged tiers hold only the scores.

# %%
print(f"{'context':>8s} {'transformers GFLOPs':>20s} {'absorbed GFLOPs':>16s} "
      f"{'transformers MiB':>17s} {'absorbed MiB':>13s}")
for context in (4096, 32768, 131072):
    costs = hf.decode_step_costs(v3, context)
    up, ab = costs["transformers"], costs["absorbed"]
    print(f"{context:>8d} {up['flops'] / 1e9:>20.1f} {ab['flops'] / 1e9:>16.2f} "
          f"{up['transient_bytes'] / 2**20:>17.0f} {ab['transient_bytes'] / 2**20:>13.1f}")

# %% [markdown]
# `python -m mla generate` prints the same comparison for a model of your own
# (`--model DIR`), and `python -m mla bench generate` measures it on a GPU at DeepSeek-V3's
# width: tokens a second, peak memory, and the largest batch that fits at 32k tokens
# (the "Use with transformers" page of the documentation has the details).

# %% [markdown]
# ## The GPU results
#
# The benchmarks run on one NVIDIA H200 and commit JSON under `benchmarks/results/`
# (`benchmarks/lab/NOTES.md` says how each measures). This section plots every file it finds there,
# by the kind of rows it holds; if the folder is empty it says so.

# %%
def find_results():
    """benchmarks/results/, looked for from this notebook's folder and from the repository root."""
    for base in (Path.cwd(), Path.cwd().parent, *Path.cwd().parents):
        folder = base / "benchmarks" / "results"
        if folder.is_dir():
            return folder
    return None

results_dir = find_results()
results, invalid = {}, []
if results_dir is not None:
    for path in sorted(results_dir.glob("*.json")):
        try:
            results[path.stem] = json.loads(path.read_text())
        except ValueError as err:
            print(f"{path.name}: not valid JSON ({err})")
            invalid.append(path.name)
assert not invalid, f"result files that are not JSON: {invalid}"
if not results:
    print("No results committed yet: benchmarks/results/ holds no JSON. Run the benchmarks on a "
          "GPU (below) and execute this notebook again.")
else:
    print(f"{len(results)} result files in {results_dir.relative_to(results_dir.parents[1])}:")
    for name, data in results.items():
        print(f"  {name + '.json':34s} {data.get('device', '?'):12s} {len(data.get('rows', []))} rows")

def rows_with(*keys):
    """The result files whose rows all carry `keys`: {name: data}."""
    return {name: data for name, data in results.items()
            if data.get("rows") and all(all(k in row for k in keys) for row in data["rows"])}

# %% [markdown]
# ### Decode kernel against its floor
#
# The decode benchmark's files (`bench_decode.py`: `h200-decode.json` on an H200,
# `nvidia-h100-80gb-hbm3-decode.json` on an H100, the newest kernels; earlier runs are in
# `benchmarks/lab/results/`) hold one row per shape ($b$ sequences of $t$ tokens, $h$ heads, DeepSeek-V3's
# 576-wide bf16 cache in pages of 64) with the kernel's time and the shape's *floor*,
# $\max(\text{bytes}/\text{copy bandwidth},\ \text{FLOPs}/\text{matmul rate})$, both ceilings
# measured in the same run. `share_of_floor` = floor / time: 1.0 would be the hardware's limit.
# Few heads are memory bound, many heads compute bound. Each call is timed with a cold L2: in
# these files after a read of a 256 MiB buffer; in the files before them after that buffer
# was zeroed (`triton.testing.do_bench`'s way), which leaves dirty lines in L2 for the kernel to
# write back: up to ~8 us slower at 16 heads (`dirty_l2_time_us`; `benchmarks/lab/NOTES.md` row 44).

# %%
decode = {name: data for name, data in rows_with("b", "t", "h", "time_us", "floor_us").items()}
if not decode:
    print("No decode results committed yet (benchmarks/results/h200-decode.json).")
else:
    for name, data in decode.items():
        print(f"{name}: copy {data.get('copy_GBps', float('nan')):.0f} GB/s, "
              f"matmul {data.get('matmul_TFLOPs', float('nan')):.0f} TFLOP/s, "
              f"{data.get('device', '?')}, triton {data.get('triton', '?')}")
        print(f"  {'b':>4s} {'t':>7s} {'h':>4s} {'floor us':>9s} {'bound':>7s} {'time us':>9s} "
              f"{'share':>6s} {'torch us':>9s} {'splits':>6s} {'FlashMLA us':>11s} {'FM / mla':>8s}")
        for row in data["rows"]:
            time_us = row.get("time_us")
            torch_us = row.get("torch_us")
            print(f"  {row['b']:>4d} {row['t']:>7d} {row['h']:>4d} {row['floor_us']:>9.1f} "
                  f"{row.get('bound', ''):>7s} "
                  + (f"{time_us:>9.1f} {row['floor_us'] / time_us:>6.2f} " if time_us else
                     f"{'error':>9s} {'':>6s} ")
                  + (f"{torch_us:>9.1f}" if torch_us else f"{'-':>9s}")
                  + f" {row.get('config', {}).get('num_kv_splits', ''):>6}"
                  + (f" {row['flashmla_us']:>11.1f} {row['flashmla_over_mla']:>8.2f}"
                     if row.get("flashmla_us") and row.get("flashmla_over_mla") else f" {'n/a':>11s} {'n/a':>8s}"))

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    shapes = sorted({(row["h"], row["b"], row["t"]) for data in decode.values()
                     for row in data["rows"]})
    labels = [f"h{h_} b{b_}\nt{t_ // 1024}k" for h_, b_, t_ in shapes]
    width = 0.8 / (len(decode) + 1)
    for k, (name, data) in enumerate(decode.items()):
        by_shape = {(row["h"], row["b"], row["t"]): row for row in data["rows"]}
        share = [(by_shape[s_]["floor_us"] / by_shape[s_]["time_us"])
                 if s_ in by_shape and by_shape[s_].get("time_us") else 0 for s_ in shapes]
        axes[0].bar([i + k * width for i in range(len(shapes))], share, width, label=name)
        if k == len(decode) - 1:   # the torch baseline of the newest file
            base = [(by_shape[s_]["floor_us"] / by_shape[s_]["torch_us"])
                    if s_ in by_shape and by_shape[s_].get("torch_us") else 0 for s_ in shapes]
            axes[0].bar([i + (k + 1) * width for i in range(len(shapes))], base, width,
                        color="grey", alpha=0.5, label=f"torch gather+einsum ({name})")
        rows = sorted(data["rows"], key=lambda row: row["floor_us"])
        axes[1].scatter([row["floor_us"] for row in rows if row.get("time_us")],
                        [row["time_us"] for row in rows if row.get("time_us")], label=name, s=18)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], labels, fontsize=7)
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_ylabel("share of floor (floor / time)")
    axes[0].set_title("mla_decode on the GPU: how close to the hardware limit")
    axes[0].legend(fontsize=7)
    lims = [min(row["floor_us"] for d_ in decode.values() for row in d_["rows"]) / 1.5,
            max(row.get("time_us") or 0 for d_ in decode.values() for row in d_["rows"]) * 1.5]
    axes[1].plot(lims, lims, "k-", lw=0.8, label="time = floor")
    axes[1].plot(lims, [2 * x for x in lims], "k:", lw=0.8, label="2x floor")
    axes[1].set_xscale("log"), axes[1].set_yscale("log")
    axes[1].set_xlabel("floor (us)"), axes[1].set_ylabel("measured (us)")
    axes[1].set_title("time against floor, every shape")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ### Decode on an fp8 cache
#
# `python -m mla bench decode --kv-cache-dtype auto,fp8_e4m3,fp8_ds_mla` times each layout on
# the same latents in the same run and keeps the fp8 rows apart (`fp8_rows`), each with its
# time over the bf16 row's (`over_bf16`). At 16 heads a step is memory bound and
# `"fp8_ds_mla"` reads 656 of 1152 bytes a token, so it could approach 0.57x; at 128 heads it is
# compute bound and the dequantisation is extra work. The cell prints each file's fp8 rows and,
# per head count, the range of `over_bf16` at b >= 4. In both committed runs (the H200's, and
# the H100's of newer kernels) an fp8 cache is faster than a bf16 one at 16 heads, by less than
# its bytes, and slower at 128 heads, where the warpgroups that issue the products also convert
# each tile's fp8 bytes in shared memory (the documentation's fp8 page says more). At 128 heads
# an fp8 cache buys memory, not speed.

# %%
fp8_runs = {name: data for name, data in results.items() if data.get("fp8_rows")}
if not fp8_runs:
    print("No fp8 decode results committed yet: run `python -m mla bench decode --kv-cache-dtype "
          "auto,fp8_e4m3,fp8_ds_mla` on a GPU.")
for name, data in fp8_runs.items():
    print(f"{name}: {data.get('device', '')}")
    print(f"  {'b':>4s} {'t':>7s} {'h':>4s} {'cache':>11s} {'us':>8s} {'x bf16':>7s}")
    for row in data["fp8_rows"]:
        if row.get("s_q", 1) == 1 and row.get("time_us"):
            print(f"  {row['b']:>4d} {row['t']:>7d} {row['h']:>4d} {row['kv_cache_dtype']:>11s} "
                  f"{row['time_us']:>8.1f} {row.get('over_bf16') or float('nan'):>7.2f}")
    for h_ in sorted({row["h"] for row in data["fp8_rows"]}):
        for kind in sorted({row["kv_cache_dtype"] for row in data["fp8_rows"]}):
            over = [row["over_bf16"] for row in data["fp8_rows"] if row["h"] == h_ and row["b"] >= 4
                    and row["kv_cache_dtype"] == kind and row.get("s_q", 1) == 1 and row.get("over_bf16")]
            if over:
                print(f"  {h_} heads, {kind}, b >= 4: {min(over):.2f}-{max(over):.2f}x the bf16 time")

# %% [markdown]
# ### concat_and_cache against device copy
#
# The cache write is pure data movement, so its ceiling is the copy bandwidth (read + write)
# measured in the same run.

# %%
concat = rows_with("tokens", "GBps", "kv_cache_dtype")
if not concat:
    print("No concat_and_cache results committed yet (benchmarks/results/*concat*.json).")
for name, data in concat.items():
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for dtype in sorted({row["kv_cache_dtype"] for row in data["rows"]}):
        rows = sorted((row for row in data["rows"] if row["kv_cache_dtype"] == dtype),
                      key=lambda row: row["tokens"])
        ax.plot([row["tokens"] for row in rows], [row["GBps"] for row in rows], "o-",
                label=f"kernel, cache {dtype}")
        if all("torch_us" in row for row in rows):
            ax.plot([row["tokens"] for row in rows],
                    [row["bytes"] / (row["torch_us"] * 1e-6) / 1e9 for row in rows], "x--",
                    label=f"torch index_put, cache {dtype}")
    if "copy_GBps" in data:
        ax.axhline(data["copy_GBps"], color="grey", ls="--", lw=0.8,
                   label=f"device copy {data['copy_GBps']:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens written")
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(f"{name}: {data.get('device', '')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ### Prefill: the flash kernels against torch's attention
#
# The prefill benchmark times, at DeepSeek-V3 sizes in bf16, $b$ prompts of $s$ new tokens over
# $t$ cached ones: the paged tier's whole layer call, its attention alone (under the default
# `prefill_backend="auto"`: on a call of more than 2,048 new tokens in rows of one length, SDPA
# over the new tokens, on a smaller one the Triton kernel (the committed results predate that
# rule: their "auto" is SDPA on every such prompt); over a
# cached context, the Triton flash prefill over the new tokens and the context chunks, merged by
# log-sum-exp), the same attention forced onto the Triton kernel on the prompts, and torch's
# `scaled_dot_product_attention` (cuDNN, efficient, flash) and FlexAttention on up-projected keys
# and values. The rate is the attention's FLOPs (causal pairs x h x 2 x (d + r + v)) over the
# time, against the bf16 matmul rate of the same run. The plain-torch crossover between the two
# prefill modes, measured before the kernels, is `benchmarks/lab/results/h200-prefill-crossover.json`.

# %%
prefill = rows_with("s", "t", "layer_attention_ms")
if not prefill:
    print("No prefill results committed yet (benchmarks/results/*prefill*.json).")
contenders = ("layer_attention", "layer_attention_triton", "sdpa_cudnn", "sdpa_efficient", "sdpa_flash",
              "flex")
labels = {"layer_attention": "paged tier's attention", "layer_attention_triton": "its Triton kernel"}
for name, data in prefill.items():
    shapes = [f"{row['b']}x{row['s']}" + (f"+{row['t']}" if row["t"] else "") for row in data["rows"]]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for key in contenders:
        ax.plot(range(len(shapes)), [row.get(f"{key}_TFLOPs") for row in data["rows"]], "o-",
                ms=3, label=labels.get(key, key))
    if "matmul_TFLOPs" in data:
        ax.axhline(data["matmul_TFLOPs"], color="grey", ls="--", lw=0.8,
                   label=f"bf16 matmul {data['matmul_TFLOPs']:.0f} TFLOP/s")
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, fontsize=7)
    ax.set_xlabel("b x s (+ cached t)"), ax.set_ylabel("attention TFLOP/s")
    ax.set_title(f"{name}: {data.get('device', '')}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
    print(f"{'shape':>14} {'attention ms':>13} {'best SDPA ms':>13} {'attention peak MiB':>19}")
    for shape, row in zip(shapes, data["rows"]):
        sdpa = [row[f"sdpa_{k}_ms"] for k in ("cudnn", "efficient", "flash")
                if row.get(f"sdpa_{k}_ms")]
        print(f"{shape:>14} {row['layer_attention_ms']:>13.2f} {min(sdpa):>13.2f} "
              f"{row['layer_attention_peak_mib']:>19.0f}")

# %% [markdown]
# ### One layer's decode step
#
# The layer benchmark times a whole DeepSeek-V3 layer's decode step (projections included) for
# the absorbed tier in eager mode and the paged tier eager and captured in a CUDA graph.

# %%
layer = rows_with("b", "absorbed_eager_us")
if not layer:
    print("No layer results committed yet (benchmarks/results/*layer*.json).")
for name, data in layer.items():
    columns = [k for k in ("absorbed_eager_us", "paged_eager_us", "paged_graph_us")
               if all(k in row for row in data["rows"])]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(columns)
    for k, column in enumerate(columns):
        ax.bar([i + k * width for i in range(len(data["rows"]))],
               [row[column] for row in data["rows"]], width, label=column.replace("_us", ""))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(data["rows"]))],
                  [f"b={row['b']}, t={row.get('t', '')}" for row in data["rows"]])
    ax.set_ylabel("us per decode step")
    ax.set_title(f"{name}: {data.get('config', '')}, {data.get('dtype', '')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# Any other result file is listed with what it holds:

# %%
shown = set(decode) | set(concat) | set(prefill) | set(layer)
others = {name: data for name, data in results.items() if name not in shown}
for name, data in others.items():
    rows = data.get("rows", [])
    print(f"{name}.json: {len(rows)} rows with keys {sorted(rows[0]) if rows else []}")
    best = data.get("best")
    if best:
        for row in best:
            print("   best:", {k: row[k] for k in ("b", "t", "h", "time_us", "config") if k in row})
if not others:
    print("(none)")

# %% [markdown]
# ## Running the benchmarks again
#
# On a machine with a CUDA GPU, from the repository root (the CLI runs the scripts in
# `benchmarks/`; extra arguments pass through):
#
# ```
# python -m mla bench decode  --out benchmarks/results          # h200-decode.json and .png, ~3-5 min
# python -m mla bench concat  --out /tmp/mla-gpu                # concat.json
# python -m mla bench layer   --out /tmp/mla-gpu                # layer.json
# python -m mla bench prefill --out benchmarks/results         # h200-prefill.json
# python -m mla bench tp      --out benchmarks/results --tp 2   # h200-tp.json, needs 2 GPUs
# python -m mla bench generate --out /tmp/mla-gpu               # generate.json (mla.hf)
# for f in concat layer; do cp /tmp/mla-gpu/$f.json benchmarks/results/h200-$f.json; done
# ```
#
# The concat and layer scripts write `concat.json` and `layer.json`; the committed ones are
# named for the H200 they ran on (`benchmarks/results/h200-concat.json`, `h200-layer.json`),
# hence the copy.
#
# The decode run times FlashMLA beside `mla_decode` where `import flash_mla` works
# (`flashmla_us`, `flashmla_over_mla`; null where it does not). `benchmarks/gpu_suite.sh` runs
# them time-boxed with logs, e.g.
# `OUT=/tmp/mla-gpu bash benchmarks/gpu_suite.sh tests decode-bench concat-bench`. Each script
# prints a table and writes JSON; none asserts a time. The kernel lab (probes, timelines, A/B
# builds, the config sweep, the tuning log and their results) is in `benchmarks/lab/`. Commit the JSON under `benchmarks/results/`
# and execute this notebook again to plot it:
#
# ```
# .venv/bin/jupytext --to ipynb --execute tutorials/04_memory_and_speed.py
# ```
