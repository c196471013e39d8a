"""One table of `python -m mla bench decode` (or `bench concat`) runs side by side: each
subfolder of DIR holds one run's JSON (named VERSION-ROUND, e.g. main-1, fp8three-1, main-2,
...), and each row of the table is a (b, t, h, s_q, cache dtype) (concat: a (tokens, cache dtype))
with every run's time_us, each version's median over its rounds, each candidate's median over
main's, and the split counts the versions planned (decode).

    python3 benchmarks/lab/ab_table.py DIR [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics


DECODE_KEY = ("b", "t", "h", "s_q", "kv_cache_dtype")  # a run without s_q (older JSON) has 1
CONCAT_KEY = ("tokens", "kv_cache_dtype")


def load_runs(root: pathlib.Path) -> dict[str, dict]:
    """{run folder name: {key: row}} for every folder with a decode JSON (key: the values of
    DECODE_KEY) or a concat.json (CONCAT_KEY), in the order the runs were made (main-1, the
    candidates' round 1, main-2, ...)."""
    def in_turn(folder: pathlib.Path) -> tuple:
        version, rnd = version_of(folder.name), folder.name.rpartition("-")[2]
        return (int(rnd) if rnd.isdigit() else 0, version != "main", folder.name)

    runs = {}
    for folder in sorted((p for p in root.iterdir() if p.is_dir()), key=in_turn):
        files = sorted(folder.glob("*decode*.json")) or sorted(folder.glob("concat.json"))
        if files:
            data = json.loads(files[0].read_text())
            rows = data["rows"] + data.get("fp8_rows", [])
            fields = CONCAT_KEY if "tokens" in rows[0] else DECODE_KEY
            runs[folder.name] = {tuple(r.get(f, 1) if f == "s_q" else r[f] for f in fields): r for r in rows}
    return runs


def version_of(run: str) -> str:
    """'fp8three-2' -> 'fp8three'."""
    name, _, rnd = run.rpartition("-")
    return name if name and rnd.isdigit() else run


def summarise(runs: dict[str, dict]) -> list[dict]:
    """A dict a (b, t, h, s_q, dtype): every run's time, each version's median and splits, and each
    candidate's median over main's."""
    versions = sorted({version_of(r) for r in runs}, key=lambda v: (v != "main", v))
    table = []
    for key in sorted({k for rows in runs.values() for k in rows}):
        entry = dict(zip(DECODE_KEY if len(key) == len(DECODE_KEY) else CONCAT_KEY, key),
                     runs={}, median_us={}, splits={})
        for run, rows in runs.items():
            row = rows.get(key)
            if row is not None and row.get("time_us") is not None:
                entry["runs"][run] = row["time_us"]
                entry["splits"][version_of(run)] = (row.get("config") or {}).get("num_kv_splits")
        for v in versions:
            times = [t for run, t in entry["runs"].items() if version_of(run) == v]
            if times:
                entry["median_us"][v] = statistics.median(times)
        base = entry["median_us"].get("main")
        entry["over_main"] = {v: m / base for v, m in entry["median_us"].items() if v != "main" and base}
        table.append(entry)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path, help="write the table here as well")
    args = parser.parse_args()
    runs = load_runs(args.dir)
    if not runs:
        raise SystemExit(f"ab_table: no decode or concat JSON in the folders of {args.dir}")
    table = summarise(runs)
    names = list(runs)
    concat = "tokens" in table[0]
    head = f"{'tokens':>7}" if concat else f"{'b':>4} {'t':>7} {'h':>4} {'s_q':>3}"
    print(f"{head} {'dtype':>10} " + " ".join(f"{n:>12}" for n in names)
          + "   candidate / main (median)" + ("" if concat else "   splits"))
    for e in table:
        cells = " ".join(f"{e['runs'][n]:12.1f}" if n in e["runs"] else f"{'-':>12}" for n in names)
        ratios = ", ".join(f"{v} {r:.3f}" for v, r in e["over_main"].items())
        splits = "" if concat else "   " + "/".join(f"{v} {s}" for v, s in e["splits"].items())
        where = f"{e['tokens']:>7}" if concat else f"{e['b']:>4} {e['t']:>7} {e['h']:>4} {e['s_q']:>3}"
        print(f"{where} {e['kv_cache_dtype']:>10} {cells}   {ratios}{splits}")
    if args.json:
        args.json.write_text(json.dumps({"runs": names, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
