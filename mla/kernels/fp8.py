"""The two fp8 layouts of the latent cache, as plain torch: how a row is quantised and read back.

A cache row holds one token's ``[kv_c | k_pe]`` (c latent values, then r rope values). Two fp8
layouts keep it in fewer bytes than the weights' dtype (``"auto"``, 2·(c + r) bytes in bf16):

``"fp8_e4m3"`` (alias ``"fp8"``): a ``float8_e4m3fn`` cache of width c + r and ONE float32 scale
for the whole cache, given by the caller (finite and at least 2^-126, ``check_e4m3_scale``)::

    row = e4m3(clamp([kv_c | k_pe] / scale, -448, 448))          # (c + r,) one byte a value
                                                                  # (a NaN as 0x7F)
    [kv_c | k_pe] ~= row.float() * scale

``"fp8_ds_mla"`` (FlashMLA's "FP8 with scale" token, vLLM's name): a ``uint8`` cache of
c + 4·c/128 + 2·r bytes a token (656 for c = 512, r = 64), scales computed per token and per
group of 128 latent values as the row is written::

    bytes [0, c)                    e4m3(clamp(kv_c[g·128 + j] / scale[g], -448, 448))
    bytes [c, c + 4·c/128)          scale[g] = max(amax_g / 448, 2^-126), float32 little-endian
    bytes [c + 4·c/128, ... + 2·r)  k_pe in bfloat16, little-endian

with amax_g = max |kv_c| over group g. Every rounding is to nearest, ties to even: the scale is
the float32 quotient amax_g / 448 (IEEE division), the value the float32 quotient x / scale
clamped to +-448 (the clamp catches the one-ulp overshoot of amax_g / scale), then rounded to
e4m3; k_pe is rounded to bfloat16. A group of zeros (or of values below 448·2^-126) takes the
floor scale 2^-126, a normal float32, so no reader ever divides by zero or multiplies by a
denormal; its values encode as zeros of their sign. A NaN (inf) in a group makes that group's
scale NaN (inf) and its values NaN (NaN or zero): one bad value spoils its 128 neighbours and
no more. Every NaN is stored as the positive quiet NaN of its format (float32 0x7FC00000, e4m3
0x7F, bf16 0x7FC0), so all writers agree on its bits. docs/derivations/fp8-cache.md derives the error
bound the tests check.

These functions are the spec that ``concat_and_cache`` (torch reference, C++ twin, CUDA kernel)
writes to and that the decode kernels read against.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "KV_CACHE_DTYPES", "LAYOUTS", "DS_MLA_GROUP", "E4M3_MAX", "MIN_SCALE", "canonical_kv_cache_dtype",
    "fp8_available", "bytes_per_token", "ds_mla_layout", "quantize_e4m3", "dequantize_e4m3",
    "calibrate_e4m3_scale", "quantize_ds_mla", "dequantize_ds_mla", "dequantize_rows",
    "require_fp8", "cache_row", "check_e4m3_scale",
]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")  # what kv_cache_dtype accepts
LAYOUTS = ("auto", "fp8_e4m3", "fp8_ds_mla")  # their canonical names, in the order tables list them
DS_MLA_GROUP = 128  # latent values sharing one float32 scale in fp8_ds_mla
E4M3_MAX = 448.0  # largest finite float8_e4m3fn: 2^8 · 1.75
MIN_SCALE = 2.0**-126  # the smallest normal float32: the floor of every computed scale

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def canonical_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """``"auto"``, ``"fp8_e4m3"`` or ``"fp8_ds_mla"`` (``"fp8"`` is ``"fp8_e4m3"``); ValueError
    naming ``kv_cache_dtype`` for anything else."""
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return "fp8_e4m3"
    if kv_cache_dtype in ("auto", "fp8_ds_mla"):
        return kv_cache_dtype
    raise ValueError(
        f"kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_ds_mla', got {kv_cache_dtype!r}"
    )


def fp8_available() -> bool:
    """Whether this torch build has ``torch.float8_e4m3fn`` (torch >= 2.1)."""
    return hasattr(torch, "float8_e4m3fn")


def require_fp8(kv_cache_dtype: str) -> None:
    """A RuntimeError naming ``kv_cache_dtype`` where this torch has no float8_e4m3fn."""
    if not fp8_available():
        raise RuntimeError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs torch.float8_e4m3fn, which this torch "
            f"{torch.__version__} lacks (torch >= 2.1 has it); use kv_cache_dtype='auto'"
        )


def _ds_mla_groups(kv_lora_rank: int) -> int:
    if kv_lora_rank <= 0 or kv_lora_rank % DS_MLA_GROUP:
        raise ValueError(
            f"kv_lora_rank c must be a positive multiple of {DS_MLA_GROUP} for "
            f"kv_cache_dtype='fp8_ds_mla' (one float32 scale per {DS_MLA_GROUP} values), got "
            f"c = {kv_lora_rank}"
        )
    return kv_lora_rank // DS_MLA_GROUP


def bytes_per_token(kv_cache_dtype: str, kv_lora_rank: int, rope_dim: int,
                    dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token takes in one layer's cache: (c + r)·itemsize for ``"auto"`` (``dtype`` is
    the weights' dtype), c + r for ``"fp8_e4m3"``, c + 4·c/128 + 2·r for ``"fp8_ds_mla"``.
    DeepSeek-V3 (c = 512, r = 64): 1152 (bf16), 576, 656."""
    kind = canonical_kv_cache_dtype(kv_cache_dtype)
    c, r = int(kv_lora_rank), int(rope_dim)
    if kind == "auto":
        return (c + r) * torch.empty((), dtype=dtype).element_size()
    if kind == "fp8_e4m3":
        return c + r
    return c + 4 * _ds_mla_groups(c) + 2 * r


