"""DeepSeek's rotary position embedding: interleaved pairs, YaRN scaling, the softmax mscale.

RoPE rotates the r rotary dims of a query or key as r/2 pairs, and DeepSeek checkpoints pair
*neighbouring* dims, (x0, x1), (x2, x3), ...; rotating the halves instead (Llama's
`rotate_half`) runs but disagrees with every real checkpoint. Pair i at position m turns by
m·θ_i, θ_i = base^(-2i/r). YaRN (arXiv:2309.00071) interpolates the slow pairs (θ_i / factor),
keeps the fast ones, ramps between them, and multiplies cos and sin by
mscale(factor, mscale) / mscale(factor, mscale_all_dim) (`rope_attention_factor`). Angles are
float32, as in the code the checkpoints were trained with. Derivation: docs/derivations/rope.md.
"""

from __future__ import annotations

import math

import torch

from .config import MLAConfig, yarn_get_mscale


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, original_len: int) -> float:
    # The pair index whose wavelength fits `num_rotations` times in the original context.
    return (dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(config: MLAConfig) -> tuple[int, int]:
    """The pair indices [low, high] between which YaRN blends interpolated and original θ_i."""
    yarn = config.yarn
    assert yarn is not None
    dim, base = config.qk_rope_head_dim, config.rope_theta
    original = yarn["original_max_position_embeddings"]
    low = math.floor(_yarn_correction_dim(yarn["beta_fast"], dim, base, original))
    high = math.ceil(_yarn_correction_dim(yarn["beta_slow"], dim, base, original))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(config: MLAConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """θ_i for the r/2 pairs, float32 (r/2,), with YaRN applied when the config has it."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    # base^(2i/r): the same float32 operations, in the same order, as HF's implementation
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    yarn = config.yarn
    if yarn is None:
        return inv_freq
    inv_freq_interpolated = 1.0 / (yarn["factor"] * pos_freqs)
    low, high = yarn_correction_range(config)
    high_f = high + 0.001 if low == high else float(high)  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
            / (high_f - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: pair keeps θ_i (fast, short wavelength); 0: pair takes θ_i / factor
    return inv_freq_interpolated * (1 - keep) + inv_freq * keep


def rope_attention_factor(config: MLAConfig) -> float:
    """YaRN's multiplier on cos and sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    when both are non-zero, else mscale(factor), as HF computes it; 1 without YaRN."""
    yarn = config.yarn
    if yarn is None:
        return 1.0
    if yarn["mscale"] and yarn["mscale_all_dim"]:
        return yarn_get_mscale(yarn["factor"], yarn["mscale"]) / yarn_get_mscale(
            yarn["factor"], yarn["mscale_all_dim"])
    return yarn_get_mscale(yarn["factor"])


def rope_cos_sin(config: MLAConfig, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(m·θ_i) and sin(m·θ_i) for integer positions m of any shape: (..., r/2) in `dtype`.

    Both carry YaRN's attention factor, as in HF's implementation.
    """
    inv_freq, factor = _rope_tables(config, positions)  # (r/2,), float
    # (..., r/2) float32: the integer positions are cast to float32 as the product is formed
    angles = positions[..., None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:   # x · 1.0 is x: the multiply would change nothing
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


# θ_i and the attention factor of each RoPE setting on each device, built once: every call of a
# layer needs them, and building θ_i takes a dozen small operations (kernel launches on a GPU).
_TABLES: dict[tuple, tuple[torch.Tensor, float]] = {}


def _rope_tables(config: MLAConfig, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(rope_inv_freq, rope_attention_factor) of `config` on positions' device, from `_TABLES`.
    Only plain tensors are kept, built outside CUDA-graph capture (a captured table's memory
    belongs to the graph); positions of a tracer (a fake tensor) get a table built in its mode."""
    device = positions.device
    if type(positions) is not torch.Tensor:
        return rope_inv_freq(config, device=device), rope_attention_factor(config)
    yarn = config.yarn
    key = (config.qk_rope_head_dim, config.rope_theta,
           None if yarn is None else tuple(sorted(yarn.items())), device)
    tables = _TABLES.get(key)
    if tables is None:
        tables = rope_inv_freq(config, device=device), rope_attention_factor(config)
        if type(tables[0]) is torch.Tensor and not (
                device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _TABLES[key] = tables
    return tables


# --8<-- [start:apply_rope]
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs (x0, x1), (x2, x3), ... of the last dim.

    x: (..., r); cos, sin: broadcastable to (..., r/2). Returns a new tensor in x's layout:
    out[2i] = x[2i]·cos_i - x[2i+1]·sin_i,  out[2i+1] = x[2i+1]·cos_i + x[2i]·sin_i.
    """
    pairs = x.unflatten(-1, (-1, 2))  # (..., r/2, 2)
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1)
    return rotated.flatten(-2)
# --8<-- [end:apply_rope]
