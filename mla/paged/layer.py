"""Tier 3, paged: MLA over a paged latent cache, with the kernels of mla.kernels.

The math is the absorbed tier's (mla/absorbed.py) for decode rows and short rows, and the naive
tier's up-projected dataflow for long rows; what changes is where the latent lives and who
computes. One call, for the new tokens of b sequences packed into N rows:

    plan (host)   positions, slot mapping, seq_lens, block-table growth, query offsets: built on
                  the host from the lengths, moved to the device in one packed copy
                  (mla/paged/plan.py)
    x (N, hidden) -> q_nope (N, h, d), q_pe (N, h, r)             query_latent, joint_query
                                                                   (eqs. 37-40)
                  -> [kv_c_normed | k_pe] (N, c + r)               naive.latent (eqs. 41, 43)
    append        each row into its slot of the pages, in the        concat_and_cache
                  cache's layout (bf16 or fp8: kv_cache_dtype)
    decode rows (1 new token), MQA mode:
        q = [q_nope · W_UK | q_pe] (b, h, c + r)                   W_UK absorbed into the query
        o_lat (b, h, c) = mla_decode(q, pages)                     split-KV, MQA over the latent,
                                                                   value = first c dims
        o = o_lat · W_UV (b, h, v)                                 W_UV absorbed on the way out
    prefill / extend rows (> 1 new token): o (T_p, h, v) = attend_prefill(path, q, pages)
        "absorbed", MQA mode: as a decode row, with up to 8 new tokens a query
                  (b, s_q, h, c + r), causal among them; longer rows in pieces of 8
        "up-project", MHA mode (eqs. 42, 44-46): keys and values up-projected from the latent;
                  the new tokens over themselves, causal (mla_prefill, a group of heads at a
                  time), and over their cached
                  context a workspace of `workspace_tokens` tokens at a time, merged by
                  log-sum-exp (chunked_context_prefill)
    y = W_O o (N, hidden)                                          eq. (47), all-reduced under TP

No path stores a (query, key) score: a call's memory grows with its new tokens and the
workspace, never with new tokens x context. Every path reads the cache through its layout: an
fp8 cache's rows are dequantised as they are read (in the decode kernel's registers, into the
prefill's workspace), so the attention is that over the dequantised cache.
`attend_prefill_reference` is the same attention in plain torch, every score materialised: the
readable version the kernels are tested against.

The eager call (`forward`, `forward_ragged`) and the CUDA-graph step (`decode_step`) run the same
`_run`; they differ only in who builds the metadata: the host plan (`plan_call`), or the
caller's device buffers (`decode_step_plan`, filled by `decode_inputs`).

Why two modes: MQA mode scores a (query, key) pair over c + r and sums c values, MHA mode over
d + r and v: (c+r+c)/(d+r+v) = 3.4x fewer FLOPs a score up-projected (V3 sizes; mla/absorbed.py
has the derivation), paid for by up-projecting the context, 2·t·c·(d+v) a head once, shared by
the row's queries. So long rows are cheaper in MHA mode and short ones in MQA mode.
`prefill_path` chooses per row: with `prefill="auto"` (default) rows of fewer than
`prefill_crossover` new tokens attend absorbed, longer ones up-projected; "up-project" /
"absorbed" force one path.

Shapes: N real new tokens of the call, T rows of x (N and padding), T_p the new tokens of the
prefill rows on one path, s_q new tokens a query (mla/paged/plan.py has the plan's letters); the
rest as in mla/naive.py.

The tier is inference-only: its calls run without autograd (outputs never require grad), because
the kernels have no backward. The naive and absorbed tiers are differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..absorbed import attend_absorbed
from ..base import MLAAttention
from ..kernels import chunked_context_prefill, mla_decode
from ..kernels.chunked_context import DEFAULT_WORKSPACE_TOKENS
from ..kernels.sdpa import PREFILL_BACKENDS
from ..naive import attend_up_projected, causal_mask, latent, query_latent
from ..rope import apply_rope, rope_cos_sin
from ..weights import MLAWeights
from .cache import (VALUE_DTYPES, PagedLatentCache, as_int, as_int_tensor, check_kv_cache_dtype,
                    check_kv_scale, gather_pages, positive_int, write_slots)
from .plan import (PREFILL_PATHS, CallPlan, DecodeRows, PrefillRows, check_num_kv_splits,
                   decode_step_inputs, decode_step_plan, plan_call)

# The options of `PagedMLA(prefill=...)`: "auto" chooses each row's path by
# `prefill_crossover`, the two paths force one.
PREFILL_MODES = ("auto", *PREFILL_PATHS)

# Rows with at least this many new tokens attend in MHA mode (up-projected) under
# prefill="auto"; shorter ones in MQA mode (absorbed). The FLOP model
# (mla.memory.prefill_crossover) puts the break-even at 168 new tokens over 4096 cached ones
# (V3 sizes). Timed with the kernels both modes run on (benchmarks/lab/prefill_crossover.py,
# benchmarks/lab/results/nvidia-h100-80gb-hbm3-prefill-crossover.json: 4096 cached tokens, bf16,
# H100), MQA mode stays faster up to 512 new tokens for one sequence (MHA from 1024) and up to
# 128 for four (MHA from 256): both modes' times follow the call's new tokens in all, which a
# per-row threshold cannot see. 512 keeps a lone row of up to 511 tokens on the faster MQA
# mode and costs a batch of four 256-token rows little (derivation 7 has the figures).
PREFILL_CROSSOVER = 512


def joint_query(w: MLAWeights, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
    """Eqs. (38)-(40) as one product: q = [W^{UQ}; W^{QR}] c_Q, then RoPE on each head's last r
    dims in place. c_q (N, q), cos / sin (N, r/2) -> q (N, h, d + r) = [q_C | q_R].

    The naive tier's query_nope and query_rope compute the two parts apart; here they share one
    buffer, so q_nope and q_pe are views of it and MHA mode's SDPA path takes q without a copy.
    """
    q = torch.einsum("nq,hkq->nhk", c_q, w.W_Q)                                # (N, h, d + r)
    d = w.config.qk_nope_head_dim
    q[..., d:] = apply_rope(q[..., d:], cos[:, None], sin[:, None])            # (39) q_R
    return q


def decode_attention(q: torch.Tensor, cache: PagedLatentCache, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, softmax_scale: float,
                     num_kv_splits: int | None, max_seq_len: int | None) -> torch.Tensor:
    """mla_decode's out (b, h, c) over the cache's pages, in its layout. The block table comes
    from the cache's own allocator, so the kernel trusts its entries on a GPU (on the CPU it
    checks them anyway); `max_seq_len`, known on the host, lets it choose its split count
    without a sync."""
    out, _ = mla_decode(q, cache.kv_cache, block_table, seq_lens,
                        kv_lora_rank=cache.kv_lora_rank, softmax_scale=softmax_scale,
                        num_kv_splits=num_kv_splits, max_seq_len=max_seq_len,
                        check_block_table=False, kv_cache_dtype=cache.kv_cache_dtype,
                        kv_scale=cache.kernel_scale)
    return out


class PagedMLA(MLAAttention):
    """MLA over a paged latent cache: split-KV decode kernel, flash prefill in a fixed workspace.

    Inference only: every call runs under `torch.no_grad()` and its output never requires grad
    (the kernels have no backward); train with the naive or absorbed tier.

    Args:
        weights: the layer's MLAWeights (shared, not copied), in float32, float16 or bfloat16
            (the kernels' dtypes).
        block_size: tokens a cache page (n), any int >= 1; 64 by default (FlashMLA's page).
        num_blocks: pages in a cache from `new_cache`; None = batch_size · ceil(max_seq_len / n),
            room for every row at full length.
        prefill: how rows with more than one new token attend: "auto" (default: absorbed below
            `prefill_crossover` new tokens, up-projected from there on), "up-project" (MHA mode:
            keys and values up-projected from the latent, the naive dataflow, through the flash
            prefill kernels) or "absorbed" (MQA mode over the latent, the absorbed tier's
            dataflow, through the decode kernel in queries of up to 8 new tokens). The last two
            are `mla.absorbed.AbsorbedMLA`'s option values.
        prefill_crossover: the "auto" threshold in new tokens a row; None = PREFILL_CROSSOVER
            (this module's measured constant).
        workspace_tokens: the most cached tokens MHA mode up-projects at once, an int >= 1; it
            also bounds the new tokens' keys and values, up-projected `head_group` heads at a
            time (at most workspace_tokens x h token-heads);
            None = DEFAULT_WORKSPACE_TOKENS (16384). The workspace holds h·(d+v) values a token:
            16384 tokens are 1 GiB at DeepSeek-V3's 128 heads in bf16, 128 MiB at the 16 a GPU
            holds under tensor parallelism 8, the size of a 4k-token call's own activations,
            and each chunk is one kernel launch over 16k keys, long enough that the launches
            and merges cost little. vLLM sizes its workspace min(max(8 x max_model_len, 4 x
            max_num_seqs x block_size), 64k) tokens; a layer does not know the model length, so
            the default is fixed and the option lets a server size it.
        prefill_backend: what runs the up-projected new tokens' causal attention over themselves
            when no row of the call has cached context: "auto" (default: torch SDPA on a CUDA
            device when every such row has the same length and the call has more than
            `mla.kernels.sdpa.PREFILL_KERNEL_UP_TO` new tokens, else the Triton kernel; see
            `mla.kernels.sdpa.choose_prefill_backend`), "triton" (`mla_prefill`, the flash
            kernel) or "sdpa" (torch SDPA, cuDNN attention on a GPU, on keys the up-projection
            writes in its layout; ragged rows take one call a row, their offsets read on the
            host, one sync). A call in which any row has cached context runs on the Triton
            kernels, whose log-sum-exp the merge needs.
        kv_cache_dtype: the layout of caches from `new_cache` (`mla.kernels.fp8`): "auto" (the
            weights' dtype, c + r values a token), "fp8_e4m3" (alias "fp8": c + r bytes and one
            float32 scale for the cache) or "fp8_ds_mla" (FlashMLA's 656-byte token: the latent
            in e4m3 with a scale per 128 values, the rope part in bf16). A call reads any cache
            in the cache's own layout.
        kv_scale: "fp8_e4m3" only: the scale of new caches, a float or 1-element float32
            tensor, finite and at least 2^-126; None = each cache calibrates its own from its
            first write that holds a non-zero value (its largest finite |value| maps to 224,
            half of e4m3's range; one host read), then keeps it.
        num_kv_splits: passed to `mla.kernels.mla_decode`; None lets it choose from the batch,
            the longest row (known on the host, so no sync) and the SM count.
        shuffle: default seed of `new_cache`'s random page order (None: pages in order).
        process_group: tensor parallelism over heads (see `mla.base.MLAAttention`).

    The common call is every tier's: `y = attn(x, cache, lengths)`, x (b, s, hidden). Engines
    that batch many sequences without padding call `forward_ragged`; a serving loop that
    captures its decode step in a CUDA graph calls `decode_inputs` and `decode_step`.
    """

    tier = "paged"

    def __init__(self, weights: MLAWeights, *, block_size: int = 64, num_blocks: int | None = None,
                 prefill: str = "auto", prefill_crossover: int | None = None,
                 workspace_tokens: int | None = None, prefill_backend: str = "auto",
                 kv_cache_dtype: str = "auto", kv_scale: float | torch.Tensor | None = None,
                 num_kv_splits: int | None = None, shuffle: int | None = None,
                 process_group=None):
        super().__init__(weights, process_group=process_group)
        if weights.dtype not in VALUE_DTYPES:
            raise TypeError(
                f"the paged tier runs on float32, float16 or bfloat16 weights (its kernels' "
                f"dtypes), got weights of dtype {weights.dtype}; cast them (e.g. "
                f"weights.to(torch.float32)) or use the naive or absorbed tier")
        block_size = positive_int("block_size", block_size)
        if num_blocks is not None:
            num_blocks = positive_int("num_blocks", num_blocks)
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if prefill_crossover is None:
            prefill_crossover = PREFILL_CROSSOVER
        if (not isinstance(prefill_crossover, int) or isinstance(prefill_crossover, bool)
                or prefill_crossover < 1):
            raise ValueError(f"prefill_crossover must be an int >= 1 or None, got "
                             f"{prefill_crossover!r}")
        workspace_tokens = positive_int(
            "workspace_tokens",
            DEFAULT_WORKSPACE_TOKENS if workspace_tokens is None else workspace_tokens)
        if prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(f"prefill_backend must be one of {PREFILL_BACKENDS}, got "
                             f"{prefill_backend!r}")
        kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype, self.config.kv_lora_rank)
        kv_scale = check_kv_scale(kv_cache_dtype, kv_scale, weights.device, fn="PagedMLA")
        check_num_kv_splits(num_kv_splits, allow_none=True)
        if shuffle is not None:
            shuffle = as_int("shuffle", shuffle)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefill = prefill
        self.prefill_crossover = prefill_crossover
        self.workspace_tokens = workspace_tokens
        self.prefill_backend = prefill_backend
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scale = kv_scale
        self.num_kv_splits = num_kv_splits
        self.shuffle = shuffle

    # ---- the cache ----------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_seq_len: int, *, num_blocks: int | None = None,
                  shuffle: int | None = None) -> PagedLatentCache:
        """An empty paged cache for `batch_size` rows of up to `max_seq_len` tokens, in the
        layer's `kv_cache_dtype` (with its `kv_scale`).

        `num_blocks` and `shuffle` override the layer's options for this cache.
        """
        cfg = self.config
        return PagedLatentCache(
            batch_size, max_seq_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            block_size=self.block_size,
            num_blocks=self.num_blocks if num_blocks is None else num_blocks,
            dtype=self.weights.dtype, device=self.weights.device,
            kv_cache_dtype=self.kv_cache_dtype, kv_scale=self.kv_scale,
            shuffle=self.shuffle if shuffle is None else shuffle)

    # ---- the common call ------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor, cache: PagedLatentCache, lengths=None) -> torch.Tensor:
        """x (b, s, hidden), right-padded by `lengths` (b,) -> y (b, s, hidden); see mla.base.

        Row i's real tokens are rows i·s ... i·s + lengths[i] - 1 of x viewed as (b·s, hidden),
        a ragged batch with padding between the sequences.

        Host-device traffic on a GPU: the lengths and seq_lens live on the host, where the
        call's metadata (positions, slot mapping, seq_lens, block-table growth) is built; it
        moves to the device in one copy from pinned memory, without a sync; the prefill
        kernels take their longest lengths and the context chunks from the host plan, and so
        does mla_decode its longest seq_len. One call: 1 host-to-device copy, 0 device-to-host
        copies, 0 syncs. (Without the compiled extension, the torch write that replaces it reads
        the slot range: one sync.)
        """
        lengths = self.check_inputs(x, cache, lengths, cache_type=PagedLatentCache)
        b, s, hidden = x.shape
        kept = [i for i, n in enumerate(lengths.tolist()) if n]      # rows that take part
        if not kept:
            return x.new_zeros(b, s, hidden)
        seq_ids = torch.tensor(kept)
        new_lens = lengths if len(kept) == b else lengths[seq_ids]
        y = self._append_and_attend(x.reshape(b * s, hidden), cache, seq_ids, new_lens,
                                    starts=seq_ids * s)
        return y.view(b, s, hidden)

    # ---- the ragged entry for engines -----------------------------------------------------
    @torch.no_grad()
    def forward_ragged(self, x: torch.Tensor, cache: PagedLatentCache,
                       query_start_loc: torch.Tensor | Sequence[int],
                       seq_ids: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The new tokens of b sequences, flattened without padding: x (T, hidden) -> (T, hidden).

        Args:
            x: (T, hidden) in the weights' dtype and device. Sequence k's new tokens are rows
                query_start_loc[k] ... query_start_loc[k+1] - 1, in order; rows from
                query_start_loc[b] to T are padding (e.g. to a captured graph's size): they are
                written nowhere and their outputs are zeros.
            cache: this layer's PagedLatentCache.
            query_start_loc: (b + 1,) integers, 0 = query_start_loc[0] <= ... <=
                query_start_loc[b] <= T (read on the host). Sequence k has
                query_start_loc[k+1] - query_start_loc[k] new tokens: 1 is a decode, more is a
                prefill or an extend over its cached context, 0 sits out.
            seq_ids: (b,) distinct cache rows (integers) the sequences live in; None = rows
                0 .. b-1.

        Returns:
            (T, hidden): each token's attention output, causal over its sequence's cached
            tokens and its own earlier new tokens. The tokens are appended to the cache at
            positions seq_lens[seq_ids[k]] + j. Bad input raises before anything is written.
            Host-device traffic as `forward`.
        """
        self.check_x(x, ragged=True)
        self.check_cache(cache, None, cache_type=PagedLatentCache)
        T = x.shape[0]
        qsl = as_int_tensor("query_start_loc", query_start_loc)
        if qsl.numel() < 1:
            raise ValueError("query_start_loc must hold b + 1 >= 1 offsets, got none")
        new_lens = qsl.diff()
        if int(qsl[0]) != 0 or bool((new_lens < 0).any()) or int(qsl[-1]) > T:
            raise ValueError("query_start_loc must start at 0, never decrease and end at most at "
                             f"T={T}, got {qsl.tolist()}")
        b = new_lens.numel()
        if seq_ids is None:
            if b > cache.batch_size:
                raise ValueError(f"{b} sequences but the cache has {cache.batch_size} rows")
            seq_ids = torch.arange(b)
        seq_ids, new_lens = cache.check_rows(seq_ids, new_lens)    # rows, distinct, room
        keep = new_lens > 0                                          # sequences that take part
        if not bool(keep.any()):
            return x.new_zeros(T, self.config.hidden_size)
        return self._append_and_attend(x, cache, seq_ids[keep], new_lens[keep],
                                       starts=qsl[:-1][keep])

    # ---- the hook for choosing how a prefill row attends --------------------------------------
    def prefill_path(self, new_len: int, context_len: int) -> str:
        """How a row with `new_len` > 1 new tokens over `context_len` cached ones attends.

        "up-project" (MHA mode, the flash prefill kernels) or "absorbed" (MQA mode, the decode
        kernel, in queries of up to 8 new tokens). A forced `prefill` option wins; under
        "auto", rows of fewer than `prefill_crossover` new tokens attend absorbed (the per-score
        cost dominates and absorption skips the up-projection of the whole context), longer
        rows up-project (its cost is shared by the row's queries). `context_len` is not used:
        the FLOP model's crossover moves little with the context (97 tokens at 64, 168 at 4096,
        171 in the limit, V3 sizes). Rows of 9 or more tokens attending absorbed go through
        the decode kernel in pieces of 8, each piece reading the row's context again: at 16 or
        more heads a piece is compute-bound on an H200 (8·h query rows do 8·h·2·(c+r+c) =
        278k FLOPs a cached token of 1152 bytes at h = 16, V3 sizes, bf16: 242 FLOPs a byte,
        above the 690 TFLOP/s / 4.2 TB/s = 164 where the GPU turns compute-bound), so the
        re-reads hide behind the FLOPs; timed on the kernels, MQA mode stays ahead further than
        its FLOP count (~171 new tokens) says (`PREFILL_CROSSOVER`'s comment).
        Called for every such row before anything is written; another value raises then.
        """
        if self.prefill != "auto":
            return self.prefill
        return "absorbed" if new_len < self.prefill_crossover else "up-project"

    # ---- one eager call: plan on the host, run, advance seq_lens ----------------------------
    def _append_and_attend(self, x: torch.Tensor, cache: PagedLatentCache, seq_ids: torch.Tensor,
                           new_lens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """x (T, hidden); seq_ids, new_lens, starts (b,) CPU int64, checked, new_lens >= 1;
        sequence k's tokens are rows starts[k] ... starts[k] + new_lens[k] - 1 of x."""
        plan = self._plan(cache, seq_ids, new_lens, starts)
        y = self._run(x, cache, plan)
        cache.seq_lens.index_add_(0, seq_ids, new_lens)
        return y

    def _plan(self, cache: PagedLatentCache, seq_ids: torch.Tensor, new_lens: torch.Tensor,
              starts: torch.Tensor) -> CallPlan:
        """The call's plan, built on the host by `mla.paged.plan.plan_call` (which takes the
        pages, all-or-nothing), each row of several new tokens on the path `prefill_path`
        gives it."""
        return plan_call(cache, seq_ids, new_lens, starts, prefill_path=self.prefill_path,
                         num_kv_splits=self.num_kv_splits)

    # ---- the dataflow, shared by the eager call and the CUDA-graph step ---------------------
    def _run(self, x: torch.Tensor, cache: PagedLatentCache, plan: CallPlan) -> torch.Tensor:
        """x (T, hidden) -> y (T, hidden) for the N real tokens `plan` describes; zeros
        elsewhere. Reads nothing on the host (the decode kernel may, see DecodeRows)."""
        cfg, w = self.config, self.weights
        T, hidden = x.shape
        N = plan.positions.numel()

        # The query and the latent, eqs. (37)-(43), as one sequence of the N real tokens.
        x_real = x[:N] if plan.token_rows is None else x[plan.token_rows]
        x1 = x_real[None]                                          # (1, N, hidden)
        cos, sin = rope_cos_sin(cfg, plan.positions[None], x.dtype)  # (1, N, r/2)
        c_q = query_latent(w, x1)                                  # (37) (1, N, q)
        q = joint_query(w, c_q[0], cos[0], sin[0])                  # (38)-(40) (N, h, d + r)
        q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]  # views
        kv_c_normed, k_pe = latent(w, x1, cos, sin)                # (41), (43) (1, N, c), (1, N, r)

        # Append: each token's [kv_c | k_pe] row into its slot, in the cache's layout; the
        # attention below reads it back. An fp8_e4m3 cache without a scale takes it from the
        # first tokens it holds that are not all zero.
        if cache.needs_scale:
            cache.calibrate(kv_c_normed[0], k_pe[0])
        write_slots(kv_c_normed[0], k_pe[0], cache, plan.slot_mapping)

        # Decode rows, eqs. (42), (44)-(46) absorbed: MQA over the latent in the pages (the
        # split-KV kernel).
        dec = plan.decode
        if dec is not None and dec.tokens is None:                 # every token decodes
            o = self.attend_decode(q_nope, q_pe, cache, dec)                   # (N, h, v)
        elif dec is None and len(plan.prefill) == 1 and plan.prefill[0][1].every_token:
            o = None                                               # one prefill batch holds them all
        else:
            o = q_nope.new_zeros(N, cfg.num_heads, cfg.v_head_dim)            # (N, h, v)
            if dec is not None:
                o[dec.tokens] = self.attend_decode(q_nope[dec.tokens], q_pe[dec.tokens],
                                                   cache, dec)

        # Prefill rows, eqs. (42), (44)-(46) absorbed or up-projected: their packed new tokens
        # over their context, one batch a path.
        for path, rows in plan.prefill:
            if o is None:                                          # no gather, no scatter
                if cache.kv_cache_dtype == "auto":     # the cache holds these very values
                    rows.new_latent = kv_c_normed[0], k_pe[0]
                o = self.attend_prefill(path, q_nope, q_pe, cache, rows)      # (N, h, v)
            else:
                o[rows.tokens] = self.attend_prefill(path, q_nope[rows.tokens], q_pe[rows.tokens],
                                                     cache, rows)

        # Eq. (47), once for every token (one all-reduce under TP); padding rows stay zero.
        y = self.output_projection(o[None])[0]                     # (N, hidden)
        if plan.token_rows is None and N == T:
            return y
        out = y.new_zeros(T, hidden)
        if plan.token_rows is None:
            out[:N] = y
        else:
            out[plan.token_rows] = y
        return out

    def attend_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache,
                      rows: DecodeRows) -> torch.Tensor:
        """MQA mode: T new tokens, already in the pages, q_nope (T, h, d), q_pe (T, h, r) ->
        o (T, h, v). Absorbed attention over the latent by the split-KV kernel: one token a
        query (T = b), or `rows.s_q` a query, placed by `rows.query_slots`."""
        w = self.weights
        # Absorb W_UK into the query: q_lat,i = (W^{UK}_i)^T q_C,i; the kernel's query is
        # [q_lat | q_pe], scored against whole cache rows [kv_c | k_pe].
        q_lat = torch.einsum("Thd,hdc->Thc", q_nope, w.W_UK)                 # (T, h, c)
        q = torch.cat([q_lat, q_pe], dim=-1)                                # (T, h, c + r)
        if rows.query_slots is not None:        # b queries of s_q tokens, unused places zero
            b, (T, h, cr) = rows.block_table.shape[0], q.shape
            q = q.new_zeros(b * rows.s_q, h, cr).index_copy_(0, rows.query_slots, q)
            q = q.view(b, rows.s_q, h, cr)                                  # (b, s_q, h, c + r)
        o_lat = decode_attention(q, cache, rows.block_table, rows.seq_lens,
                                 softmax_scale=self.softmax_scale,
                                 num_kv_splits=rows.num_kv_splits,
                                 max_seq_len=rows.max_seq_len)  # (b, h, c) / (b, s_q, h, c)
        if rows.query_slots is not None:
            o_lat = o_lat.flatten(0, 1)[rows.query_slots]                   # (T, h, c)
        # Absorb W_UV on the way out: o_i = W^{UV}_i o_lat,i
        return torch.einsum("Thc,hvc->Thv", o_lat, w.W_UV)                  # (T, h, v)

    def attend_prefill(self, path: str, q_nope: torch.Tensor, q_pe: torch.Tensor,
                       cache: PagedLatentCache, rows: PrefillRows) -> torch.Tensor:
        """The new tokens of m rows, packed row after row, over their cached context and
        themselves (causal): q_nope (T_p, h, d), q_pe (T_p, h, r) -> o (T_p, h, v).

        `path` "absorbed" is MQA mode: `attend_decode` over the rows' pieces of up to 8 new
        tokens. "up-project" is MHA mode (eqs. 42, 44-46), by `chunked_context_prefill`:
            the new tokens over themselves, causal: keys and values up-projected from their
                latent rows (`rows.new_latent` where the layer set it, else read back from
                their slots and dequantised), a group of heads
                at a time (`head_group`: at most a workspace's worth), one mla_prefill a group
                (or, where no row has context, torch SDPA as `prefill_backend` chooses);
            the new tokens over their context, non-causal: the contexts gathered from their
                pages and up-projected `workspace_tokens` tokens at a time, one mla_prefill a
                chunk;
            the pieces merged by their log-sum-exps.
        No (query, key) score is stored. Reads nothing on the host: the longest lengths and
        the context chunks come from the host plan (except a forced "sdpa" on ragged rows,
        which reads their offsets). `attend_prefill_reference` computes the
        same with every score materialised.
        """
        if path == "absorbed":
            return self.attend_decode(q_nope, q_pe, cache, rows.pieces)
        w, c = self.weights, self.config.kv_lora_rank
        if rows.new_latent is not None:
            kv_c, k_pe = rows.new_latent                                    # (T_p, c), (T_p, r)
        else:   # as the cache holds them: an fp8 layout's rows dequantised
            latent_new = cache.dequantize(cache.kv_cache.flatten(0, 1)[rows.slots])
            kv_c, k_pe = latent_new[:, :c], latent_new[:, c:]              # (T_p, c), (T_p, r)
        o, _ = chunked_context_prefill(
            q_nope, q_pe, kv_c, k_pe, rows.query_start_loc, cache.kv_cache, rows.block_table,
            rows.context_lens, W_UK=w.W_UK, W_UV=w.W_UV,
            softmax_scale=self.softmax_scale, workspace_tokens=self.workspace_tokens,
            max_seqlen_q=rows.max_new_len, context_lens_host=rows.context_lens_host,
            backend=self.prefill_backend, kv_cache_dtype=cache.kv_cache_dtype,
            kv_scale=cache.kernel_scale)
        return o                                                            # (T_p, h, v)

    # ---- the CUDA-graph decode entry -----------------------------------------------------------
    def decode_inputs(self, cache: PagedLatentCache, out: dict | None = None
                      ) -> dict[str, torch.Tensor]:
        """Host side of one `decode_step` over every row of `cache`: one new token a row.

        Allocates the rows' room for the token (all-or-nothing, as `cache.allocate`), builds
        slot_mapping (b,) int64, positions (b,) int64 and seq_lens_after (b,) int32 on the cache's
        device (one host-to-device copy, the block table's growth included), and advances
        `cache.seq_lens` by one (the host's bookkeeping: the step that follows writes the token).
        With `out` (a dict from an earlier call, e.g. a captured graph's static inputs) the
        values are copied into its tensors, which are returned. Run it outside the graph, before
        each replay.
        """
        return decode_step_inputs(cache, out)

    @torch.no_grad()
    def decode_step(self, x: torch.Tensor, cache: PagedLatentCache, *,
                    slot_mapping: torch.Tensor, positions: torch.Tensor,
                    seq_lens_after: torch.Tensor, num_kv_splits: int,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token for every row of `cache`, with no host sync: CUDA-graph capturable.

        Args:
            x: (b, 1, hidden) (or (b, hidden)), b = cache.batch_size, weights' dtype and device.
            cache: this layer's PagedLatentCache; every one of its b rows decodes one token.
            slot_mapping: (b,) int64 on the device: where each row's token is written
                (-1 skips the write: a padding row).
            positions: (b,) int64 on the device: each token's position (its row's seq_len
                before the step); RoPE is computed from it on the device.
            seq_lens_after: (b,) int32 on the device: cached tokens a row after the write (the
                kernel attends over them; 0 = the row sits out, output zero before o_proj's bias).
            num_kv_splits: the decode kernel's split count, an int in [1, MAX_KV_SPLITS]
                (`mla.paged.plan`: CUDA's grid limit), fixed (the choice from seq_lens would
                read them on the host).
            block_table: (b, max_blocks) int32 on the device; None = cache.block_table.

        Returns (b, 1, hidden) (or (b, hidden)), what the common call returns for a decode of
        every row: the same `_run`, with the caller's tensors as its plan. The arguments'
        shapes, dtypes and devices are checked before the write (metadata only); their values
        are trusted, and `cache.seq_lens`, the allocator and the block table are not touched:
        prepare the tensors with `decode_inputs` (which also allocates the pages and advances
        seq_lens) or an engine's own buffers. The write is the compiled op where the extension
        serves the device (else the torch reference, which reads the slot range: not
        capturable on a GPU).
        """
        squeeze = isinstance(x, torch.Tensor) and x.dim() == 2
        if isinstance(x, torch.Tensor) and not squeeze and (x.dim() != 3 or x.shape[1] != 1):
            raise ValueError(f"x must have shape (batch, 1, hidden) or (batch, hidden), got "
                             f"{tuple(x.shape)}")
        x = x if squeeze or not isinstance(x, torch.Tensor) else x[:, 0]   # (b, hidden)
        self.check_x(x, ragged=True)
        self.check_cache(cache, x.shape[0], cache_type=PagedLatentCache)
        plan = decode_step_plan(cache, slot_mapping=slot_mapping, positions=positions,
                                seq_lens_after=seq_lens_after, num_kv_splits=num_kv_splits,
                                block_table=block_table)
        y = self._run(x, cache, plan)                                # (b, hidden)
        return y if squeeze else y[:, None]

    def extra_repr(self) -> str:
        return (f"tier={self.tier!r}, config={self.config.name!r}, block_size={self.block_size}, "
                f"num_blocks={self.num_blocks}, prefill={self.prefill!r}, "
                f"prefill_crossover={self.prefill_crossover}, "
                f"workspace_tokens={self.workspace_tokens}, "
                f"prefill_backend={self.prefill_backend!r}, "
                f"kv_cache_dtype={self.kv_cache_dtype!r}")


def attend_prefill_reference(layer: PagedMLA, path: str, q_nope: torch.Tensor,
                             q_pe: torch.Tensor, cache: PagedLatentCache,
                             rows: PrefillRows) -> torch.Tensor:
    """The new tokens of m rows, packed row after row, over their cached context and
    themselves (causal): q_nope (T_p, h, d), q_pe (T_p, h, r) -> o (T_p, h, v).

    `layer.attend_prefill`'s arguments and result, in plain torch: padded to (m, s_max),
    every (query, key) pair scored in float32, (m, s, h, t) floats, by the naive tier's
    `attend_up_projected` ("up-project", eqs. 42, 44-46) or the absorbed tier's
    `attend_absorbed` ("absorbed", MQA over the latent). The readable reference the
    kernels are tested against. Reads nothing on the host.
    """
    w, c = layer.weights, layer.config.kv_lora_rank
    device, T_p = q_nope.device, q_nope.shape[0]
    s, t = rows.max_new_len, rows.max_seq_len
    qsl = rows.query_start_loc
    new_lens = qsl[1:] - qsl[:-1]                                         # (m,)
    m = new_lens.numel()

    # Pad: token j of row k at (k, j); positions context_lens + j; keys: the row's pages.
    j = torch.arange(s, device=device)
    real = j[None, :] < new_lens[:, None]                                 # (m, s)
    tok = torch.where(real, qsl[:-1, None] + j, 0)                        # (m, s) into T_p
    positions = rows.context_lens[:, None] + j                            # (m, s)
    latent_rows = gather_pages(cache, rows.block_table,
                               rows.context_lens + new_lens, t)           # (m, t, c + r)
    kv_c, k_pe = latent_rows[..., :c], latent_rows[..., c:]               # (m, t, c), (m, t, r)
    visible = causal_mask(positions, t)                                   # (m, s, t)
    if path == "up-project":
        o = attend_up_projected(w, q_nope[tok], q_pe[tok], kv_c, k_pe, visible,
                                layer.softmax_scale)                       # (m, s, h, v)
    else:
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope[tok], w.W_UK)       # (m, s, h, c)
        o_lat = attend_absorbed(q_lat, q_pe[tok], kv_c, k_pe, visible, layer.softmax_scale)
        o = torch.einsum("bshc,hvc->bshv", o_lat.to(q_nope.dtype), w.W_UV)

    # Unpad: packed token p of row k sits at (k, p - query_start_loc[k]).
    row_of = torch.repeat_interleave(torch.arange(m, device=device), new_lens,
                                     output_size=T_p)                     # (T_p,)
    j_of = torch.arange(T_p, device=device) - qsl[row_of]                 # (T_p,)
    return o[row_of, j_of].to(q_nope.dtype)                               # (T_p, h, v)
