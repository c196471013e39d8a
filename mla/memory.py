"""What MLA saves and what it costs: KV-cache sizes and attention FLOPs, as plain arithmetic.

Cache sizes follow the DeepSeek-V2 paper's table 1 (elements per token per layer):

    MHA  2·n_h·d_h      GQA  2·n_g·d_h      MQA  2·d_h      MLA  d_c + d_h^R  (= 9/2·d_h for V2/V3)

with d_h the per-head width of the comparison (the paper uses d_h = 128 = our v_head_dim and
qk_nope_head_dim). "mla-expanded" is what a cache of MLA's *up-projected* keys and values would
hold, h·(d + r + v): the cache of an implementation that caches after kv_b_proj.

MLA's cache also comes in two fp8 layouts (`mla.kernels.fp8`), schemes "mla-fp8_e4m3" (one
byte a value, one scale for the cache) and "mla-fp8_ds_mla" (FlashMLA's token: the latent in
e4m3 with a float32 scale per 128 values, the rope part in bf16). They cache the same c + r
values a token; their bytes are fixed by the layout, whatever bytes_per_element says:
1152 (bf16), 576 and 656 bytes a token a layer for DeepSeek-V3.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .config import MLAConfig
from .kernels import fp8

# MLA's cache in the fp8 layouts of mla.kernels.fp8, as schemes of the tables below.
FP8_SCHEMES = ("mla-fp8_e4m3", "mla-fp8_ds_mla")

# Layers per model, from each checkpoint's config.json (num_hidden_layers).
NUM_LAYERS = {"deepseek-v2": 60, "deepseek-v2-lite": 27, "deepseek-v3": 61, "tiny": 1}

# DeepSeek LLM 67B (the paper's baseline for "93.3%"): 95 layers, 8 KV heads of width 128 (GQA),
# bf16 cache. From deepseek-ai/deepseek-llm-67b-base config.json.
DEEPSEEK_67B = dict(num_layers=95, num_kv_heads=8, head_dim=128, bytes_per_element=2.0)


def _count(name: str, value, least: int) -> int:
    """`value` as an int >= least, or ValueError naming the argument (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


def _positive(name: str, value) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def cache_elements_per_token(config: MLAConfig, scheme: str) -> int:
    """Cached elements per token per layer for `scheme` at this config's head count and widths.

    scheme: "mha", "gqa-N" (N groups), "mqa", "mla", "mla-expanded".
    """
    h, d_h = config.num_heads, config.v_head_dim
    if scheme == "mha":
        return 2 * h * d_h
    if scheme.startswith("gqa-"):
        count = scheme.split("-", 1)[1]
        if not count.isdigit():
            raise ValueError(f"cache scheme {scheme!r}: expected gqa-N with N a group count")
        groups = int(count)
        if not 0 < groups <= h:
            raise ValueError(f"GQA groups must lie in [1, num_heads={h}], got {groups}")
        return 2 * groups * d_h
    if scheme == "mqa":
        return 2 * d_h
    if scheme in ("mla", *FP8_SCHEMES):
        return config.kv_lora_rank + config.qk_rope_head_dim
    if scheme == "mla-expanded":
        return h * (config.qk_head_dim + config.v_head_dim)
    raise ValueError(f"unknown cache scheme {scheme!r}; expected mha, gqa-N, mqa, mla, "
                     f"{', '.join(FP8_SCHEMES)}, mla-expanded")


def latent_cache_bytes_per_token(config: MLAConfig, kv_cache_dtype: str = "auto",
                                 bytes_per_element: float = 2.0) -> float:
    """Bytes one token takes in one layer of the paged tier's latent cache.

    kv_cache_dtype: "auto" ((c + r)·bytes_per_element), "fp8_e4m3" (c + r) or "fp8_ds_mla"
    (c + 4·c/128 + 2·r). DeepSeek-V3 (c = 512, r = 64): 1152 in bf16, 576, 656.
    """
    c, r = config.kv_lora_rank, config.qk_rope_head_dim
    if fp8.canonical_kv_cache_dtype(kv_cache_dtype) == "auto":
        return (c + r) * _positive("bytes_per_element", bytes_per_element)
    return fp8.bytes_per_token(kv_cache_dtype, c, r)


def cache_bytes_per_token(config: MLAConfig, scheme: str, bytes_per_element: float = 2.0) -> float:
    """Bytes a token a layer for `scheme`: elements × bytes_per_element, except the fp8 layouts
    of MLA's cache, whose bytes the layout fixes."""
    if scheme in FP8_SCHEMES:
        return latent_cache_bytes_per_token(config, scheme.removeprefix("mla-"))
    return cache_elements_per_token(config, scheme) * _positive("bytes_per_element",
                                                                bytes_per_element)


def mla_equivalent_gqa_groups(config: MLAConfig) -> float:
    """The GQA group count whose cache equals MLA's: (c + r) / (2·d_h). 2.25 for V2/V3."""
    return cache_elements_per_token(config, "mla") / (2 * config.v_head_dim)


def paper_kv_reduction_vs_67b(bits_per_element: float = 6.0) -> float:
    """The DeepSeek-V2 paper's "KV cache reduced by 93.3%" against DeepSeek 67B, recomputed.

    The claim compares deployed caches: V2's MLA cache quantised to ~6 bits an element on average
    (the paper's deployment section) against DeepSeek 67B's bf16 GQA cache. In bf16 both ways
    (bits_per_element=16) the reduction is ~82%.
    """
    bits_per_element = _positive("bits_per_element", bits_per_element)
    v2 = MLAConfig.from_preset("deepseek-v2")
    v2_bytes = NUM_LAYERS["deepseek-v2"] * cache_elements_per_token(v2, "mla") * bits_per_element / 8
    b67 = DEEPSEEK_67B
    b67_bytes = b67["num_layers"] * 2 * b67["num_kv_heads"] * b67["head_dim"] * b67["bytes_per_element"]
    return 1.0 - v2_bytes / b67_bytes


@dataclass(frozen=True)
class AttentionFlops:
    """FLOPs of one layer's attention for s new tokens of one sequence over t cached tokens."""

    up_projected: float  # kv_b_proj over the cache, then MHA with head dim d + r / v
    absorbed: float      # W_UK into the query, MQA over the latent, W_UV on the output


def attention_flops(config: MLAConfig, s: int, t: int) -> AttentionFlops:
    """Attention FLOPs (multiply-adds x 2) beyond the shared projections, s new over t context.

    The new tokens attend causally: the i-th (0-based) of s sees t - s + i + 1 keys, so
    scores total s·(t - s) + s·(s + 1)/2 (t counts the new tokens too).
    """
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in (s, t)) or not (
            0 < s <= t):
        raise ValueError(f"need ints 0 < s <= t, got s={s!r}, t={t!r}")
    h, d, r, v, c = (config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                     config.v_head_dim, config.kv_lora_rank)
    pairs = s * (t - s) + s * (s + 1) / 2  # (query, key) pairs
    up = 2 * t * c * h * (d + v) + 2 * pairs * h * (d + r + v)
    absorbed = 2 * s * h * c * (d + v) + 2 * pairs * h * (c + r + c)
    return AttentionFlops(up_projected=up, absorbed=absorbed)


