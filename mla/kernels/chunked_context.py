"""New tokens over a paged cached context in bounded memory, and the log-sum-exp merge.

``chunked_context_prefill``: the new tokens attend to themselves causally (one ``mla_prefill`` a
group of heads, ``head_group``; torch SDPA instead where no sequence has context and its
``backend`` says so, the keys up-projected in SDPA's layout), and to their context, gathered
from the paged latent cache and up-projected by W_UK and W_UV a chunk of at most
``workspace_tokens`` tokens at a time, non-causally (one ``mla_prefill`` a chunk); the pieces
are merged by ``merge_attention_states``. Peak memory grows with the new tokens and the
workspace, never with new tokens x context.

Shape letters: b sequences, h heads, g heads of a group, d nope dim, r rope dim, v value dim,
c latent dim, n tokens a page; ``total_q`` the packed rows of all sequences' new tokens.
"""

from __future__ import annotations

import numbers

import torch
import triton

from . import fp8
from .prefill import _check_prefill_inputs, _check_tensor, mla_prefill
from .sdpa import PREFILL_BACKENDS, _joined, _sdpa_prefill_latent, choose_prefill_backend

__all__ = ["chunked_context_prefill", "merge_attention_states", "head_group",
           "DEFAULT_WORKSPACE_TOKENS"]

# Tokens of context up-projected at once by chunked_context_prefill. The workspace holds
# h * (d + v) values a token: 16384 tokens at DeepSeek-V3's 128 heads in bf16 are 1 GiB (128 MiB
# at the 16 heads a GPU holds under tensor parallelism 8). vLLM sizes its workspace
# min(max(8 * max_model_len, 4 * max_num_seqs * page), 64k) tokens.
DEFAULT_WORKSPACE_TOKENS = 16384


# ---------------------------------------------------------------------------------------------
# Merging two attentions of the same queries by log-sum-exp
# ---------------------------------------------------------------------------------------------


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over keys A + B from the attentions over A and over B (disjoint sets).

    With ``out_X = sum_{j in X} exp(s_j - lse_X) v_j`` and ``lse_X = log sum_{j in X} exp(s_j)``:

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    computed against ``m = max(lse_a, lse_b)`` so nothing overflows. A side with lse -inf (no
    key) weighs 0; both -inf gives out 0 and lse -inf. The same merge, over many splits at once,
    is the split-KV decode's stage 2 (``mla.kernels.decode``).

    Args: out_a, out_b (..., v), any float dtype; lse_a, lse_b (...) the matching log-sum-exps.
    Returns: out (..., v) in float32 (or float64 when an input is), lse (...) in float32.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attention_states: out_a, out_b must be (..., v) and lse_a, lse_b (...) alike, got "
            f"{tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_b.shape)}"
        )
    f32 = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(f32), lse_b.to(f32)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both empty: weights exp(-inf) = 0
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # (...)
    total = w_a + w_b
    seen = total > 0
    total_safe = torch.where(seen, total, torch.ones_like(total))
    out = (out_a.to(f32) * (w_a / total_safe)[..., None]).add_(out_b.to(f32) * (w_b / total_safe)[..., None])
    lse = torch.where(seen, m + torch.log(total_safe), torch.full_like(m, float("-inf")))
    return out, lse.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# New tokens over a paged cached context, a workspace of context at a time
# ---------------------------------------------------------------------------------------------


