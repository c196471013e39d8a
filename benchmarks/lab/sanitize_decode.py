"""A few small launches of the decode kernels, for `compute-sanitizer --tool memcheck`: the Triton
stage 1, the CUDA ones (csrc/mla_decode_sm80.cu where it applies, <= 16 heads; csrc/mla_decode_sm90.cu
on compute capability 9.0), and the merge; then the Triton kernel on several query tokens a
sequence and on both fp8 layouts, and the CUDA ones on both fp8 layouts (one query token):
csrc/mla_decode_sm80.cu for <= 16 heads, in one wave and over one; csrc/mla_decode_sm90.cu on
compute capability 9.0 for any heads (a second head block, one split, many empty ones), and on
several query tokens a sequence on every layout (s_q x h rows in its 64-row tiles).

Pages the sequences don't own are NaN (bytes 0xFF in an fp8 cache) and unused block-table entries
are garbage, so a read outside a sequence's pages would also show as NaN in the output.
"""

import torch

from mla.kernels import concat_and_cache, fp8, mla_decode, mla_decode_reference


def main() -> None:
    torch.manual_seed(0)
    c, r, page = 512, 64, 64
    for heads, seq_lens, splits in (((16), [1, 0, 130, 64], None), ((128), [300, 7], 4),
                                    ((3), [65, 129, 1], 8), ((16), [33, 2000, 0], 40),
                                    ((100), [70, 1000], 3),  # sm90: a second head block of 36
                                    ((128), [300, 0, 70], 1), ((16), [130, 5, 0], 1),  # one split: out written by stage 1
                                    ((16), [300, 2000, 64], 50)):  # sm80: 150 CTAs, over one wave of 132 SMs
        b = len(seq_lens)
        max_blocks = max(1, -(-max(seq_lens) // page)) + 1
        num_blocks = b * max_blocks + 3
        cache = torch.full((num_blocks, page, c + r), float("nan"), device="cuda",
                           dtype=torch.bfloat16)
        table = torch.full((b, max_blocks), 10**6, dtype=torch.int32, device="cuda")
        perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
        used = 0
        for i, n in enumerate(seq_lens):
            nb = -(-n // page)
            table[i, :nb] = perm[used:used + nb]
            for j in range(nb):
                rows = min(page, n - j * page)
                cache[perm[used + j], :rows] = torch.randn(rows, c + r, device="cuda")
            used += nb
        q = torch.randn(b, heads, c + r, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        ref, ref_lse = mla_decode_reference(q, cache, table, lens, kv_lora_rank=c,
                                            softmax_scale=0.1)
        runs = {"triton": lambda: mla_decode(q, cache, table, lens, kv_lora_rank=c, softmax_scale=0.1,
                                             num_kv_splits=splits, _backend="triton")}
        if heads <= 16:
            runs["cuda-sm80"] = lambda: mla_decode(q, cache, table, lens, kv_lora_rank=c, softmax_scale=0.1,
                                              num_kv_splits=splits, _backend="cuda-sm80")
        if torch.cuda.get_device_capability() == (9, 0):  # the wgmma kernel, any heads
            runs["cuda-sm90"] = lambda: mla_decode(q, cache, table, lens, kv_lora_rank=c, softmax_scale=0.1,
                                              num_kv_splits=splits, _backend="cuda-sm90")
        for name, run in runs.items():
            out, lse = run()
            torch.cuda.synchronize()
            assert not out.isnan().any(), "NaN in output: a read outside the sequence's pages"
            err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-9))
            print(f"{name}: heads {heads} seq_lens {seq_lens} splits {splits}: rel err {err:.2e}")
            assert err < 2e-2
    fp8_and_query_tokens()


def poisoned_cache(kind, lengths, table_tokens, page, c, r, dtype, device="cuda"):
    """A paged cache in the layout ``kind`` whose every unwritten byte is 0xFF (NaN in bf16 and
    in e4m3), sequence i's first ``lengths[i]`` rows written by concat_and_cache from random
    latents on randomly ordered pages; a block table of room for ``table_tokens`` tokens a row,
    its unused entries garbage (10^6). Returns (cache, block_table, scale): the fp8_e4m3 scale,
    else None."""
    b = len(lengths)
    max_blocks = max(1, -(-table_tokens // page)) + 1
    num_blocks = b * max_blocks + 2
    cache_dtype, width = fp8.cache_row(kind, c, r, dtype)
    cache = torch.full((num_blocks, page, width * cache_dtype.itemsize), 0xFF, dtype=torch.uint8,
                       device=device).view(cache_dtype)
    table = torch.full((b, max_blocks), 10**6, dtype=torch.int32, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    slots, used = [], 0
    for i, n in enumerate(lengths):
        pages = -(-n // page)
        table[i, :pages] = perm[used:used + pages]
        slots += [int(table[i, t // page]) * page + t % page for t in range(n)]
        used += pages
    latents = torch.randn(len(slots), c + r, device=device, dtype=dtype)
    scale = torch.tensor([0.02], device=device) if kind == "fp8_e4m3" else None
    concat_and_cache(latents[:, :c], latents[:, c:], cache, torch.tensor(slots, dtype=torch.int64, device=device),
                     kv_cache_dtype=kind, scale=scale)
    return cache, table, scale


def fp8_and_query_tokens(only: str | None = None) -> None:
    """The Triton kernel on s_q = 1..8 query tokens and on fp8_e4m3 / fp8_ds_mla caches, and the
    CUDA stage-1 kernels on the fp8 caches they take (s_q = 1; sm_80 for <= 16 heads, sm_90 for
    any) and the sm_90 one on s_q > 1 on every layout, each against the reference on the same
    cache (which dequantises it first). ``only`` runs one backend on the fp8 cases of one query
    token alone (a racecheck run of the wgmma kernel's fp8 path)."""
    c, r, page = 512, 64, 64
    for heads, seq_lens, splits, s_q, kind in ((16, [1, 0, 130, 64], None, 4, "auto"),
                                              (128, [300, 7], 4, 2, "auto"),
                                              (3, [65, 129, 1], 8, 8, "auto"),
                                              (16, [33, 2000, 0], 40, 1, "fp8_e4m3"),
                                              (128, [300, 0, 70], 3, 1, "fp8_ds_mla"),
                                              (16, [130, 5, 0], 1, 3, "fp8_ds_mla"),
                                              (20, [64, 65], 2, 2, "fp8_e4m3"),
                                              (3, [65, 129, 1, 0], 1, 1, "fp8_e4m3"),  # sm80: one split
                                              (16, [130, 5, 0, 64], None, 1, "fp8_ds_mla"),
                                              (16, [300, 2000, 64], 50, 1, "fp8_ds_mla"),  # sm80: over one wave
                                              (100, [70, 1000, 0], 1, 1, "fp8_e4m3"),  # sm90: two head blocks
                                              (128, [129, 64, 1], 40, 1, "fp8_ds_mla"),  # sm90: empty splits
                                              # sm90, s_q > 1: rows shorter than s_q, causal limits
                                              # inside and on the edge of a tile, 160 rows in 3 tiles
                                              (128, [300, 7, 0, 3], 4, 4, "auto"),
                                              (20, [64, 65, 1, 129], 1, 8, "auto"),
                                              (64, [130, 2, 1000], 40, 2, "fp8_ds_mla"),
                                              (16, [129, 3, 0], 3, 4, "fp8_e4m3")):
        if only is not None and (kind == "auto" or s_q != 1):
            continue
        b = len(seq_lens)
        cache, table, scale = poisoned_cache(kind, seq_lens, max(seq_lens), page, c, r, torch.bfloat16)
        q = torch.randn(b, s_q, heads, c + r, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        layout = dict(kv_lora_rank=c, softmax_scale=0.1, kv_cache_dtype=kind, kv_scale=scale)
        ref, _ = mla_decode_reference(q, cache, table, lens, **layout)
        cuda = kind != "auto" and s_q == 1  # the sm_80 kernel: fp8 caches of one query token
        sm90 = (cuda or s_q > 1) and torch.cuda.get_device_capability() == (9, 0)  # and s_q > 1, any layout
        backends = ["triton"] + (["cuda-sm80"] if cuda and heads <= 16 else []) + (["cuda-sm90"] if sm90 else [])
        for backend in backends if only is None else [k for k in backends if k == only]:
            out, _ = mla_decode(q, cache, table, lens, num_kv_splits=splits, _backend=backend,
                                **layout)
            torch.cuda.synchronize()
            # a query that sees no row (seq_len < its place among the s_q) is 0, not NaN
            assert not out.isnan().any(), "NaN in output: a read outside the sequence's pages"
            err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-9))
            print(f"{backend} {kind}: heads {heads} s_q {s_q} seq_lens {seq_lens} splits {splits}: "
                  f"rel err {err:.2e}")
            assert err < 2e-2


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--only"]:   # e.g. --only cuda-sm90: that kernel's fp8 cases alone
        torch.manual_seed(0)
        fp8_and_query_tokens(only=sys.argv[2])
    else:
        main()
