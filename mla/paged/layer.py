"""Tier 3, paged: MLA over a paged latent cache, with the two kernels of mla.kernels.

The math is the absorbed tier's (mla/absorbed.py); what changes is where the latent lives and who
computes. One call, for the new tokens of n sequences flattened into T rows:

    x (T, hidden) -> c_q, q_nope (T, h, d), q_pe (T, h, r)         naive.query_* (eqs. 37-40)
                  -> [kv_c_normed | k_pe] (T, c + r)                 naive.latent (eqs. 41, 43)
    cache.append: pages from the allocator, slot mapping, concat_and_cache writes each row
    decode rows (1 new token):
        q = [q_nope · W_UK | q_pe] (b, h, c + r)                    W_UK absorbed into the query
        o_lat (b, h, c) = mla_decode(q, pages)                      split-KV (Triton; CUDA stage 1
                                                                    at <= 16 heads, wgmma beyond
                                                                    on Hopper), MQA over the
                                                                    latent, value = first c dims
        o = o_lat · W_UV (b, h, v)                                  W_UV absorbed on the way out
    prefill / extend rows (> 1 new token):
        gather the row's pages (t, c + r), attend_up_projected      naive (eqs. 42, 44-46)
    y = W_O o (T, hidden)                                           eq. (47), all-reduced under TP

Why prefill up-projects: for s new tokens over t cached ones the up-projection costs
2·t·c·(d+v) a head once, shared by the s queries, while absorbed attention costs
(c+r+c)/(d+r+v) = 3.4x more per score (V3 sizes; mla/absorbed.py has the derivation), so long
chunks are cheaper up-projected and single tokens absorbed. `prefill_path` chooses per row: with
`prefill="auto"` (default) rows of fewer than `prefill_crossover` new tokens attend absorbed, longer
ones up-projected; "up-project" / "absorbed" force one path.

Where the crossover constant comes from: `PREFILL_CROSSOVER` below, 64 new tokens, measured by
benchmarks/bench_prefill.py on an H200 (both paths of this layer's `_prefill`, gather included,
V3 sizes, bf16, 4096 cached tokens; benchmarks/results/h200-prefill.json). The FLOP model,
mla.memory.prefill_crossover, gives 168 there.

CUDA graphs: `decode_step` is a decode entry without host syncs (device tensors in, the raw
concat op, `mla_decode` with a fixed split count), so one decode step of a fixed batch can be
captured and replayed; `decode_inputs` prepares its tensors outside the graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..absorbed import PREFILL_MODES, attend_absorbed
from ..kernels import concat_and_cache, mla_decode, mla_decode_reference
from ..kernels.extension import extension_available
from ..base import MLAAttention
from ..naive import (attend_up_projected, causal_mask, latent, query_latent, query_nope,
                     query_rope)
from ..rope import rope_cos_sin
from ..weights import MLAWeights
from .cache import PagedLatentCache, _ragged_index

# The options of `PagedMLA(prefill=...)`: "auto" chooses per row by `prefill_crossover`.
PAGED_PREFILL_MODES = ("auto", *PREFILL_MODES)

# Rows with at least this many new tokens up-project under prefill="auto"; shorter ones absorb.
# Measured, not modelled: benchmarks/bench_prefill.py on one H200 (2026-12-02, bf16, DeepSeek-V3
# sizes, 4096 cached tokens, s = 1, 2, 4, ... 4096; benchmarks/results/h200-prefill.json). One
# sequence: absorbed is faster up to s = 32 (1.74 vs 1.95 ms), up-projection from s = 64 on
# (2.46 vs 2.79 ms; 1.9x at s = 4096). A batch of 4: absorbed up to 64, up-projection from 128.
# The FLOP model (mla.memory.prefill_crossover) says 168: the absorbed path's float32 scores
# over 1088-wide rows cost more than its FLOP count says, the up-projection (one bf16 GEMM) less.
PREFILL_CROSSOVER = 64


class PagedMLA(MLAAttention):
    """MLA over a paged latent cache: Triton split-KV decode, up-projected prefill.

    Args:
        weights: the layer's MLAWeights (shared, not copied).
        block_size: tokens a cache page (n), any int >= 1; 64 by default (FlashMLA's page).
        num_blocks: pages in a cache from `new_cache`; None = batch_size · ceil(max_seq_len / n),
            room for every row at full length.
        prefill: how rows with more than one new token attend: "auto" (default: absorbed below
            `prefill_crossover` new tokens, up-projected from there on), "up-project" (keys and
            values up-projected from the gathered latent, the naive dataflow) or "absorbed" (MQA
            over the gathered latent, the absorbed tier's `attend_absorbed`). The last two are
            `mla.absorbed.AbsorbedMLA`'s option values.
        prefill_crossover: the "auto" threshold in new tokens a row; None = PREFILL_CROSSOVER
            (this module's measured constant).
        num_kv_splits: passed to `mla.kernels.mla_decode`; None lets it choose from the batch,
            lengths and SM count (one host sync). Fix it for CUDA-graph capture.
        shuffle: default seed of `new_cache`'s random page order (None: pages in order).
        process_group: tensor parallelism over heads (see `mla.base.MLAAttention`).

    The common call is every tier's: `y = attn(x, cache, lengths)`, x (b, s, hidden). Engines
    that batch many sequences without padding call `forward_ragged`.

    Host syncs per call on a GPU (correctness first; a CUDA-graph decode, issue 4, removes them
    by keeping positions, slots and seq_lens in device buffers and calling the op directly):
    `lengths`/`query_start_loc` are read on the host; positions, the slot mapping, seq_lens and
    grown block-table rows are built on the host and copied to the device;
    `concat_and_cache` reads the slot range (`.item()`); `mla_decode` reads max(seq_lens)
    unless `num_kv_splits` is given.
    """

    tier = "paged"

    def __init__(self, weights: MLAWeights, *, block_size: int = 64, num_blocks: int | None = None,
                 prefill: str = "auto", prefill_crossover: int | None = None,
                 num_kv_splits: int | None = None,
                 shuffle: int | None = None, process_group=None):
        super().__init__(weights, process_group=process_group)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int or None, got {num_blocks!r}")
        if prefill not in PAGED_PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PAGED_PREFILL_MODES}, got {prefill!r}")
        if prefill_crossover is None:
            prefill_crossover = PREFILL_CROSSOVER
        if (not isinstance(prefill_crossover, int) or isinstance(prefill_crossover, bool)
                or prefill_crossover < 1):
            raise ValueError(f"prefill_crossover must be an int >= 1 or None, got "
                             f"{prefill_crossover!r}")
        if num_kv_splits is not None and (not isinstance(num_kv_splits, int) or num_kv_splits < 1):
            raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefill = prefill
        self.prefill_crossover = prefill_crossover
        self.num_kv_splits = num_kv_splits
        self.shuffle = shuffle

    # ---- the cache ----------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_seq_len: int, *, num_blocks: int | None = None,
                  shuffle: int | None = None) -> PagedLatentCache:
        """An empty paged cache for `batch_size` rows of up to `max_seq_len` tokens.

        `num_blocks` and `shuffle` override the layer's options for this cache.
        """
        cfg = self.config
        return PagedLatentCache(
            batch_size, max_seq_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            block_size=self.block_size,
            num_blocks=self.num_blocks if num_blocks is None else num_blocks,
            dtype=self.weights.dtype, device=self.weights.device,
            shuffle=self.shuffle if shuffle is None else shuffle)

    def _check_cache(self, cache: PagedLatentCache) -> None:
        cfg, w = self.config, self.weights
        if not isinstance(cache, PagedLatentCache):
            raise TypeError("cache must be a PagedLatentCache from this tier's new_cache(), "
                            f"got {type(cache).__name__}")
        if (cache.kv_lora_rank, cache.rope_dim) != (cfg.kv_lora_rank, cfg.qk_rope_head_dim):
            raise ValueError(
                f"the cache holds rows of c + r = {cache.kv_lora_rank} + {cache.rope_dim}, this "
                f"layer's latent is {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}")
        if cache.kv_cache.dtype != w.dtype or cache.device != w.device:
            raise ValueError(f"the cache is {cache.kv_cache.dtype} on {cache.device}, the weights "
                             f"{w.dtype} on {w.device}; make it with this layer's new_cache()")

    # ---- the common call ------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cache: PagedLatentCache, lengths=None) -> torch.Tensor:
        """x (b, s, hidden), right-padded by `lengths` (b,) -> y (b, s, hidden); see mla.base.

        Flattens the real tokens row after row and runs them as one ragged batch.
        """
        lengths = self.check_inputs(x, cache, lengths, cache_type=PagedLatentCache)
        self._check_cache(cache)
        b, s, hidden = x.shape
        y = x.new_zeros(b, s, hidden)
        seq_ids = torch.nonzero(lengths > 0).flatten()            # rows that take part
        if seq_ids.numel() == 0:
            return y
        rows, cols = torch.nonzero(torch.arange(s)[None, :] < lengths[:, None], as_tuple=True)
        if rows.numel() == b * s:                                 # no padding: a plain view
            y_flat = self._run(x.reshape(b * s, hidden), cache, seq_ids, lengths)
            return y_flat.view(b, s, hidden)
        rows_d, cols_d = rows.to(x.device), cols.to(x.device)
        y_flat = self._run(x[rows_d, cols_d], cache, seq_ids, lengths[seq_ids])  # (T, hidden)
        y[rows_d, cols_d] = y_flat
        return y

    # ---- the ragged entry for engines -----------------------------------------------------
    def forward_ragged(self, x: torch.Tensor, cache: PagedLatentCache,
                       query_start_loc: torch.Tensor | Sequence[int],
                       seq_ids: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The new tokens of n sequences, flattened without padding: x (T, hidden) -> (T, hidden).

        Args:
            x: (T, hidden) in the weights' dtype and device. Sequence k's new tokens are rows
                query_start_loc[k] ... query_start_loc[k+1] - 1, in order; rows from
                query_start_loc[n] to T are padding (e.g. to a captured graph's size): they are
                written nowhere and their outputs are zeros.
            cache: this layer's PagedLatentCache.
            query_start_loc: (n + 1,) int32/int64, 0 = query_start_loc[0] <= ... <=
                query_start_loc[n] <= T (read on the host). Sequence k has
                query_start_loc[k+1] - query_start_loc[k] new tokens: 1 is a decode, more is a
                prefill or an extend over its cached context, 0 sits out.
            seq_ids: (n,) distinct cache rows the sequences live in; None = rows 0 .. n-1.

        Returns:
            (T, hidden): each token's attention output, causal over its sequence's cached
            tokens and its own earlier new tokens. The tokens are appended to the cache at
            positions seq_lens[seq_ids[k]] + j. Bad input raises before anything is written.
        """
        cfg, w = self.config, self.weights
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[-1] != cfg.hidden_size:
            raise ValueError(f"x must have shape (tokens, hidden_size={cfg.hidden_size}), "
                             f"got {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the weights are {w.dtype}; "
                            "cast one of them")
        if x.device != w.device:
            raise ValueError(f"x is on {x.device} but the weights are on {w.device}")
        self._check_cache(cache)
        T = x.shape[0]
        qsl = torch.as_tensor(query_start_loc)
        if qsl.dtype not in (torch.int32, torch.int64) or qsl.dim() != 1 or qsl.numel() < 1:
            raise TypeError("query_start_loc must be a (n + 1,) int32 or int64 tensor, got "
                            f"{qsl.dtype} of shape {tuple(qsl.shape)}")
        qsl = qsl.to("cpu", torch.int64)
        new_lens = qsl.diff()
        if int(qsl[0]) != 0 or bool((new_lens < 0).any()) or int(qsl[-1]) > T:
            raise ValueError("query_start_loc must start at 0, never decrease and end at most at "
                             f"T={T}, got {qsl.tolist()}")
        n = new_lens.numel()
        if seq_ids is None:
            if n > cache.batch_size:
                raise ValueError(f"{n} sequences but the cache has {cache.batch_size} rows")
            seq_ids = torch.arange(n)
        seq_ids, new_lens = cache._check_rows(seq_ids, new_lens)  # rows, distinct, room
        keep = new_lens > 0
        seq_ids, new_lens = seq_ids[keep], new_lens[keep]
        if seq_ids.numel() == 0:
            return x.new_zeros(T, cfg.hidden_size)
        # the sequences that take part, packed: drop the empty ones' (zero-width) ranges
        return self._run(x, cache, seq_ids, new_lens, starts=qsl[:-1][keep])

    # ---- the hook for choosing how a prefill row attends --------------------------------------
    def prefill_path(self, new_len: int, context_len: int) -> str:
        """How a row with `new_len` > 1 new tokens over `context_len` cached ones attends.

        "up-project" or "absorbed". A forced `prefill` option wins; under "auto", rows of fewer
        than `prefill_crossover` new tokens attend absorbed (the per-score cost dominates and
        absorption skips the up-projection of the whole context), longer rows up-project (its
        cost is shared by the row's queries). `context_len` is not used: the threshold was
        measured at 4096 cached tokens only, and the FLOP model's crossover moves little with
        the context (97 tokens at 64, 168 at 4096, 171 in the limit, V3 sizes).
        """
        if self.prefill != "auto":
            return self.prefill
        return "absorbed" if new_len < self.prefill_crossover else "up-project"

    # ---- one ragged batch -------------------------------------------------------------------
    def _run(self, x: torch.Tensor, cache: PagedLatentCache, seq_ids: torch.Tensor,
             new_lens: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, hidden); seq_ids, new_lens (n,) CPU int64, all new_lens >= 1, checked.

        starts (n,): each sequence's first row in x; None = packed (row after row from 0).
        """
        cfg, w = self.config, self.weights
        c, h, v = cfg.kv_lora_rank, cfg.num_heads, cfg.v_head_dim
        T = x.shape[0]
        packed_starts = torch.cumsum(new_lens, 0) - new_lens
        starts = packed_starts if starts is None else starts
        token_seq, offsets = _ragged_index(new_lens)               # (T_real,) each
        token_rows = starts[token_seq] + offsets                   # where each real token sits
        context_lens = cache.seq_lens[seq_ids].clone()             # (n,) before this call

        # Positions seq_lens + j, their RoPE; padding rows take position 0 (outputs dropped).
        positions = torch.zeros(T, dtype=torch.int64)
        positions[token_rows] = context_lens[token_seq] + offsets
        cos, sin = rope_cos_sin(cfg, positions.to(x.device), x.dtype)  # (T, r/2)

        # The query and the latent, eqs. (37)-(43), as a batch of one sequence of T tokens.
        x1 = x[None]                                               # (1, T, hidden)
        c_q = query_latent(w, x1)                                  # (1, T, q)
        q_nope = query_nope(w, c_q)[0]                             # (T, h, d)
        q_pe = query_rope(w, c_q, cos[None], sin[None])[0]         # (T, h, r)
        kv_c_normed, k_pe = latent(w, x1, cos[None], sin[None])    # (1, T, c), (1, T, r)
        # One (T, c + r) row a token, as the cache stores it; the kernel reads the two parts as
        # row-strided views of it. Packed in the order cache.append expects.
        rows_d = token_rows.to(x.device)
        new_latent = torch.cat([kv_c_normed[0], k_pe[0]], dim=-1)[rows_d]  # (T_real, c + r)
        cache.append(new_latent[:, :c], new_latent[:, c:], seq_ids, new_lens)

        o = x.new_zeros(T, h, v)
        decode = new_lens == 1
        if bool(decode.any()):
            k = torch.nonzero(decode).flatten()
            tok = starts[k].to(x.device)
            o[tok] = self._decode(q_nope[tok], q_pe[tok], cache, seq_ids[k])
        by_path: dict[str, list[int]] = {}
        for k in torch.nonzero(~decode).flatten().tolist():
            path = self.prefill_path(int(new_lens[k]), int(context_lens[k]))
            if path not in PREFILL_MODES:
                raise ValueError(f"prefill_path returned {path!r}; expected one of {PREFILL_MODES}")
            by_path.setdefault(path, []).append(k)
        for path, ks in by_path.items():
            k = torch.tensor(ks)
            tok, o_rows = self._prefill(path, q_nope, q_pe, cache, seq_ids[k], new_lens[k],
                                        context_lens[k], starts[k])
            o[tok] = o_rows

        # Eq. (47), once for every token (one all-reduce under TP); padding rows back to zero.
        y = self.output_projection(o[None])[0]                     # (T, hidden)
        if T > token_rows.numel():
            real = torch.zeros(T, dtype=torch.bool)
            real[token_rows] = True
            y = torch.where(real.to(x.device)[:, None], y, 0.0)
        return y

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache,
                rows: torch.Tensor) -> torch.Tensor:
        """One new token for each of `rows` (already in the cache): q_nope (b, h, d),
        q_pe (b, h, r) -> o (b, h, v). The Triton kernel attends over the pages."""
        w = self.weights
        # Absorb W_UK into the query: q_lat,i = (W^{UK}_i)^T q_C,i; the kernel's query is
        # [q_lat | q_pe], scored against whole cache rows [kv_c | k_pe].
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w.W_UK)                 # (b, h, c)
        q = torch.cat([q_lat, q_pe], dim=-1)                                # (b, h, c + r)
        if rows.numel() == cache.batch_size and bool((rows == torch.arange(rows.numel())).all()):
            block_table = cache.block_table                                 # every row: no copy
        else:
            block_table = cache.block_table[rows.to(cache.device)]
        seq_lens = cache.seq_lens[rows].to(cache.device, torch.int32)
        kernel, extra = mla_decode, {}
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # Triton's CPU interpreter computes tl.dot on bf16 wrongly (it returns garbage), so
            # bf16 on the CPU takes the kernel's torch reference, in float32; GPUs run the kernel.
            kernel, extra = mla_decode_reference, {"compute_dtype": torch.float32}
        o_lat, _ = kernel(q, cache.kv_cache, block_table, seq_lens,
                          kv_lora_rank=self.config.kv_lora_rank,
                          softmax_scale=self.softmax_scale,
                          num_kv_splits=self.num_kv_splits, **extra)         # (b, h, c)
        # Absorb W_UV on the way out: o_i = W^{UV}_i o_lat,i
        return torch.einsum("bhc,hvc->bhv", o_lat, w.W_UV)                  # (b, h, v)

    # ---- the CUDA-graph decode entry -----------------------------------------------------------
    def decode_inputs(self, cache: PagedLatentCache, out: dict | None = None
                      ) -> dict[str, torch.Tensor]:
        """Host side of one `decode_step` over every row of `cache`: one new token a row.

        Allocates the rows' room for the token (all-or-nothing, as `cache.allocate`), builds
        slot_mapping (b,) int64, positions (b,) int64 and seq_lens_after (b,) int32 on the cache's
        device, and advances `cache.seq_lens` by one (the host's bookkeeping: the step that
        follows writes the token). With `out` (a dict from an earlier call, e.g. a captured
        graph's static inputs) the values are copied into its tensors, which are returned.
        Run it outside the graph, before each replay.
        """
        b = cache.batch_size
        rows, ones = torch.arange(b), torch.ones(b, dtype=torch.int64)
        cache._check_rows(rows, ones)                                # room under max_seq_len
        cache.allocate(rows, ones)
        positions = cache.seq_lens.clone()                           # (b,) before the step
        values = dict(slot_mapping=cache.slot_mapping(rows, positions),
                      positions=positions,
                      seq_lens_after=(positions + 1).to(torch.int32))
        cache.seq_lens += 1
        if out is None:
            return {k: v.to(cache.device) for k, v in values.items()}
        for k, v in values.items():
            out[k].copy_(v, non_blocking=True)
        return out

    def decode_step(self, x: torch.Tensor, cache: PagedLatentCache, *,
                    slot_mapping: torch.Tensor, positions: torch.Tensor,
                    seq_lens_after: torch.Tensor, num_kv_splits: int,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token for every row of `cache`, with no host sync: CUDA-graph capturable.

        Args:
            x: (b, 1, hidden) (or (b, hidden)), b = cache.batch_size, weights' dtype and device.
            slot_mapping: (b,) int64 on the device: where each row's token is written
                (-1 skips the write: a padding row).
            positions: (b,) int64 on the device: each token's position (its row's seq_len
                before the step); RoPE is computed from it on the device.
            seq_lens_after: (b,) int32 on the device: cached tokens a row after the write (the
                kernel attends over them; 0 = the row sits out, output zero before o_proj's bias).
            num_kv_splits: the decode kernel's split count, fixed (the choice from seq_lens
                would read them on the host).
            block_table: (b, max_blocks) int32 on the device; None = cache.block_table.

        Returns (b, 1, hidden) (or (b, hidden)), what the common call returns for a decode of
        every row. Nothing is checked or read on the host, and `cache.seq_lens`, the allocator and
        the block table are not touched: prepare the tensors with `decode_inputs` (which also
        allocates the pages and advances seq_lens) or an engine's own buffers. The write is the
        raw op `torch.ops.mla.concat_and_cache_mla` (no slot-range check); where the extension
        does not load (CPU without a compiler) the torch reference writes instead, which is not
        capturable on a GPU. The decode kernel (a CUDA stage 1 where one applies: the sm_80 one at <= 16 heads, the wgmma
        one beyond on an H100 / H200; else Triton)
        runs with `num_kv_splits` as given; on the CPU the Triton one runs in its interpreter (bf16 there takes the kernel's torch reference, as `forward`).
        """
        cfg, w = self.config, self.weights
        c = cfg.kv_lora_rank
        squeeze = x.dim() == 2
        x1 = (x if squeeze else x[:, 0])[None]                      # (1, b, hidden)
        cos, sin = rope_cos_sin(cfg, positions[None], x.dtype)      # (1, b, r/2)
        c_q = query_latent(w, x1)                                   # (1, b, q)
        q_nope = query_nope(w, c_q)[0]                              # (b, h, d)
        q_pe = query_rope(w, c_q, cos, sin)[0]                      # (b, h, r)
        kv_c_normed, k_pe = latent(w, x1, cos, sin)                 # (1, b, c), (1, b, r)
        kv_cache = cache.kv_cache
        if extension_available(kv_cache.device):
            torch.ops.mla.concat_and_cache_mla(kv_c_normed[0], k_pe[0], kv_cache,
                                               slot_mapping, "auto", None)
        else:
            concat_and_cache(kv_c_normed[0], k_pe[0], kv_cache, slot_mapping,
                             backend="reference")

        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w.W_UK)            # (b, h, c)
        q = torch.cat([q_lat, q_pe], dim=-1)                           # (b, h, c + r)
        kernel, extra = mla_decode, {}
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            kernel, extra = mla_decode_reference, {"compute_dtype": torch.float32}
        o_lat, _ = kernel(q, kv_cache, cache.block_table if block_table is None else block_table,
                          seq_lens_after, kv_lora_rank=c, softmax_scale=self.softmax_scale,
                          num_kv_splits=num_kv_splits, **extra)         # (b, h, c)
        o = torch.einsum("bhc,hvc->bhv", o_lat, w.W_UV)                # (b, h, v)
        y = self.output_projection(o[:, None])                         # (b, 1, hidden)
        return y[:, 0] if squeeze else y

    def _prefill(self, path: str, q_nope: torch.Tensor, q_pe: torch.Tensor,
                 cache: PagedLatentCache, rows: torch.Tensor, new_lens: torch.Tensor,
                 context_lens: torch.Tensor, starts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with several new tokens (already in the cache), batched with padding.

        q_nope (T, h, d), q_pe (T, h, r) of the whole call; rows, new_lens, context_lens,
        starts (m,). Returns the real tokens' indices into T (T_m,) and their o (T_m, h, v).
        """
        w, c = self.weights, self.config.kv_lora_rank
        device = q_nope.device
        s, t = int(new_lens.max()), int((context_lens + new_lens).max())
        j = torch.arange(s)
        real = j[None, :] < new_lens[:, None]                                 # (m, s)
        tok = torch.where(real, starts[:, None] + j, 0).to(device)            # (m, s)
        positions = (context_lens[:, None] + j).to(device)                    # (m, s)
        latent_rows = cache.gather_padded(rows, t)                            # (m, t, c + r)
        kv_c, k_pe = latent_rows[..., :c], latent_rows[..., c:]               # (m, t, c), (m, t, r)
        visible = causal_mask(positions, t)                                   # (m, s, t)
        if path == "up-project":
            o = attend_up_projected(w, q_nope[tok], q_pe[tok], kv_c, k_pe, visible,
                                    self.softmax_scale)                       # (m, s, h, v)
        else:
            q_lat = torch.einsum("bshd,hdc->bshc", q_nope[tok], w.W_UK)       # (m, s, h, c)
            o_lat = attend_absorbed(q_lat, q_pe[tok], kv_c, k_pe, visible, self.softmax_scale)
            o = torch.einsum("bshc,hvc->bshv", o_lat.to(q_nope.dtype), w.W_UV)
        real_d = real.to(device)
        return tok[real_d], o[real_d].to(q_nope.dtype)

    def extra_repr(self) -> str:
        return (f"tier={self.tier!r}, config={self.config.name!r}, block_size={self.block_size}, "
                f"num_blocks={self.num_blocks}, prefill={self.prefill!r}, "
                f"prefill_crossover={self.prefill_crossover}")