def _check_context_inputs(fn, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, kv_cache, block_table, context_lens,
                          W_UK, W_UV, workspace_tokens, context_lens_host, check_values, kv_cache_dtype,
                          kv_scale):
    """The arguments chunked_context_prefill adds to mla_prefill's; returns the host context lengths
    and the fp8_e4m3 scale as the (1,) float32 tensor on q's device (None for the other layouts).

    ``check_values`` False (a GPU caller that gave the host lengths) trusts block_table's entries:
    checking them reads the device.
    """
    total_q, h, d = q_nope.shape
    _check_tensor(fn, "kv_c", kv_c, ("total_q", "c"), q_nope.dtype)
    c = kv_c.shape[1]
    _check_tensor(fn, "k_pe", k_pe, ("total_q", "r"), q_nope.dtype)
    r = q_pe.shape[-1]
    if kv_c.shape[0] != total_q or tuple(k_pe.shape) != (total_q, r):
        raise ValueError(
            f"{fn}: kv_c and k_pe must be (total_q={total_q}, c) and (total_q, r={r}), got {tuple(kv_c.shape)} "
            f"and {tuple(k_pe.shape)}"
        )
    _check_tensor(fn, "W_UK", W_UK, ("h", "d", "c"), q_nope.dtype)
    _check_tensor(fn, "W_UV", W_UV, ("h", "v", "c"), q_nope.dtype)
    if tuple(W_UK.shape) != (h, d, c):
        raise ValueError(f"{fn}: W_UK must be (h={h}, d={d}, c={c}), got {tuple(W_UK.shape)}")
    if W_UV.shape[0] != h or W_UV.shape[1] < 1 or W_UV.shape[2] != c:
        raise ValueError(f"{fn}: W_UV must be (h={h}, v >= 1, c={c}), got {tuple(W_UV.shape)}")
    _check_tensor(fn, "kv_cache", kv_cache, ("num_blocks", "n", "width"))
    kind = fp8.canonical_kv_cache_dtype(kv_cache_dtype)
    if kind != "auto":
        fp8.require_fp8(kv_cache_dtype)
    dtype, width = fp8.cache_row(kind, c, r, q_nope.dtype)
    if kv_cache.dtype != dtype:
        raise TypeError(f"{fn}: kv_cache must be {dtype} for kv_cache_dtype={kv_cache_dtype!r}, got {kv_cache.dtype}")
    if kv_cache.shape[2] != width:
        raise ValueError(
            f"{fn}: kv_cache's last dim must be {width} for kv_cache_dtype={kv_cache_dtype!r} (c = {c}, r = {r}), "
            f"got {kv_cache.shape[2]}"
        )
    if (kind == "fp8_e4m3") != (kv_scale is not None):
        raise ValueError(f"{fn}: kv_scale must be the cache's scale for kv_cache_dtype='fp8_e4m3' and None "
                         f"otherwise, got {kv_scale!r} for {kv_cache_dtype!r}")
    if kv_scale is not None:  # a GPU tensor's value is read only where the call reads the host anyway
        kv_scale = fp8.check_e4m3_scale(fn, "kv_scale", kv_scale, q_nope.device, read_value=check_values)
    if kv_cache.shape[1] < 1:
        raise ValueError(f"{fn}: kv_cache's page size (dim 1) must be >= 1")
    b = cu_seqlens_q.shape[0] - 1
    _check_tensor(fn, "block_table", block_table, ("b", "max_blocks"), torch.int32)
    if block_table.shape[0] != b:
        raise ValueError(f"{fn}: block_table must have b={b} rows (from cu_seqlens_q), got {block_table.shape[0]}")
    _check_tensor(fn, "context_lens", context_lens, ("b",), torch.int32)
    if context_lens.shape[0] != b:
        raise ValueError(f"{fn}: context_lens must be (b={b},), got {tuple(context_lens.shape)}")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("context_lens", context_lens), ("W_UK", W_UK), ("W_UV", W_UV)):
        if t.device != q_nope.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q_nope is on {q_nope.device}")
    if isinstance(workspace_tokens, bool) or not isinstance(workspace_tokens, numbers.Integral):
        raise TypeError(f"{fn}: workspace_tokens must be an int, got {type(workspace_tokens).__name__}")
    if workspace_tokens < 1:
        raise ValueError(f"{fn}: workspace_tokens must be >= 1, got {workspace_tokens}")

    lens = context_lens.tolist() if context_lens_host is None else [int(n) for n in context_lens_host]
    if len(lens) != b or (check_values and context_lens_host is not None and lens != context_lens.tolist()):
        raise ValueError(f"{fn}: context_lens_host must hold context_lens' {b} values, got {context_lens_host!r}")
    if any(n < 0 for n in lens):
        raise ValueError(f"{fn}: context_lens must be >= 0, got a min of {min(lens)}")
    page = kv_cache.shape[1]
    pages = [triton.cdiv(n, page) for n in lens]
    if max(pages, default=0) > block_table.shape[1]:
        i = max(range(b), key=lambda i: pages[i])
        raise ValueError(
            f"{fn}: block_table is too short: sequence {i}'s context of {lens[i]} tokens needs {pages[i]} pages "
            f"of {page}, but block_table has {block_table.shape[1]} columns"
        )
    if not check_values or not any(pages):      # no context: no entry of block_table is read
        return lens, kv_scale
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < torch.tensor(
        pages, device=block_table.device
    )[:, None]
    if used.any():
        lo, hi = (int(x) for x in torch.stack(torch.aminmax(block_table[used])).tolist())
        if lo < 0 or hi >= kv_cache.shape[0]:
            raise ValueError(
                f"{fn}: block_table's entries for the context must be pages of kv_cache, in [0, "
                f"{kv_cache.shape[0] - 1}], got values in [{lo}, {hi}]"
            )
    return lens, kv_scale


