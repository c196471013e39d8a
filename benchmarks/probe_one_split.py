"""One split: stage 1 writing the answer itself against stage 1's fp32 partials and the merge (NOTES row 45).

    PYTHONPATH=. python3 benchmarks/probe_one_split.py --out benchmarks/results     # ~1 min

With ``num_kv_splits = 1`` the CUDA stage-1 kernels write ``out`` (q's dtype) and ``lse``
themselves; before, they wrote (b, h, 1, 512) fp32 partials and the Triton merge copied them
into ``out``. This times both, each replayed from a CUDA graph after L2 is cleared with a read
(``bench_decode.bench_us``), in one process, in turn three times, at the shapes where
``mla_decode`` picks one split (128 heads, b = 64 and 128) and at 16 heads forced to one split.
Writes ``h200-decode-one-split.json``; the committed one was timed with the first, copying
version of the clear (NOTES rows 44-45), the same for both columns.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import C, SCALE, bench_us, graphed, make_inputs, rotation_copies, write_json  # noqa: E402

SHAPES = [(64, 4096, 128), (128, 8192, 128), (64, 16384, 128), (64, 4096, 16), (128, 8192, 16)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    from mla.kernels.concat_cache import load_extension
    from mla.kernels.decode import _merge, mla_decode

    assert load_extension()["decode_sm90"], "needs the wgmma kernel built (an sm_90 GPU)"
    rows = []
    for b, t, h in SHAPES:
        q, caches, table, lens = make_inputs(b, t, h, copies=rotation_copies(b, t))
        backend = "cuda" if h <= 16 else "sm90"
        stage1 = torch.ops.mla.mla_decode_sm80 if backend == "cuda" else torch.ops.mla.mla_decode_sm90
        part_out = torch.empty((b, h, 1, C), dtype=torch.float32, device="cuda")
        part_lse = torch.empty((b, h, 1), dtype=torch.float32, device="cuda")
        out = torch.empty((b, h, C), dtype=q.dtype, device="cuda")
        lse = torch.empty((b, h), dtype=torch.float32, device="cuda")

        def direct(cache):
            return mla_decode(q, cache, table, lens, kv_lora_rank=C, softmax_scale=SCALE, num_kv_splits=1,
                              _backend=backend)

        def with_merge(cache):  # the v9 path
            stage1(q, cache, table, lens, part_out, part_lse, SCALE, 1)
            _merge(part_out, part_lse, out, lse)
            return out, lse

        got, got_lse = direct(caches[0])
        want, want_lse = with_merge(caches[0])
        row = dict(b=b, t=t, h=h, backend=backend,
                   same_out=bool(torch.equal(got, want)), same_lse=bool(torch.equal(got_lse, want_lse)),
                   direct_us=[], merge_us=[])
        for _ in range(3):  # in turn, three times: the spread between runs shows
            row["direct_us"].append(bench_us(graphed(direct, caches)))
            row["merge_us"].append(bench_us(graphed(with_merge, caches)))
        rows.append(row)
        print(row, flush=True)
        del q, caches
        torch.cuda.empty_cache()
    write_json(args.out, "h200-decode-one-split.json", dict(device=torch.cuda.get_device_name(0), rows=rows))


if __name__ == "__main__":
    main()
