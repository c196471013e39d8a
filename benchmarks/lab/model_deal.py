"""A model of the wgmma stage 1's deal, fitted to a ragged-probe run: what a deal that weighs
each sequence's start would save on batches of differing lengths.

    PYTHONPATH=. python3 benchmarks/lab/model_deal.py [--run FILE] [--out DIR]   # CPU, seconds

The kernel deals a batch's tile pairs evenly over its pieces (``dealt_pieces``): a piece that
holds the ends of several sequences runs a segment for each, and each segment beyond the first
costs a prologue, a first S and an output (NOTES rows 109 and 115). FlashMLA's scheduler instead
counts each sequence as its blocks plus a fixed cost, so that a piece holding more sequences
gets fewer blocks. ``weighted_pieces`` is that rule in pairs: sequence i costs its pairs plus
``k``, the pieces split the total cost evenly, and a piece runs the pairs that fall in its share
(``k = 0`` is the kernel's deal). ``balanced_pieces`` is the contiguous split whose costliest
piece, by the fitted model, is least: what a schedule planned on the GPU before stage 1 could
reach.

A CTA's time is modelled as ``a + b * pairs + s * (segments - 1)``, the pieces' CTAs (two head
blocks each at 128 heads) run one an SM, in launch order on 132 SMs; ``a``, ``b`` and ``s`` are
fitted (a grid, least squares) to the stage-1 kernel times of a ragged-probe run with
``--kernels`` (by default ``lab/results/nvidia-h100-80gb-hbm3-decode-ragged-rows.json``). The
table gives each batch's measured time, the model's for the kernel's deal, the model's for a few
``k`` and for the balanced split; ``RUN-model-deal.json`` under DIR holds it with the fit.

The fit matches the deal's times but not what a change of split does: a deal weighted with
k = 3 where the even cut crowds starts into a piece (``candidates/dealweighted.patch``) takes a
third of the predicted stage-1 saving or less
(``lab/results/nvidia-h100-80gb-hbm3-decode-ragged-ab28.json``), so ``s`` is not a segment's own
time on its CTA.
"""

from __future__ import annotations

import argparse
import heapq
import json
import pathlib

import numpy as np

from benchmarks.lab.probe_decode_ragged import cases, deal_spans, tile_pairs

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "lab" / "results" / "nvidia-h100-80gb-hbm3-decode-ragged-rows.json"
SMS, HEAD_BLOCKS = 132, 2  # an H100; 128 heads in 64-row blocks
KS = (2, 4, 8)