def prefill_crossover(config: MLAConfig, context: int) -> int:
    """Smallest number of new tokens over `context` cached ones for which up-projection needs
    fewer FLOPs than absorption (1 if it always does; the search stops at 1<<20)."""
    context = _count("context", context, 0)
    s = 1
    while s < 1 << 20:
        f = attention_flops(config, s, context + s)
        if f.up_projected < f.absorbed:
            return s
        s += 1
    return s


def kv_cache_table(config: MLAConfig, seq_len: int, num_layers: int,
                   bytes_per_element: float = 2.0,
                   schemes=("mha", "gqa-8", "mqa", "mla", *FP8_SCHEMES, "mla-expanded")):
    """One dict a scheme: `scheme`, `elements_per_token_layer`, `bytes_per_token` (all
    `num_layers` layers) and `bytes_per_sequence` (`seq_len` tokens). bytes_per_element applies to
    every scheme but the fp8 ones, whose layout fixes their bytes."""
    seq_len = _count("seq_len", seq_len, 0)
    num_layers = _count("num_layers", num_layers, 1)
    bytes_per_element = _positive("bytes_per_element", bytes_per_element)
    rows = []
    for scheme in schemes:
        per_layer = cache_elements_per_token(config, scheme)
        per_token = cache_bytes_per_token(config, scheme, bytes_per_element) * num_layers
        rows.append(dict(scheme=scheme, elements_per_token_layer=per_layer,
                         bytes_per_token=per_token, bytes_per_sequence=per_token * seq_len))
    return rows
