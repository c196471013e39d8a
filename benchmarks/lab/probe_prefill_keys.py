"""Lab probe: where a long prompt's attention spends the time that cuDNN's attention alone does not.

The paged layer's prompt attention (``layer_attention`` in ``bench_prefill.py``) is the new tokens'
up-projection, building SDPA's keys k = [k_nope | k_pe] (h, d + r) a token, and cuDNN's
attention; cuDNN alone on ready, contiguous inputs is the floor. For prompts of 8k and 16k tokens
(DeepSeek-V3 sizes, bf16, 128 heads, one row) it times, each with ``bench_us`` (L2 zeroed):

- ``cudnn_bhsd``: cuDNN on contiguous (1, h, s, ·) q, k, v (what ``bench_prefill``'s
  ``sdpa_cudnn`` times);
- ``cudnn_bshd_vview`` / ``cudnn_bshd_vcontig``: cuDNN on token-major (s, h, ·) q and k as the
  layer passes them, v a view of the up-projection's (s, h, d + v) output or contiguous;
- ``up_project_mm``: the up-projection alone, latent (s, c) @ kv_b_proj^T;
- ``k_cat``: k built by ``torch.cat`` of k_nope and k_pe broadcast to the heads;
- ``current_total``: up-projection, concatenation and cuDNN, the layer's steps before
  ``mla.kernels.sdpa._latent_keys_values``;
- ``padded_total``: one up-projection whose weight has r zero rows after each head's W_UK rows,
  the head's W_UV rows after them ([k_nope | 0 | v] a head), k_pe written into the zeros, cuDNN on
  the views (the interleaved form of what ``_latent_keys_values`` does; it puts every head's v after
  every head's k instead);
- ``sdpa_prefill``: ``mla.kernels.sdpa_prefill`` on ready k_nope, k_pe, v (concatenation included),

with a torch.profiler table of ``sdpa_prefill``'s kernels, and the bf16 matmul rate. Writes
probe-prefill-keys.json to --out.

    PYTHONPATH=. python3 benchmarks/lab/probe_prefill_keys.py --out /tmp/probe
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.timing import bench_us, matmul_TFLOPs  # noqa: E402
from mla.kernels.sdpa import sdpa_prefill  # noqa: E402

H, D, R, V, C = 128, 128, 64, 128, 512


def rnd(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def cudnn(q, k, v, scale):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def token_major(x):  # (s, h, ·) -> (1, h, s, ·), a view
    return x[None].transpose(1, 2)


def probe(s: int) -> dict:
    scale = (D + R) ** -0.5
    res = {}
    qb, kb, vb = rnd(1, H, s, D + R), rnd(1, H, s, D + R), rnd(1, H, s, V)
    res["cudnn_bhsd"] = bench_us(lambda: cudnn(qb, kb, vb, scale), l2="dirty")
    del qb, kb, vb
    qs, ks, kv = rnd(s, H, D + R), rnd(s, H, D + R), rnd(s, H, D + V)
    vs = kv[..., D:]
    vc = vs.contiguous()
    res["cudnn_bshd_vview"] = bench_us(lambda: cudnn(token_major(qs), token_major(ks), token_major(vs), scale), l2="dirty")
    res["cudnn_bshd_vcontig"] = bench_us(lambda: cudnn(token_major(qs), token_major(ks), token_major(vc), scale), l2="dirty")
    lat, W = rnd(s, C), rnd(H * (D + V), C)
    res["up_project_mm"] = bench_us(lambda: lat @ W.T, l2="dirty")
    k_nope, k_pe = kv[..., :D], rnd(s, R)
    res["k_cat"] = bench_us(lambda: torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1)], dim=-1), l2="dirty")
    Wp = torch.zeros(H, D + R + V, C, device="cuda", dtype=torch.bfloat16)
    Wp[:, :D], Wp[:, D + R:] = W.view(H, D + V, C)[:, :D], W.view(H, D + V, C)[:, D:]
    Wp = Wp.reshape(H * (D + R + V), C)

    def padded():
        out = (lat @ Wp.T).view(s, H, D + R + V)
        out[..., D:D + R] = k_pe[:, None]
        return cudnn(token_major(qs), token_major(out[..., :D + R]), token_major(out[..., D + R:]), scale)

    def current():
        out = (lat @ W.T).view(s, H, D + V)
        k = torch.cat([out[..., :D], k_pe[:, None].expand(-1, H, -1)], dim=-1)
        return cudnn(token_major(qs), token_major(k), token_major(out[..., D:]), scale)

    res["padded_total"] = bench_us(padded, l2="dirty")
    res["current_total"] = bench_us(current, l2="dirty")
    cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")

    def library():
        return sdpa_prefill(qs[..., :D], qs[..., D:], k_nope, k_pe, vs, cu, softmax_scale=scale, max_seqlen_q=s)

    res["sdpa_prefill"] = bench_us(library, l2="dirty")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            library()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=4, max_name_column_width=70))
    flops = s * (s + 1) // 2 * H * 2 * (D + R + V)
    res = {k: round(v, 1) for k, v in res.items()}
    res["tflops_cudnn_bhsd"] = round(flops / res["cudnn_bhsd"] / 1e6, 1)
    res["tflops_sdpa_prefill"] = round(flops / res["sdpa_prefill"] / 1e6, 1)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--lengths", default="8192,16384")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": {}}
    for s in (int(v) for v in args.lengths.split(",")):
        result["us"][s] = probe(s)
        print(s, result["us"][s], flush=True)
        torch.cuda.empty_cache()
    result["matmul_TFLOPs"] = matmul_TFLOPs()
    print(f"bf16 matmul {result['matmul_TFLOPs']:.0f} TFLOP/s")
    with open(os.path.join(args.out, "probe-prefill-keys.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
