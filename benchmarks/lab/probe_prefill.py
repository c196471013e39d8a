"""Lab probe: the Triton prefill kernel's tiles against torch SDPA, DeepSeek-V3 head dims, bf16.

For each prompt length (one sequence, causal, empty context) it times `mla_prefill` with each
candidate tile (BLOCK_M, BLOCK_N, num_warps, num_stages), the default tile, and SDPA's cuDNN and
efficient backends on the same q, k, v (k_pe broadcast to the heads, as SDPA needs), and checks
the kernel's output against SDPA's. Prints a table and writes probe-prefill.json to --out.

    PYTHONPATH=. python3 benchmarks/lab/probe_prefill.py --out /tmp/probe
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.timing import bench_us, matmul_TFLOPs  # noqa: E402
from mla.kernels.prefill import mla_prefill  # noqa: E402

H, D, R, V = 128, 128, 64, 128


def inputs(s: int, h: int = H):
    gen = torch.Generator(device="cuda").manual_seed(s)
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    q_nope, q_pe = rnd(s, h, D), rnd(s, h, R)
    k_nope, k_pe, v = rnd(s, h, D), rnd(s, R), rnd(s, h, V)
    cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")
    return q_nope, q_pe, k_nope, k_pe, v, cu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--lens", default="1024,4096,8192,16384,32768")
    parser.add_argument("--heads", type=int, default=H)
    args = parser.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = (D + R) ** -0.5
    tiles = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
             for m, n, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
             if not (m == 128 and n == 128) and not (m == 64 and w == 8 and n == 32)]
    matmul = matmul_TFLOPs()
    rows = []
    for s in lens:
        q_nope, q_pe, k_nope, k_pe, v, cu = inputs(s, args.heads)
        flops = (s * (s + 1) // 2) * args.heads * 2 * (D + R + V)
        q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)[None]          # (1, h, s, d + r)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, args.heads, -1)], -1).transpose(0, 1)[None]
        vv = v.transpose(0, 1)[None]
        row = {"s": s, "h": args.heads, "flops": flops}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, vv, is_causal=True, scale=scale)
                ref = sdpa()
                row[f"{name}_us"] = bench_us(sdpa)
            except Exception as err:  # noqa: BLE001 - a backend that refuses these dims
                row[f"{name}_us"] = None
                row[f"{name}_error"] = str(err)[:200]
        kw = dict(softmax_scale=scale, causal=True, max_seqlen_q=s, max_seqlen_k=s)
        out, _ = mla_prefill(q_nope, q_pe, k_nope, k_pe, v, cu, cu, **kw)
        row["max_abs_diff_vs_sdpa"] = float((out.float() - ref[0].transpose(0, 1).float()).abs().max())
        row["default_us"] = bench_us(lambda: mla_prefill(q_nope, q_pe, k_nope, k_pe, v, cu, cu, **kw))
        row["tiles"] = []
        for tile in tiles:
            try:
                t_us = bench_us(lambda: mla_prefill(q_nope, q_pe, k_nope, k_pe, v, cu, cu, **kw,
                                                    _config=tile), rep_ms=50)
            except Exception as err:  # noqa: BLE001 - a tile that does not fit shared memory
                t_us = None
                tile = {**tile, "error": str(err)[:120]}
            row["tiles"].append({**tile, "us": t_us})
        best = min((t for t in row["tiles"] if t["us"]), key=lambda t: t["us"])
        row["best_tile"] = best
        for key in ("default", "cudnn", "efficient"):
            us = row.get(f"{key}_us")
            row[f"{key}_TFLOPs"] = None if not us else flops / us / 1e6
        row["best_TFLOPs"] = flops / best["us"] / 1e6
        rows.append(row)
        print(f"s={s:6d} default {row['default_us']:9.1f} us ({row['default_TFLOPs']:.0f} TF/s) "
              f"best {best['us']:9.1f} us {[best[k] for k in ('BLOCK_M', 'BLOCK_N', 'num_warps', 'num_stages')]} "
              f"cudnn {row.get('cudnn_us')} efficient {row.get('efficient_us')} "
              f"diff {row['max_abs_diff_vs_sdpa']:.3g}", flush=True)
    result = {"matmul_TFLOPs": matmul, "device": torch.cuda.get_device_name(), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe-prefill.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