def head_group(total_q: int, h: int, workspace_tokens: int) -> int:
    """Heads whose new-token keys and values ``chunked_context_prefill`` up-projects at once:
    as many as keep total_q x g within workspace_tokens x h token-heads (a context chunk's
    size), at least one, at most h, and the groups as even as that allows (16385 tokens over
    128 heads with a 16384-token workspace: two groups of 64, not 127 and 1)."""
    most = max(1, min(h, workspace_tokens * h // max(total_q, 1)))
    groups = -(-h // most)
    return -(-h // groups) if groups else 1


def chunked_context_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    softmax_scale: float,
    workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    max_seqlen_q: int | None = None,
    context_lens_host: list[int] | None = None,
    kv_cache_dtype: str = "auto",
    kv_scale: float | torch.Tensor | None = None,
    backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New tokens attend causally to themselves and fully to their cached context, in bounded memory.

    Sequence i has s_i new tokens (rows ``cu_seqlens_q[i] ...`` of q_nope, q_pe, kv_c, k_pe) at
    positions ``context_lens[i] ... context_lens[i] + s_i - 1``, after ``context_lens[i]`` cached
    tokens whose latent rows ``[kv_c | k_pe]`` live in the paged cache. The result is that of
    causal attention over the whole sequence, computed as:

    1. the new tokens over themselves, causal: keys ``W_UK kv_c``, values ``W_UV kv_c``;
    2. the new tokens over the context, a chunk of at most ``workspace_tokens`` cached tokens at a
       time (the contexts of all sequences one after the other, cut into chunks): gather the
       chunk's latent rows from their pages (dequantised from an fp8 layout into q's dtype),
       up-project them into the workspace, attend
       non-causally (every context token lies before every new token);
    3. each piece's (out, lse) merged into the running one by ``merge_attention_states``.

    Step 1 runs on a group of heads at a time (``head_group``), so the new tokens' keys and
    values, like a context chunk, take at most ``max(workspace_tokens * h, total_q) * (d + v)``
    values (``(d + r + v)`` on SDPA, whose keys carry the rope part, beside the group's
    reordered up-projection weight). Memory beyond the inputs: O(total_q * h * v) for the output
    and the merge, and that workspace for keys and values; nothing of size new tokens x context.

    Args:
        q_nope: (total_q, h, d), q_pe: (total_q, h, r): the new tokens' queries, packed.
        kv_c: (total_q, c), k_pe: (total_q, r): the new tokens' latent and rotary key (normed
            and rotated, as they go into the cache).
        cu_seqlens_q: (b + 1,) int32 offsets of the new tokens.
        kv_cache: (num_blocks, n, width): the paged cache of ``[kv_c | k_pe]`` rows in the layout
            ``kv_cache_dtype`` names: c + r values of q's dtype (``"auto"``), c + r of
            float8_e4m3fn (``"fp8_e4m3"``, with ``kv_scale``) or FlashMLA's 656-byte uint8 token
            (``"fp8_ds_mla"``); ``mla.kernels.fp8`` has the layouts.
        block_table: (b, max_blocks) int32: page j of sequence i's context is
            ``block_table[i, j]``; entries past ``ceil(context_lens[i] / n)`` are never read.
        context_lens: (b,) int32: cached tokens before each sequence's new ones (0: none).
        W_UK: (h, d, c), W_UV: (h, v, c): kv_b_proj's per-head factors (``MLAWeights.W_UK``, ``.W_UV``).
        softmax_scale: multiplies q . k before the softmax.
        workspace_tokens: the most cached tokens up-projected at once (>= 1); step 1's head groups
            hold at most workspace_tokens x h token-heads (``head_group``).
        max_seqlen_q: the most new tokens of a sequence; None: read from cu_seqlens_q.
        context_lens_host: context_lens as host ints, where the caller holds them (a layer's host
            plan does); None: read from context_lens. Give it and max_seqlen_q to launch without
            a host sync on a GPU: cu_seqlens_q's values and block_table's entries are then trusted
            there (still checked on the CPU, where that costs nothing).
        kv_cache_dtype: the cache's layout, ``"auto"``, ``"fp8_e4m3"`` or ``"fp8_ds_mla"``.
        kv_scale: ``"fp8_e4m3"`` only: the cache's scale, a float or a 1-element float32 tensor on
            q's device or the CPU, finite and at least 2^-126 (``mla.kernels.fp8.check_e4m3_scale``;
            a GPU tensor's value is trusted where the host lengths are).
        backend: what runs step 1 when no sequence has context (``PREFILL_BACKENDS``): "triton"
            (``mla_prefill``, the default), "sdpa" (torch SDPA, as ``sdpa_prefill`` calls it) or
            "auto" (``choose_prefill_backend``). With context, step 1 always runs on ``mla_prefill``:
            the merge needs its log-sum-exp.

    Returns:
        out (total_q, h, v) in q's dtype, lse (total_q, h) float32 natural log; lse is None when
        step 1 ran on SDPA, which gives none.
    """
    fn = "chunked_context_prefill"
    # q_nope, q_pe, k_pe and the offsets as mla_prefill checks them (the new tokens are their own
    # keys; q_nope stands in for the keys and values, which are computed below), before any work
    check_values = max_seqlen_q is None or context_lens_host is None or q_nope.device.type == "cpu"
    max_seqlen_q, _ = _check_prefill_inputs(
        fn, q_nope, q_pe, q_nope, k_pe, q_nope, cu_seqlens_q, cu_seqlens_q, softmax_scale, True,
        max_seqlen_q, None, check_values,
    )
    lens, kv_scale = _check_context_inputs(
        fn, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, kv_cache, block_table, context_lens, W_UK, W_UV,
        workspace_tokens, context_lens_host, check_values, kv_cache_dtype, kv_scale,
    )
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    h, d = q_nope.shape[1:]
    c, r, dv = kv_c.shape[1], k_pe.shape[1], W_UV.shape[1]
    page = kv_cache.shape[1]
    device = q_nope.device
    # ---- 1. the new tokens over themselves, causal (bottom-right: s_i keys for s_i queries),
    # g heads at a time: their keys and values, up-projected, hold at most workspace_tokens x h
    # token-heads (a context chunk's worth; one head a group at the least), so a long prompt's
    # keys and values never exist for every head at once. Heads are independent: each group's
    # out and lse are those heads' columns of the whole.
    total_q = q_nope.shape[0]
    total_context = sum(lens)
    equal_rows = (cu_seqlens_q.shape[0] - 1) * max_seqlen_q == total_q
    on_sdpa = total_context == 0 and choose_prefill_backend(
        backend, device, equal_rows=equal_rows, new_tokens=total_q) == "sdpa"
    g = head_group(total_q, h, workspace_tokens)
    # kv_b_proj's two factors as one (h * (d + v), c) matrix (its weight itself, when W_UK and
    # W_UV are views of it): one matmul up-projects a latent row into every head's key and
    # value; k_nope and v are views into its output. The SDPA path up-projects in its own layout
    # (``_latent_keys_values``) and has no context: it needs none of this
    W_kv = None if on_sdpa else _joined(W_UK, W_UV, dim=1).reshape(h * (d + dv), c)  # (h·(d+v), c)

    def up_project(latent_c, h0=0, h1=h):                                      # (t, c)
        """Heads h0 .. h1 - 1's keys and values of the latent rows (one matmul)."""
        w = W_kv[h0 * (d + dv): h1 * (d + dv)]                                  # (g·(d+v), c)
        kv = (latent_c @ w.T).view(-1, h1 - h0, d + dv)                         # (t, g, d + v)
        return kv[..., :d], kv[..., d:]                                         # (t, g, d), (t, g, v)

    def attend_new(h0: int, h1: int):
        """Heads h0 .. h1 - 1 of the new tokens over themselves: out (total_q, g, v), lse or None."""
        q_n, q_r = q_nope[:, h0:h1], q_pe[:, h0:h1]
        if on_sdpa:   # keys [k_nope | k_pe] made in SDPA's layout by the up-projection itself
            return _sdpa_prefill_latent(q_n, q_r, kv_c, k_pe, W_UK[h0:h1], W_UV[h0:h1], cu_seqlens_q,
                                        softmax_scale=softmax_scale, max_seqlen_q=max_seqlen_q), None
        k_nope_new, v_new = up_project(kv_c, h0, h1)
        return mla_prefill(q_n, q_r, k_nope_new, k_pe, v_new, cu_seqlens_q, cu_seqlens_q,
                           softmax_scale=softmax_scale, causal=True, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_q)

    if g == h:
        out, lse = attend_new(0, h)
    else:
        out = q_nope.new_empty(total_q, h, dv)                                  # (total_q, h, v)
        lse = None if on_sdpa else torch.empty(total_q, h, dtype=torch.float32, device=device)
        for h0 in range(0, h, g):
            out_g, lse_g = attend_new(h0, min(h, h0 + g))
            out[:, h0:h0 + g] = out_g
            if lse is not None:
                lse[:, h0:h0 + g] = lse_g
            del out_g, lse_g
    if total_context == 0:
        return out, lse
    out = out.float()

    # --8<-- [start:context_chunks]
    # ---- 2. the contexts, one after the other, in chunks of at most workspace_tokens tokens
    cu_context = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
    cu_context[1:] = torch.cumsum(context_lens.to(torch.int64), 0)              # (b + 1,)
    for lo in range(0, total_context, workspace_tokens):
        hi = min(lo + workspace_tokens, total_context)
        # which sequence each token of the chunk belongs to, and its position in that context
        p = torch.arange(lo, hi, device=device)                                 # (t_chunk,)
        seq = torch.searchsorted(cu_context[1:], p, right=True)                 # (t_chunk,)
        pos = p - cu_context[seq]
        pages = block_table[seq, pos // page].long()
        latent = fp8.dequantize_rows(kv_cache[pages, pos % page], kv_cache_dtype, c, r, kv_scale,
                                     q_nope.dtype)                              # (t_chunk, c + r)
        k_nope, v = up_project(latent[:, :c])                                   # the workspace
        # this chunk's keys of sequence i: its context clipped to [lo, hi), re-based to 0
        cu_k = (cu_context.clamp(lo, hi) - lo).to(torch.int32)                  # (b + 1,)
        out_chunk, lse_chunk = mla_prefill(
            q_nope, q_pe, k_nope, latent[:, c:], v, cu_seqlens_q, cu_k, softmax_scale=softmax_scale,
            causal=False, max_seqlen_q=max_seqlen_q, max_seqlen_k=hi - lo,
        )
        del latent, k_nope, v
        # ---- 3. merge this chunk into the running result
        out, lse = merge_attention_states(out, lse, out_chunk, lse_chunk)
    # --8<-- [end:context_chunks]
    return out.to(q_nope.dtype), lse
