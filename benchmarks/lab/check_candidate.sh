#!/usr/bin/env bash
# A candidate patch's correctness checks on the GPU machine, in a patched copy of the tree: the
# GPU tests it names, then compute-sanitizer memcheck and racecheck of a lab sanitizer script.
# Each step is time-boxed; logs and a summary go under OUT_DIR.
#   bash benchmarks/lab/check_candidate.sh OUT_DIR NAME "PYTEST ARGS" "SANITIZER ARGS"
#   bash benchmarks/lab/check_candidate.sh $OUT/dsfp16 dsfp16 \
#     "tests/test_kernels_decode_fp8.py tests/test_paged_fp8.py -k 'sm90 or cuda or default'" \
#     "benchmarks/lab/sanitize_decode.py --only cuda-sm90"
# The copy is .ab/NAME (as ab_candidates.sh makes it) and its extension cache /tmp/ext-NAME, so
# a later ab_candidates.sh run of the same patch reuses the build. TESTS_S (default 400) bounds
# the tests, build included (60-90 s on a fresh machine); SANITIZE_S (default 120) each tool.
# Run from the repository root with PYTHONPATH=. on the GPU machine.
set -u
out=$(mkdir -p "$1" && cd "$1" && pwd) name=$2 tests=$3 sanitizer=${4:-}
# shellcheck source=benchmarks/lab/candidate_copy.sh
. benchmarks/lab/candidate_copy.sh
copy_candidate "$name" || exit 2
cd ".ab/$name" || exit 2
export TORCH_EXTENSIONS_DIR=/tmp/ext-$name PYTHONPATH=.
start=$SECONDS
# shellcheck disable=SC2086  # the tests' arguments, split as written (eval keeps their quotes)
eval timeout "${TESTS_S:-400}" python3 -m pytest -q -p no:cacheprovider -m gpu $tests >"$out/tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - start)) s: $(tail -n 1 "$out/tests.log")" | tee -a "$out/summary.txt"
if [ -n "$sanitizer" ]; then
  for tool in memcheck racecheck; do
    # shellcheck disable=SC2086
    timeout "${SANITIZE_S:-120}" compute-sanitizer --tool $tool python3 $sanitizer >"$out/$tool.log" 2>&1
    echo "$tool rc=$? at $((SECONDS - start)) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -n 1)" \
      | tee -a "$out/summary.txt"
  done
fi