def cache_row(kv_cache_dtype: str, kv_lora_rank: int, rope_dim: int,
              dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(the cache tensor's dtype, its last dim) for a layout: (``dtype``, c + r) for ``"auto"``
    (``dtype`` is the values'), (float8_e4m3fn, c + r) for ``"fp8_e4m3"``, (uint8,
    c + 4·c/128 + 2·r) for ``"fp8_ds_mla"`` (c a multiple of 128, else a ValueError)."""
    kind = canonical_kv_cache_dtype(kv_cache_dtype)
    if kind == "fp8_ds_mla":
        return torch.uint8, bytes_per_token(kind, kv_lora_rank, rope_dim)
    storage = dtype if kind == "auto" else getattr(torch, "float8_e4m3fn", None)
    return storage, kv_lora_rank + rope_dim


def ds_mla_layout(kv_lora_rank: int, rope_dim: int) -> dict[str, tuple[int, int]]:
    """Byte ranges [start, end) of one fp8_ds_mla token: ``values``, ``scales``, ``rope``.
    For c = 512, r = 64: (0, 512), (512, 528), (528, 656)."""
    groups = _ds_mla_groups(kv_lora_rank)
    c, r = kv_lora_rank, rope_dim
    return {"values": (0, c), "scales": (c, c + 4 * groups),
            "rope": (c + 4 * groups, c + 4 * groups + 2 * r)}


def _check_rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    for name, t, shape in (("kv_c", kv_c, "(T, c)"), ("k_pe", k_pe, "(T, r)")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor {shape}")
        if t.dtype not in _INPUT_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    if k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(f"k_pe must have kv_c's T = {kv_c.shape[0]} rows, got {k_pe.shape[0]}")


# ----------------------------------------------------------------------------------------------
# fp8_e4m3: one scale for the whole cache


# The rule for a caller's scale: finite and at least MIN_SCALE = 2^-126, the floor every computed
# scale already has (calibrate_e4m3_scale, the fp8_ds_mla group scales), so no writer divides by
# a float32 subnormal and no reader multiplies by one. The CUDA writer's x / s and the readers'
# float32 q · s (Triton, sm80, sm90) keep subnormals as built; where they are flushed to zero
# (nvcc --use_fast_math, torch.set_flush_denormal(True) on the CPU) a subnormal s reads as 0: the
# writer stores +-448 for every x != 0 and NaN for x = 0, the reader returns zeros. Kept, it
# still rounds the products q · s to multiples of 2^-149, so small stored values lose bits. And
# such a scale holds nothing a model writes: its largest value, 448 · s, is below 5e-36.


def check_e4m3_scale(fn: str, name: str, scale, device: torch.device | str, *,
                     read_value: bool) -> torch.Tensor:
    """The ``"fp8_e4m3"`` cache's scale ``scale`` as the (1,) float32 tensor on ``device`` that
    the writers and readers take.

    ``scale`` is a float (a Python or numpy real, not a bool) or a 1-element float32 tensor on
    ``device`` or the CPU; its value must be finite and at least ``MIN_SCALE`` = 2^-126 as a
    float32. Anything else is a TypeError, a tensor on another device or a bad value a
    ValueError, each naming ``fn`` and the argument ``name``. A float's value is always checked,
    and a CPU tensor's; a tensor on a GPU only with ``read_value``, since reading it is a host
    sync: callers that must not sync (a CUDA-graph capture, a decode step) pass False and trust
    the tensor they are given (the cache's own).
    """
    device = torch.device(device)
    where = "the CPU" if device.type == "cpu" else f"{device} or the CPU"
    expected = f"a float or a 1-element float32 tensor on {where}"
    # a CUDA graph capture cannot copy a host value to the GPU: the scale must be there already
    capturing = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if capturing and not (isinstance(scale, torch.Tensor) and scale.device.type == "cuda"):
        raise ValueError(f"{fn}: {name} must be a 1-element float32 tensor on {device} under CUDA graph "
                         f"capture (a host value cannot be copied to the GPU there), got "
                         f"{'a tensor on the CPU' if isinstance(scale, torch.Tensor) else repr(scale)}")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise TypeError(f"{fn}: {name} must be {expected}, got a tensor of shape "
                            f"{tuple(scale.shape)} and dtype {scale.dtype}")
        on = scale.device  # "cuda" names the current GPU, as "cuda:0" may
        same = on.type == device.type and (on.index == device.index
                                           or None in (on.index, device.index))
        if on.type != "cpu" and not same:
            raise ValueError(f"{fn}: {name} must be {expected}, got a tensor on {on}")
        given = float(scale) if read_value or on.type == "cpu" else None
        value = given
        scale = scale.reshape(1).to(device)
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        given = float(scale)
        host = torch.tensor([given], dtype=torch.float32)  # rounded as the kernels read it
        value = float(host)
        scale = host.to(device)
    else:
        raise TypeError(f"{fn}: {name} must be {expected}, got {type(scale).__name__} {scale!r}")
    if value is not None and not (math.isfinite(value) and value >= MIN_SCALE):
        raise ValueError(f"{fn}: {name} must be positive and finite, at least 2^-126 (the "
                         f"smallest normal float32), got {given}")
    return scale


def quantize_e4m3(kv_c: torch.Tensor, k_pe: torch.Tensor,
                  scale: float | torch.Tensor) -> torch.Tensor:
    """(T, c), (T, r) -> (T, c + r) float8_e4m3fn rows: e4m3(clamp([kv_c | k_pe] / s, ±448))."""
    require_fp8("fp8_e4m3")
    _check_rows(kv_c, k_pe)
    s = check_e4m3_scale("quantize_e4m3", "scale", scale, kv_c.device, read_value=True)
    rows = torch.cat([kv_c, k_pe], dim=-1).float()  # (T, c + r)
    # Divide by a tensor, never a Python scalar: CUDA would multiply by the reciprocal.
    v = (rows / s).clamp(-E4M3_MAX, E4M3_MAX)
    return v.masked_fill(v.isnan(), math.nan).to(torch.float8_e4m3fn)  # a NaN as 0x7F


def dequantize_e4m3(rows: torch.Tensor, kv_lora_rank: int,
                    scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, c + r) float8_e4m3fn rows -> kv_c (T, c), k_pe (T, r) float32 = row · scale."""
    require_fp8("fp8_e4m3")
    if rows.dtype != torch.float8_e4m3fn:
        raise TypeError(f"rows must be torch.float8_e4m3fn, got {rows.dtype}")
    scale = check_e4m3_scale("dequantize_e4m3", "scale", scale, rows.device, read_value=True)
    x = rows.float() * scale  # (T, c + r)
    return x[..., :kv_lora_rank], x[..., kv_lora_rank:]


def calibrate_e4m3_scale(kv_c: torch.Tensor, k_pe: torch.Tensor,
                         headroom: float = 1.0) -> torch.Tensor:
    """The per-cache scale that maps the largest finite |value| of these rows to 448 / headroom:
    a (1,) float32 tensor max(amax · headroom / 448, 2^-126) on their device, computed there
    (no host sync). Non-finite values are left out: they are stored as NaN or clipped whatever
    the scale, and an inf would make every other value zero. headroom >= 1 leaves room for
    later rows larger than these (the paged cache calibrates with 2)."""
    _check_rows(kv_c, k_pe)
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not (
            1.0 <= headroom < math.inf):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
    amax = torch.zeros(1, dtype=torch.float32, device=kv_c.device)
    for t in (kv_c, k_pe):
        if t.numel():  # one temporary in the rows' own dtype
            amax = torch.maximum(amax, t.abs().nan_to_num_(nan=0.0, posinf=0.0).amax().float())
    limit = torch.tensor(E4M3_MAX / headroom, dtype=torch.float32, device=amax.device)
    return (amax / limit).clamp_min(MIN_SCALE)


def dequantize_rows(rows: torch.Tensor, kv_cache_dtype: str, kv_lora_rank: int, rope_dim: int,
                    scale: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored cache rows (..., width) of a layout -> (..., c + r) values ``[kv_c | k_pe]`` in
    ``dtype``: as they are for ``"auto"``, ``row · scale`` for ``"fp8_e4m3"`` (``scale``: the
    cache's (1,) float32 tensor), value · its group's scale and the bf16 rope for
    ``"fp8_ds_mla"``. The product is formed in float32 and rounded once to ``dtype``, as the
    decode kernels do in registers. ``scale`` may also be a float; its value is checked as
    ``check_e4m3_scale`` does, a GPU tensor's excepted (no host sync: it is the cache's own).
    Rows of the wrong dtype or width, or a missing scale, raise naming the argument."""
    kind = canonical_kv_cache_dtype(kv_cache_dtype)
    if kind == "fp8_ds_mla":
        kv_c, k_pe = dequantize_ds_mla(rows, kv_lora_rank, rope_dim)
        return torch.cat([kv_c, k_pe], dim=-1).to(dtype)
    width = kv_lora_rank + rope_dim
    if not isinstance(rows, torch.Tensor) or rows.dim() < 1 or rows.shape[-1] != width:
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"dequantize_rows: rows must be (..., c + r = {width}), got {got}")
    if kind == "auto":
        if rows.dtype not in _INPUT_DTYPES:
            raise TypeError(f"dequantize_rows: rows of an 'auto' cache must be bfloat16, float16 "
                            f"or float32, got {rows.dtype}")
        return rows.to(dtype)
    require_fp8(kind)
    if rows.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequantize_rows: rows of an fp8_e4m3 cache must be "
                        f"torch.float8_e4m3fn, got {rows.dtype}")
    if scale is None:
        raise ValueError("dequantize_rows: an fp8_e4m3 cache's rows need its scale")
    scale = check_e4m3_scale("dequantize_rows", "scale", scale, rows.device, read_value=False)
    return (rows.float() * scale).to(dtype)


# ----------------------------------------------------------------------------------------------
# fp8_ds_mla: 128-value groups with their own scale, rope kept in bf16


def quantize_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """(T, c), (T, r) -> (T, c + 4·c/128 + 2·r) uint8 rows in FlashMLA's layout (module doc)."""
    require_fp8("fp8_ds_mla")
    _check_rows(kv_c, k_pe)
    T, c = kv_c.shape
    groups = _ds_mla_groups(c)
    x = kv_c.float().reshape(T, groups, DS_MLA_GROUP)  # (T, c/128, 128)
    amax = x.abs().amax(dim=-1)  # (T, c/128); NaN propagates
    scale = (amax / torch.tensor(E4M3_MAX, device=x.device)).clamp_min(MIN_SCALE)  # (T, c/128)
    values = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # (T, c/128, 128)
    rope = k_pe.to(torch.bfloat16).contiguous()  # (T, r)
    # every NaN stored as the positive quiet NaN of its format (float32 0x7FC00000, e4m3 0x7F,
    # bf16 0x7FC0), so all writers agree on its bits
    scale = scale.masked_fill(scale.isnan(), math.nan)
    values = values.masked_fill(values.isnan(), math.nan).to(torch.float8_e4m3fn)
    rope = rope.masked_fill(rope.isnan(), math.nan)
    return torch.cat([values.view(torch.uint8).reshape(T, c),
                      scale.contiguous().view(torch.uint8).reshape(T, 4 * groups),
                      rope.view(torch.uint8).reshape(T, 2 * k_pe.shape[1])], dim=-1)


def dequantize_ds_mla(rows: torch.Tensor, kv_lora_rank: int,
                      rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., c + 4·c/128 + 2·r) uint8 rows -> kv_c (..., c) = value · scale of its group and
    k_pe (..., r), both float32."""
    require_fp8("fp8_ds_mla")
    layout = ds_mla_layout(kv_lora_rank, rope_dim)
    width = layout["rope"][1]
    if rows.dtype != torch.uint8 or rows.shape[-1] != width:
        raise ValueError(
            f"rows must be uint8 (..., {width}) for c = {kv_lora_rank}, r = {rope_dim}, got "
            f"{rows.dtype} {tuple(rows.shape)}"
        )
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, width).contiguous()  # (N, width)
    groups = kv_lora_rank // DS_MLA_GROUP
    (v0, v1), (s0, s1), (p0, p1) = layout["values"], layout["scales"], layout["rope"]
    values = rows[:, v0:v1].contiguous().view(torch.float8_e4m3fn).float()  # (N, c)
    scale = rows[:, s0:s1].contiguous().view(torch.float32)  # (N, c/128)
    kv_c = (values.reshape(-1, groups, DS_MLA_GROUP) * scale[..., None]).reshape(-1, kv_lora_rank)
    k_pe = rows[:, p0:p1].contiguous().view(torch.bfloat16).float()  # (N, r)
    return kv_c.reshape(*lead, kv_lora_rank), k_pe.reshape(*lead, rope_dim)