def weighted_pieces(pairs: list[int], pieces: int, k: int = 0) -> list[tuple[int, int]]:
    """Each piece's (pairs, segments) when sequence i costs pairs[i] + k and the pieces split the
    total cost evenly (ceil), each running the pairs that fall in its share of the cost; k = 0 is
    the kernel's deal."""
    per, spans = deal_spans(pairs, pieces, k)
    out = [[0, 0] for _ in range(pieces)]
    for lo, hi in spans:
        for z in range(lo // per, (hi - 1) // per + 1):
            out[z][0] += min(hi, (z + 1) * per) - max(lo, z * per)
            out[z][1] += 1
    return [tuple(p) for p in out]


def dealt_pieces(pairs: list[int], pieces: int) -> list[tuple[int, int]]:
    """Each piece's (pairs, segments) under the kernel's deal: the pairs split evenly."""
    return weighted_pieces(pairs, pieces, 0)


def makespan(cta_us: list[float], sms: int = SMS) -> float:
    """The last CTA's end when the CTAs start in order, each on the first SM free."""
    free = [0.0] * min(sms, len(cta_us))
    heapq.heapify(free)
    end = 0.0
    for t in cta_us:
        start = heapq.heappop(free)
        end = max(end, start + t)
        heapq.heappush(free, start + t)
    return end


def predicted_us(pieces: list[tuple[int, int]], a: float, b: float, s: float) -> float:
    """The stage 1's time for pieces (pairs, segments): each piece's CTAs (a head block each,
    adjacent in launch order) at a + b * pairs + s * (segments - 1); an empty piece returns at once."""
    ctas = []
    for p, g in pieces:
        ctas += [a + b * p + s * (g - 1) if p else 0.0] * HEAD_BLOCKS
    return makespan(ctas)


def balanced_pieces(pairs: list[int], pieces: int, a: float, b: float, s: float) -> list[tuple[int, int]]:
    """The contiguous split of the batch's pairs over at most ``pieces`` pieces whose costliest
    piece, at a + b * pairs + s * (segments - 1), is least: a bisection on that bound, each bound
    tried by filling the pieces in turn as far as it allows. Empty pieces pad the list."""

    def fill(bound):
        out, p, g = [], 0, 0
        for n in pairs:
            left = n
            while left:
                room = int((bound - a - s * g) // b) - p  # pairs this piece can still take with one segment more
                if room <= 0:
                    if p == 0:
                        return None
                    out.append((p, g))
                    p, g = 0, 0
                    continue
                take = min(room, left)
                p, g, left = p + take, g + 1, left - take
        if p:
            out.append((p, g))
        return out

    lo, hi = a + b, a + b * sum(pairs) + s * len(pairs)
    for _ in range(60):
        mid = (lo + hi) / 2
        split = fill(mid)
        lo, hi = (lo, mid) if split is not None and len(split) <= pieces else (mid, hi)
    split = fill(hi)
    return split + [(0, 0)] * (pieces - len(split))


def stage1_us(row: dict) -> float:
    return sum(us for name, us in row["mla_kernels_us"].items() if "mla_decode_sm90_kernel" in name)


def fit(rows: list[dict], deals: dict[str, list[tuple[int, int]]]) -> tuple[float, float, float, float]:
    """(a, b, s, rms us): the grid point with the least squared error over the run's batches (a
    batch whose CTAs fit one wave at once, the max over its CTAs; else the launch order's
    makespan)."""
    measured = np.array([stage1_us(r) for r in rows])
    a_grid, b_grid, s_grid = np.arange(0.0, 20.01, 1.0), np.arange(3.0, 5.001, 0.02), np.arange(0.0, 30.01, 1.0)
    pred = np.empty((len(a_grid), len(b_grid), len(s_grid), len(rows)))
    for n, r in enumerate(rows):
        busy = [(p, g) for p, g in deals[r["case"]] if p]
        if HEAD_BLOCKS * len(deals[r["case"]]) <= SMS:
            p, g = (np.array(x, dtype=float) for x in zip(*busy))
            top = (b_grid[:, None, None] * p + s_grid[None, :, None] * (g - 1)).max(-1)  # (b, s)
            pred[:, :, :, n] = a_grid[:, None, None] + top[None]
        else:
            for i, a in enumerate(a_grid):
                for j, b in enumerate(b_grid):
                    for m, s in enumerate(s_grid):
                        pred[i, j, m, n] = predicted_us(deals[r["case"]], a, b, s)
    err = np.sqrt(((pred - measured) ** 2).mean(-1))
    i, j, m = np.unravel_index(err.argmin(), err.shape)
    return float(a_grid[i]), float(b_grid[j]), float(s_grid[m]), float(err[i, j, m])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(RUN), help="a ragged-probe JSON run with --kernels (128 heads)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "lab" / "results"))
    args = parser.parse_args()
    run = json.loads(pathlib.Path(args.run).read_text())
    lengths = cases()
    rows = [r for r in run["rows"] if r["h"] == 128 and r["case"] in lengths and r.get("mla_kernels_us")]
    pairs = {r["case"]: tile_pairs(lengths[r["case"]]) for r in rows}
    pieces = {r["case"]: len(lengths[r["case"]]) * r["num_kv_splits"] for r in rows}
    deals = {c: dealt_pieces(pairs[c], pieces[c]) for c in pairs}
    a, b, s, rms = fit(rows, deals)
    print(f"fit over {len(rows)} batches: a {a:.1f} us + b {b:.2f} us a pair + s {s:.1f} us a segment beyond the "
          f"first; rms {rms:.1f} us")
    out_rows = []
    head = f"{'batch':>32} {'pieces':>6} {'measured':>9} {'model':>7}" + "".join(f" {'k=' + str(k):>7}" for k in KS)
    print(head + f" {'balanced':>9}   (stage 1 us; k: each start weighed as k pairs; balanced: the least costliest piece)")
    for r in rows:
        c = r["case"]
        model = predicted_us(deals[c], a, b, s)
        by_k = {k: predicted_us(weighted_pieces(pairs[c], pieces[c], k), a, b, s) for k in KS}
        balanced = predicted_us(balanced_pieces(pairs[c], pieces[c], a, b, s), a, b, s)
        out_rows.append(dict(case=c, pieces=pieces[c], measured_us=stage1_us(r), model_us=model,
                             weighted_us={str(k): v for k, v in by_k.items()}, balanced_us=balanced))
        print(f"{c:>32} {pieces[c]:>6} {stage1_us(r):9.1f} {model:7.1f}" + "".join(f" {by_k[k]:7.1f}" for k in KS)
              + f" {balanced:9.1f}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = pathlib.Path(args.run).stem + "-model-deal.json"
    (out / name).write_text(json.dumps(dict(
        run=pathlib.Path(args.run).name, sms=SMS, head_blocks=HEAD_BLOCKS,
        fit=dict(a_us=a, b_us_per_pair=b, s_us_per_segment=s, rms_us=rms), rows=out_rows), indent=1) + "\n")
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
