"""A few small launches of the decode kernels, for `compute-sanitizer --tool memcheck`: the Triton
stage 1, the CUDA ones (csrc/mla_decode_sm80.cu where it applies, <= 16 heads; csrc/mla_decode_sm90.cu
on compute capability 9.0), and the merge.

Pages the sequences don't own are NaN and unused block-table entries are garbage, so a read
outside a sequence's pages would also show as NaN in the output.
"""

import torch

from mla.kernels import mla_decode, mla_decode_reference


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


if __name__ == "__main__":
    main()
