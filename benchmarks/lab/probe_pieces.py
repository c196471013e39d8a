"""The wgmma stage 1's dealt pieces at one split, counted so that its CTAs fill whole waves.

    PYTHONPATH=.peers:. python3 benchmarks/lab/probe_pieces.py --shapes 128x8192x128,64x4096x128 --s-q 1,2,4 --out DIR

At one split ``mla_decode`` deals b pieces, one sequence each, so b x head blocks CTAs of equal
length run 1.94, 3.88 or 7.76 waves as 2, 4 or 8 (128 sequences of 2, 4 or 8 head blocks on 132
SMs): the last wave leaves ~3% of the SMs' time idle. FlashMLA runs one persistent wave instead.
Dealt over P pieces with P x head blocks a multiple of the SM count, every wave is whole; a piece
then holds the ends of several sequences (one more segment, ~12 us by ``model_deal.py``) and
the sequences cut between two pieces are merged. This times the call (stage 1 and the dealt
merge, as ``mla_decode`` runs them) at those piece counts beside main's and FlashMLA's, each
as the decode benchmark times them (``bench_us``: a CUDA graph after a clean L2), checks each
output against main's, and writes ``DIR/pieces-probe.json``.
"""

from __future__ import annotations

import torch

from benchmarks.bench_decode import C, SCALE, cache_copies, decode_call, flashmla_fn, kernel_and_splits, make_inputs
from benchmarks.lab.probe_args import decode_probe_parser, flashmla_and_sms
from benchmarks.timing import bench_us, graphed, write_json


def whole_wave_pieces(batch: int, head_blocks: int, num_sms: int) -> list[int]:
    """Piece counts P whose P x head_blocks CTAs fill whole waves of num_sms, from one wave up to
    about b pieces (past b a piece holds less than a sequence)."""
    counts = [p for p in range(1, 2 * batch + 1) if p * head_blocks % num_sms == 0]
    return [p for p in counts if p <= batch * 1.1] or counts[:1]


def dealt_call(q, block_table, seq_lens, pieces: int):
    """fn(kv_cache) -> (out, lse): the wgmma stage 1 dealing the batch's pairs over ``pieces`` at
    one split, then the dealt merge, as ``mla_decode``'s cuda-sm90 path runs them."""
    from mla.kernels.decode import _merge_dealt

    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    b, s_q, h, d = q4.shape
    rows = s_q * h
    q_rows = q4.reshape(b, rows, d)

    def call(cache):
        out = torch.empty((b, rows, C), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, rows), dtype=torch.float32, device=q.device)
        part_out = torch.empty((b + pieces - 1, rows, C), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b + pieces - 1, rows), dtype=torch.float32, device=q.device)
        ranges = torch.empty((b, 2), dtype=torch.int32, device=q.device)
        torch.ops.mla.mla_decode_sm90(q_rows, cache, block_table, seq_lens, part_out, part_lse, SCALE, pieces,
                                      kv_cache_dtype="auto", kv_scale=None, q_tokens=s_q, out=out, lse=lse,
                                      ranges=ranges)
        _merge_dealt(part_out, part_lse, ranges, out, lse, 1)
        return out.view(b, s_q, h, C), lse.view(b, s_q, h)

    return call


def main(argv=None) -> None:
    args = decode_probe_parser(__doc__, [(128, 8192, 128), (64, 4096, 128)]).parse_args(argv)
    flashmla_ok, num_sms = flashmla_and_sms()
    rows = []
    print(f"{'b':>4} {'t':>6} {'h':>4} {'s_q':>3} {'pieces':>7} {'CTAs':>5} {'waves':>6} {'us':>8} {'/ main':>7} "
          f"{'FM / it':>8} {'max diff':>9}", flush=True)
    for b, t, h in args.shapes:
        for s_q in args.s_q:
            q, caches, table, lens = make_inputs(b, t, h, s_q=s_q, copies=cache_copies(b, t))
            kernel, _, splits = kernel_and_splits(q, caches[0], table, lens, C, t, num_sms)
            if kernel != "cuda-sm90" or splits != 1:
                print(f"{b}x{t}x{h} s_q {s_q}: {kernel} at {splits} splits, not the one-split deal: skipped")
                continue
            head_blocks = -(-s_q * h // 64)
            main_fn = decode_call(q, table, lens, kernel, splits)
            ref = main_fn(caches[0])[0].float().reshape(b, s_q, h, C)
            main_us = bench_us(graphed(main_fn, caches))
            fm_us = bench_us(graphed(flashmla_fn(q, table, lens), caches)) if flashmla_ok else None
            variants = [("main", b, main_us, 0.0)]
            for pieces in whole_wave_pieces(b, head_blocks, num_sms):
                fn = dealt_call(q, table, lens, pieces)
                diff = (fn(caches[0])[0].float() - ref).abs().max().item()
                variants.append((f"{pieces}", pieces, bench_us(graphed(fn, caches)), diff))
            for name, pieces, us, diff in variants:
                ctas = pieces * head_blocks
                row = dict(b=b, t=t, h=h, s_q=s_q, variant=name, pieces=pieces, ctas=ctas, waves=ctas / num_sms,
                           time_us=us, over_main=us / main_us, flashmla_us=fm_us,
                           flashmla_over=fm_us / us if fm_us else None, max_abs_diff_vs_main=diff)
                rows.append(row)
                fm = f"{row['flashmla_over']:8.3f}" if fm_us else f"{'-':>8}"
                print(f"{b:>4} {t:>6} {h:>4} {s_q:>3} {name:>7} {ctas:>5} {ctas / num_sms:6.2f} {us:8.1f} "
                      f"{us / main_us:7.3f} {fm} {diff:9.2e}", flush=True)
            del q, caches
    write_json(args.out, "pieces-probe.json", dict(device=torch.cuda.get_device_name(0), num_sms=num_sms, rows=rows))


if __name__ == "__main__":
    main()
