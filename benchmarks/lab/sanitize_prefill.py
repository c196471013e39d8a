"""A few small launches of the prefill kernels, for `compute-sanitizer --tool memcheck`.

    PYTHONPATH=. compute-sanitizer --tool memcheck python3 benchmarks/lab/sanitize_prefill.py

`mla_prefill` on ragged packed rows (lengths 1, 63, 64, 65, 300; causal and not, keys longer than
queries), then `chunked_context_prefill` over a paged context in a workspace smaller than one
row's context, on a bf16, an fp8_e4m3 and an fp8_ds_mla cache. Pages no row owns are NaN (bytes
0xFF) and unused block-table entries are garbage, so a read outside a row's pages shows as NaN.
Each run is checked against its reference; exits non-zero on a mismatch.
"""

import sys

import torch

from benchmarks.lab.sanitize_decode import poisoned_cache
from mla.kernels import chunked_context_prefill, mla_prefill, mla_prefill_reference

H, D, R, V, C, PAGE = 16, 128, 64, 128, 512, 16
DT = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-9))


def packed(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def flash() -> int:
    failures = 0
    for q_lens, k_lens, causal in (([1, 63, 64, 65, 300], [1, 63, 64, 65, 300], True),
                                   ([5, 40], [70, 40], True), ([3, 17], [9, 200], False)):
        total_q, total_k = sum(q_lens), sum(k_lens)
        q_nope = torch.randn(total_q, H, D, device="cuda", dtype=DT)
        q_pe = torch.randn(total_q, H, R, device="cuda", dtype=DT)
        k_nope = torch.randn(total_k, H, D, device="cuda", dtype=DT)
        k_pe = torch.randn(total_k, R, device="cuda", dtype=DT)
        v = torch.randn(total_k, H, V, device="cuda", dtype=DT)
        args = (q_nope, q_pe, k_nope, k_pe, v, packed(q_lens), packed(k_lens))
        out, lse = mla_prefill(*args, softmax_scale=0.08, causal=causal)
        ref, ref_lse = mla_prefill_reference(*args, softmax_scale=0.08, causal=causal)
        torch.cuda.synchronize()
        err = rel(out, ref)
        ok = not out.isnan().any() and err < 2e-2
        failures += not ok
        print(f"mla_prefill q {q_lens} k {k_lens} causal {causal}: rel err {err:.2e} "
              f"{'ok' if ok else 'MISMATCH'}")
    return failures


def chunked(kind: str) -> int:
    contexts, news = [0, 37, 100], [5, 20, 1]
    cache, table, scale = poisoned_cache(kind, contexts, max(c + n for c, n in zip(contexts, news)), PAGE, C, R, DT)
    total = sum(news)
    q_nope = torch.randn(total, H, D, device="cuda", dtype=DT)
    q_pe = torch.randn(total, H, R, device="cuda", dtype=DT)
    kv_c = torch.randn(total, C, device="cuda", dtype=DT)
    k_pe = torch.randn(total, R, device="cuda", dtype=DT)
    W_UK = torch.randn(H, D, C, device="cuda", dtype=DT) * C**-0.5
    W_UV = torch.randn(H, V, C, device="cuda", dtype=DT) * C**-0.5
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    common = (q_nope, q_pe, kv_c, k_pe, packed(news), cache, table, lens)
    options = dict(W_UK=W_UK, W_UV=W_UV, softmax_scale=0.08, kv_cache_dtype=kind, kv_scale=scale)
    out, _ = chunked_context_prefill(*common, workspace_tokens=30, **options)
    whole, _ = chunked_context_prefill(*common, workspace_tokens=4096, **options)
    torch.cuda.synchronize()
    err = rel(out, whole)
    ok = not out.isnan().any() and err < 2e-2
    print(f"chunked_context_prefill {kind}: contexts {contexts} news {news}, workspace 30 vs "
          f"one chunk: rel err {err:.2e} {'ok' if ok else 'MISMATCH'}")
    return int(not ok)


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    failures = flash() + sum(chunked(kind) for kind in ("auto", "fp8_e4m3", "fp8_ds_mla"))
    print("FAILED" if failures else "all ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
