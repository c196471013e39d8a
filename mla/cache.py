"""LatentCache: what MLA keeps per token, for the naive and absorbed tiers.

MLA caches c + r numbers a token, shared by all heads: the normed KV latent kv_c_normed (c) and
the rotated rope key k_pe (r). A cache of every head's key and value at these widths would hold
h·(d + r + v) numbers a token ("mla-expanded" in `mla.memory`, beside MHA, GQA and MQA).
The naive and absorbed tiers keep the two parts as contiguous (b, t, ·) buffers, one row per
sequence (as DeepSeek-V3's inference code does); the paged tier stores the same c + r values per
token in pages (mla/paged/cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_cache_fits(cache, *, batch_size: int, kv_lora_rank: int, rope_dim: int,
                     dtype: torch.dtype, device: torch.device | str) -> None:
    """The checks every tier runs on `cache` before writing: it must hold c + r values a token
    of the layer's kv_lora_rank and rope width, in the weights' dtype, on their device, with
    `batch_size` rows. `cache` is a LatentCache or a paged cache (anything with those
    attributes). Raises ValueError naming `cache` and what was expected (ValueError for the
    dtype too, as the paged tier's ragged entry does); writes nothing.
    """
    remedy = "make the cache with this layer's new_cache()"
    if (cache.kv_lora_rank, cache.rope_dim) != (kv_lora_rank, rope_dim):
        raise ValueError(
            f"cache holds latents of c + r = {cache.kv_lora_rank} + {cache.rope_dim} values a "
            f"token (kv_lora_rank + rope width), but this layer expects {kv_lora_rank} + "
            f"{rope_dim}; {remedy}")
    if cache.dtype != dtype:
        raise ValueError(f"cache has dtype {cache.dtype} but the weights are {dtype}; {remedy}")
    if cache.device != torch.device(device):
        raise ValueError(f"cache is on {cache.device} but the weights are on {device}; {remedy}")
    if cache.batch_size != batch_size:
        raise ValueError(f"cache was made for batch {cache.batch_size} but x has batch "
                         f"{batch_size}; make it with new_cache({batch_size}, max_seq_len)")


@dataclass
class LatentCache:
    """Per-sequence latent cache.

    Attributes:
        kv_c: (b, t_max, c) normed KV latents, rows 0..seq_lens[i]-1 valid for sequence i.
        k_pe: (b, t_max, r) rotated rope keys.
        seq_lens: (b,) int64, tokens cached so far per sequence (on the CPU: the tiers read it
            on the host to validate and to build masks).
    """

    kv_c: torch.Tensor
    k_pe: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int, max_seq_len: int, kv_lora_rank: int, rope_dim: int, *,
              dtype: torch.dtype, device: torch.device | str) -> LatentCache:
        for name, value in (("batch_size", batch_size), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        return cls(
            kv_c=torch.zeros(batch_size, max_seq_len, kv_lora_rank, dtype=dtype, device=device),
            k_pe=torch.zeros(batch_size, max_seq_len, rope_dim, dtype=dtype, device=device),
            seq_lens=torch.zeros(batch_size, dtype=torch.int64),
        )

    @property
    def batch_size(self) -> int:
        return self.kv_c.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.kv_c.shape[1]

    @property
    def kv_lora_rank(self) -> int:
        return self.kv_c.shape[-1]

    @property
    def rope_dim(self) -> int:
        return self.k_pe.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_c.dtype

    @property
    def device(self) -> torch.device:
        return self.kv_c.device

    def check_fits(self, *, batch_size: int, kv_lora_rank: int, rope_dim: int,
                   dtype: torch.dtype, device: torch.device | str) -> None:
        """Raise unless this cache can take a layer's latents: kv_lora_rank (c), rope width (r),
        dtype and device of the layer's weights, and a call of `batch_size` rows. Writes nothing.

        Also checks that the cache's own tensors agree (kv_c (b, t, c) and k_pe (b, t, r) of one
        dtype and device, seq_lens (b,) int64 on the CPU), as a hand-made LatentCache may not.
        """
        kv_c, k_pe, seq_lens = self.kv_c, self.k_pe, self.seq_lens
        if kv_c.dim() != 3 or k_pe.dim() != 3 or kv_c.shape[:2] != k_pe.shape[:2]:
            raise ValueError(f"cache.kv_c (b, t, c) and cache.k_pe (b, t, r) must be 3-D with the "
                             f"same b and t, got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
        if (k_pe.dtype, k_pe.device) != (kv_c.dtype, kv_c.device):
            raise ValueError(f"cache.kv_c is {kv_c.dtype} on {kv_c.device} but cache.k_pe is "
                             f"{k_pe.dtype} on {k_pe.device}; they must match")
        if (seq_lens.shape != (kv_c.shape[0],) or seq_lens.dtype != torch.int64
                or seq_lens.device.type != "cpu"):
            raise ValueError(f"cache.seq_lens must be a ({kv_c.shape[0]},) int64 CPU tensor, got "
                             f"{seq_lens.dtype} of shape {tuple(seq_lens.shape)} on "
                             f"{seq_lens.device}")
        check_cache_fits(self, batch_size=batch_size, kv_lora_rank=kv_lora_rank,
                         rope_dim=rope_dim, dtype=dtype, device=device)

    def append(self, kv_c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
        """Write row i's first lengths[i] new tokens at positions seq_lens[i]...; bump seq_lens.

        kv_c (b, s, c), k_pe (b, s, r), lengths (b,) int64 on the CPU; callers have checked
        that seq_lens + lengths <= max_seq_len. Raises before writing if the new latents do not
        fit the cache (shape, dtype, device).
        """
        b, c, r = self.batch_size, self.kv_lora_rank, self.rope_dim
        if kv_c.dim() != 3 or tuple(kv_c.shape[::2]) != (b, c):
            raise ValueError(f"append: kv_c must have shape (b={b}, s, c={c}), "
                             f"got {tuple(kv_c.shape)}")
        s = kv_c.shape[1]
        if tuple(k_pe.shape) != (b, s, r):
            raise ValueError(f"append: k_pe must have shape (b={b}, s={s}, r={r}), "
                             f"got {tuple(k_pe.shape)}")
        for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
            if (t.dtype, t.device) != (self.dtype, self.device):
                raise ValueError(f"append: {name} is {t.dtype} on {t.device}, the cache "
                                 f"{self.dtype} on {self.device}")
        rows, cols = torch.nonzero(torch.arange(s) < lengths[:, None], as_tuple=True)  # real tokens
        slots = self.seq_lens[rows] + cols
        rows_d, cols_d, slots_d = (t.to(self.kv_c.device) for t in (rows, cols, slots))
        self.kv_c[rows_d, slots_d] = kv_c[rows_d, cols_d]
        self.k_pe[rows_d, slots_d] = k_pe[rows_d, cols_d]
        self.seq_lens += lengths
