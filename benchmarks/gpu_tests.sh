#!/usr/bin/env bash
# Every test marked `gpu`, in SHARDS (4) pytest processes at once: the Triton compiles that
# dominate the run are CPU-bound and the GPU machine has 16 cores. The compiled extension is
# built once first, so the shards do not wait on its lock. Logs go to OUT_DIR/gpu-tests-*.log.
#   bash benchmarks/gpu_tests.sh OUT_DIR [pytest selection, default tests]
set -u
out=${1:-/tmp/mla-gpu}; shift || true
mkdir -p "$out"
python3 -c "from mla.kernels.extension import load_extension; load_extension()" >"$out/gpu-tests-build.log" 2>&1 \
  || { echo "extension build failed"; tail -20 "$out/gpu-tests-build.log"; }
python3 -m pytest -q -p no:cacheprovider -m gpu --collect-only "${@:-tests}" 2>/dev/null | grep '::' >"$out/gpu-tests-ids.txt"
echo "$(wc -l <"$out/gpu-tests-ids.txt") gpu tests in ${SHARDS:-4} shards"
split -n "r/${SHARDS:-4}" -d "$out/gpu-tests-ids.txt" "$out/gpu-tests-shard-"
for shard in "$out"/gpu-tests-shard-*; do
  mapfile -t ids <"$shard"
  python3 -m pytest -v -p no:cacheprovider -m gpu "${ids[@]}" >"$shard.log" 2>&1 &  # a line a test: a log cut short still says what passed
done
wait
for log in "$out"/gpu-tests-shard-*.log; do
  grep -E "^(FAILED|ERROR)" "$log"
  tail -n 1 "$log"
done
rm -f "$out"/gpu-tests-shard-?? "$out/gpu-tests-ids.txt"
