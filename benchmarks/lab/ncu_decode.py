"""One decode call per process, for Nsight Compute to count (``benchmarks/lab/ncu_decode.sh``).

    PYTHONPATH=. python3 benchmarks/lab/ncu_decode.py --who mla --kv-cache-dtype fp8_e4m3 --shape 64x4096x128
    PYTHONPATH=.peers:. python3 benchmarks/lab/ncu_decode.py --who flashmla --shape 64x4096x128 --s-q 2

Runs ``--calls`` calls (default 3) of ``mla_decode`` (its stage 1 and split count as the decode
benchmark plans them) or of FlashMLA's dense decode, on the decode benchmark's inputs with
``--s-q`` new tokens a sequence, and waits for them. The wrapper has ncu skip the first calls
and count the last one's stage-1 kernel, so
the counts come from a warm call whose build and metadata are done. Prints the kernel and split
count it ran. ``--summarize DIR --out FILE`` reads the wrapper's files in DIR (no GPU needed)
and writes them as one JSON file: each subject's metrics, by name, as numbers, and where the
SourceCounters pass ran (SUBJECT-source.csv), its page summed as ``source_counts`` says.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import pathlib
import re

SUBJECTS = ("mla-auto", "mla-fp8_e4m3", "mla-fp8_ds_mla", "flashmla-auto")


def summarize(folder: str) -> dict:
    """{subject: {metric: value}} from ncu's printed metric tables (SUBJECT-metrics.txt)."""
    row = re.compile(r"^\s+(\w+__[\w.]+)\s+(?:\S+\s+)?([\d.,]+)\s*$")
    out = {}
    for subject in SUBJECTS:
        path = pathlib.Path(folder) / f"{subject}-metrics.txt"
        if path.exists():
            found = (row.match(line) for line in path.read_text().splitlines())
            out[subject] = {m.group(1): float(m.group(2).replace(",", "")) for m in found if m}
    return out


def source_counts(path, top: int = 40, sites: int = 12) -> dict:
    """A SourceCounters CSV (the kernel's name, a header row, then one row a SASS instruction) to
    its executed warp instructions: the total, by opcode (HGMMA, FMUL) and by opcode with its
    modifiers (FSETP.GEU.AND), the `top` most executed, and of those the ones under a guard
    predicate (@P0, @!P2; executed whether or not the predicate holds) by opcode with modifiers;
    where the page has the warp-state sampling columns, the samples summed by stall reason and
    the `sites` instructions with the most samples (offset from the page's first instruction,
    SASS, executed count, samples by reason, and the last mbarrier or barrier instruction in the
    16 before it: what a wait loop's branch waits on)."""
    rows = list(csv.reader(pathlib.Path(path).read_text().splitlines()))
    header = next(r for r in rows if "Instructions Executed" in r)
    at, sass = header.index("Instructions Executed"), header.index("Source")
    reasons = [(i, h) for i, h in enumerate(header) if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    by_op, by_mnemonic, guarded, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    stalls, sampled, first, recent = collections.Counter(), [], None, collections.deque(maxlen=16)
    address = header.index("Address") if "Address" in header else None
    for row in rows[rows.index(header) + 1:]:
        if len(row) <= max(at, sass) or not row[at].replace(",", "").isdigit():
            continue
        n = int(row[at].replace(",", ""))
        guard = re.match(r"^@!?U?P[T\d]+\s+", row[sass].strip())
        mnemonic = row[sass].strip()[guard.end() if guard else 0:].split(" ")[0]
        by_op[mnemonic.split(".")[0]] += n
        by_mnemonic[mnemonic] += n
        guarded[mnemonic] += n if guard else 0
        total += n
        here = {reason.removeprefix("stall_"): int(row[i].replace(",", "") or 0) if i < len(row) else 0
                for i, reason in reasons}
        stalls.update(here)
        if address is not None and reasons:
            first = int(row[address], 16) if first is None else first
            waits_on = next((x for x in reversed(recent) if x.startswith(("SYNCS", "BAR"))), None)
            sampled.append(dict(offset=hex(int(row[address], 16) - first), sass=row[sass].strip(), executed=n,
                                samples=sum(here.values()), by_reason={k: v for k, v in here.items() if v},
                                after=waits_on))
        recent.append(mnemonic and row[sass].strip()[guard.end() if guard else 0:])
    return dict(total=total, by_opcode=dict(by_op.most_common()), by_mnemonic=dict(by_mnemonic.most_common(top)),
                guarded={m: n for m, n in guarded.most_common(top) if n}, stall_samples=dict(stalls.most_common()),
                top_sites=sorted(sampled, key=lambda site: -site["samples"])[:sites])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--who", choices=("mla", "flashmla"), default="mla")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3", "fp8_ds_mla"))
    parser.add_argument("--shape", default="64x4096x128", help="BxTxH")
    parser.add_argument("--s-q", dest="s_q", type=int, default=1, help="new tokens a sequence (default 1)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--summarize", metavar="DIR", help="write DIR's metric and source files as JSON (--out) and stop")
    parser.add_argument("--out", help="the JSON file --summarize writes")
    parser.add_argument("--device", default="", help="the GPU's name, for --summarize's JSON")
    args = parser.parse_args(argv)
    if args.summarize:
        sources = {p.name.removesuffix("-source.csv"): source_counts(p)
                   for p in sorted(pathlib.Path(args.summarize).glob("*-source.csv"))}
        found = dict(device=args.device, shape=args.shape, subjects=summarize(args.summarize), sources=sources)
        pathlib.Path(args.out).write_text(json.dumps(found, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    import torch

    from benchmarks.bench_decode import (C, decode_call, flashmla_fn, kernel_and_splits, make_inputs, parse_shapes,
                                         write_fp8_caches)

    (b, t, h), = parse_shapes(args.shape)
    q, caches, table, lens = make_inputs(b, t, h, s_q=args.s_q)
    cache, scale = caches[0], None
    if args.who == "flashmla":
        if args.kv_cache_dtype != "auto":
            raise SystemExit("--who flashmla: FlashMLA's dense decode reads bf16 caches only")
        fn = flashmla_fn(q, table, lens)
        what = "flashmla"
    else:
        if args.kv_cache_dtype != "auto":
            fp8_caches, scale = write_fp8_caches(args.kv_cache_dtype, caches, 1)
            cache = fp8_caches[0]
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        kernel, _, splits = kernel_and_splits(q, cache, table, lens, C, t, num_sms,
                                              kv_cache_dtype=args.kv_cache_dtype)
        fn = decode_call(q, table, lens, kernel, splits, kv_cache_dtype=args.kv_cache_dtype, kv_scale=scale)
        what = f"mla {kernel}, {splits} splits"
    for _ in range(args.calls):
        fn(cache)
    torch.cuda.synchronize()
    print(f"{args.shape} s_q {args.s_q} {args.kv_cache_dtype}: {what}, {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
