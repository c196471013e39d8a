"""LatentCache: what MLA keeps per token, for the naive and absorbed tiers.

MLA caches c + r numbers a token, shared by all heads: the normed KV latent kv_c_normed (c) and
the rotated rope key k_pe (r). MHA would cache 2·h·(d+r)-ish numbers; see `mla.memory`.
The naive and absorbed tiers keep the two parts as contiguous (b, t, ·) buffers, one row per
sequence (as DeepSeek-V3's inference code does); the paged tier stores the same c + r values per
token in pages (mla/paged/cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def append(self, kv_c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
        """Write row i's first lengths[i] new tokens at positions seq_lens[i]...; bump seq_lens.

        kv_c (b, s, c), k_pe (b, s, r), lengths (b,) int64 on the CPU; callers have checked
        that seq_lens + lengths <= max_seq_len.
        """
        s = kv_c.shape[1]
        rows, cols = torch.nonzero(torch.arange(s) < lengths[:, None], as_tuple=True)  # real tokens
        slots = self.seq_lens[rows] + cols
        rows_d, cols_d, slots_d = (t.to(self.kv_c.device) for t in (rows, cols, slots))
        self.kv_c[rows_d, slots_d] = kv_c[rows_d, cols_d]
        self.k_pe[rows_d, slots_d] = k_pe[rows_d, cols_d]
        self.seq_lens += lengths
