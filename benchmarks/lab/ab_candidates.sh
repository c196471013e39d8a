#!/usr/bin/env bash
# Candidate patches (benchmarks/lab/candidates/NAME.patch) timed beside main in one GPU call.
# The tree is copied to .ab/NAME and patched there; main's extension and every candidate's are
# built in parallel, each in a cache of its own; then `python -m mla bench decode BENCH_ARGS
# --no-flashmla` (BENCH=concat: `bench concat BENCH_ARGS`) runs main, NAME..., main, NAME... for
# ROUNDS rounds (default 2), and
# ab_table.py prints one table (each candidate's median over main's). The JSON of every run and
# the table go under OUT_DIR (OUT_DIR/ab/VERSION-ROUND/, OUT_DIR/ab-table.json).
#   bash benchmarks/lab/ab_candidates.sh OUT_DIR "--shapes 64x4096x128 --kv-cache-dtype auto,fp8_ds_mla" NAME
#   BENCH=concat bash benchmarks/lab/ab_candidates.sh OUT_DIR "" NAME
# Run from the repository root with PYTHONPATH=. on the GPU machine (it needs no git history).
# Correctness is the GPU tests' and the sanitizers' job: run them in the candidate's copy, e.g.
#   (cd .ab/NAME && TORCH_EXTENSIONS_DIR=/tmp/ext-NAME PYTHONPATH=. python3 -m pytest -m gpu ...)
set -u
out=$(mkdir -p "$1" && cd "$1" && pwd) bench_args=$2; shift 2  # absolute: the benches run in other folders
names=("$@")
rounds=${ROUNDS:-2}
bench=${BENCH:-decode}
flashmla=; [ "$bench" = decode ] && flashmla=--no-flashmla  # decode alone runs FlashMLA beside it
mkdir -p "$out/ab" .ab
# shellcheck source=benchmarks/lab/candidate_copy.sh
. benchmarks/lab/candidate_copy.sh
for name in "${names[@]}"; do copy_candidate "$name" || exit 2; done
build() {  # folder, extension cache name
  (cd "$1" && TORCH_EXTENSIONS_DIR=/tmp/ext-$2 python3 -c \
    "from mla.kernels.extension import load_extension as load; state = load(); print('$2', state); assert state['loaded']")
}
build . main >"$out/build-main.log" 2>&1 &
for name in "${names[@]}"; do build ".ab/$name" "$name" >"$out/build-$name.log" 2>&1 & done
failed=0
for job in $(jobs -p); do wait "$job" || failed=1; done
[ "$failed" = 0 ] || { echo "a build failed:"; tail -n 3 "$out"/build-*.log; exit 1; }
for round in $(seq 1 "$rounds"); do
  for version in main "${names[@]}"; do
    dir=.; [ "$version" = main ] || dir=.ab/$version
    # shellcheck disable=SC2086  # the bench's arguments, split as written
    (cd "$dir" && TORCH_EXTENSIONS_DIR=/tmp/ext-$version python3 -m mla bench "$bench" $flashmla \
      --out "$out/ab/$version-$round" $bench_args) >"$out/bench-$version-$round.log" 2>&1 \
      || echo "bench $version round $round failed: $(tail -n 1 "$out/bench-$version-$round.log")"
  done
done
python3 benchmarks/lab/ab_table.py "$out/ab" --json "$out/ab-table.json"
