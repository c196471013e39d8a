#!/usr/bin/env bash
# Everything the GPU machine runs, in parts, each time-boxed, logs and JSON under $OUT.
#   bash benchmarks/gpu_suite.sh tests concat-bench sanitize decode-bench decode-sq accuracy sweep layer prefill
#   bash benchmarks/gpu_suite.sh tp   (two GPUs: nvidia-h200-x2)
#   bash benchmarks/gpu_suite.sh variants fp8-variants compile concat-probe concat-slots concat-candidates cuda-probe split-probe cuda-timeline sm90-timeline sm90-probe ncu-decode prefill-crossover prefill-probe prefill-paired layer-host candidate-checks candidates   (the lab: benchmarks/lab/)
# Run from the repository root with PYTHONPATH=. (the device machine has no package registry);
# FlashMLA runs beside mla_decode in decode-bench when .peers/flash_mla is there (PYTHONPATH=.peers:.).
set -u
OUT=${OUT:-/tmp/mla-gpu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$([ -d .peers ] && echo .peers:.)} PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-.}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}
for part in "$@"; do
  case $part in
    info) run info 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"' ;;
    tests) run tests 560 bash benchmarks/gpu_tests.sh "$OUT" ;;
    tests-all) run tests-all 500 python3 -m pytest -q -p no:cacheprovider tests ;;
    concat-bench) run concat-bench 180 python3 -m mla bench concat --out "$OUT" ;;
    sanitize) run sanitize 400 bash -c 'compute-sanitizer --tool memcheck python3 benchmarks/lab/sanitize_concat.py && compute-sanitizer --tool memcheck python3 benchmarks/lab/sanitize_decode.py && compute-sanitizer --tool memcheck python3 benchmarks/lab/sanitize_prefill.py' ;;
    decode-bench) run decode-bench 560 python3 -m mla bench decode --kv-cache-dtype auto,fp8_e4m3,fp8_ds_mla --out "$OUT" ;;
    decode-sq) run decode-sq 560 python3 -m mla bench decode --s-q 2,4 --out "$OUT/s_q" ;;  # several query tokens, beside FlashMLA
    accuracy) run accuracy 240 python3 benchmarks/accuracy_fp8.py --device cuda --prompt 1024 --decode-steps 8 --out "$OUT" ;;
    variants) run variants 300 python3 benchmarks/lab/tune_decode.py --out "$OUT" --variants --budget-s 240 ;;
    fp8-variants) run fp8-variants 560 bash -c "python3 benchmarks/lab/tune_decode.py --out $OUT --variants --kv-cache-dtype fp8_ds_mla --budget-s 220 && python3 benchmarks/lab/tune_decode.py --out $OUT --variants --kv-cache-dtype fp8_e4m3 --budget-s 220" ;;  # the Triton fp8 tiles against their neighbours
    compile) run compile 300 python3 benchmarks/compile_triton.py --out "$OUT" ;;  # the GPU's own Triton and ptxas: registers and spills beside the times
    cuda-probe) run cuda-probe 300 python3 benchmarks/lab/probe_decode_cuda.py --out "$OUT" ;;
    sm90-probe) run sm90-probe 300 python3 benchmarks/lab/probe_decode_sm90.py --out "$OUT" ;;  # writes h200-decode-sm90-probe.json
    split-probe) run split-probe 300 python3 benchmarks/lab/probe_decode_splits.py --grid --kv-cache-dtype auto,fp8_ds_mla --out "$OUT/split-probe" ;;  # the 16-head split counts over the grid of lab/results/*-decode-splits-probe-grid.json
    cuda-timeline) run cuda-timeline 240 python3 benchmarks/lab/timeline_decode_cuda.py --out "$OUT" ;;
    sm90-timeline) run sm90-timeline 300 python3 benchmarks/lab/timeline_decode_sm90.py --kv-cache-dtype auto,fp8_e4m3,fp8_ds_mla --out "$OUT" ;;  # each warpgroup's cycles, fp8 caches' conversion included
    ncu-decode) run ncu-decode 500 bash benchmarks/lab/ncu_decode.sh "$OUT/ncu" 64x4096x128 ;;  # Nsight Compute's counts of one warm call, three layouts and FlashMLA
    concat-probe) run concat-probe 200 python3 benchmarks/lab/probe_concat.py --out "$OUT" ;;
    concat-slots) run concat-slots 200 python3 benchmarks/lab/probe_concat_slots.py --out "$OUT" ;;  # random, paged and sequential slots
    concat-candidates) run concat-candidates 400 env BENCH=concat bash benchmarks/lab/ab_candidates.sh "$OUT/concat-candidates" "" ${CONCAT_CANDIDATES:?name the concat candidate patches in CONCAT_CANDIDATES} ;;  # concat candidate patches beside main, two rounds
    sanitize-decode) run sanitize-decode 200 compute-sanitizer --tool memcheck python3 benchmarks/lab/sanitize_decode.py ;;
    sanitize-sync) run sanitize-sync 400 bash -c 'compute-sanitizer --tool synccheck --print-limit 20 python3 benchmarks/lab/sanitize_decode.py; echo "synccheck rc=$?"; for k in cuda-sm90 cuda-sm80; do compute-sanitizer --tool racecheck python3 benchmarks/lab/sanitize_decode.py --only $k; echo "racecheck $k rc=$?"; done' ;;  # barrier use of every decode launch, each tool on its own (a stopped synccheck does not skip racecheck); shared-memory races of both CUDA kernels' fp8 paths
    sweep) run sweep 330 python3 benchmarks/lab/tune_decode.py --out "$OUT" --sweep ;;
    layer) run layer 240 python3 -m mla bench layer --out "$OUT" ;;
    prefill) run prefill 540 python3 -m mla bench prefill --out "$OUT" ;;
    prefill-crossover) run prefill-crossover 240 python3 benchmarks/lab/prefill_crossover.py --out "$OUT" ;;  # writes h200-prefill-crossover.json
    prefill-paired) run prefill-paired 240 python3 benchmarks/lab/probe_prefill_paired.py --shapes 1x1024,1x2048,1x4096 --out "$OUT" ;;  # short prompts' layer timed in turn with the SDPA layer, on each path
    candidate-checks) run candidate-checks 560 env OUT="$OUT" bash -c 'for n in ${CANDIDATES:?name the candidate patches in CANDIDATES}; do bash benchmarks/lab/check_candidate.sh "$OUT/checks-$n" "$n" "${CHECK_TESTS:-tests/test_kernels_decode_fp8.py tests/test_paged_fp8.py -k \"sm90 or cuda or default\"}" "${CHECK_SANITIZER:-benchmarks/lab/sanitize_decode.py --only cuda-sm90}"; done' ;;  # each candidate's GPU tests, memcheck and racecheck in its copy
    candidates) run candidates 560 bash benchmarks/lab/ab_candidates.sh "$OUT/candidates" "${AB_ARGS:---shapes 64x4096x16,128x8192x16,4x131072x16,64x4096x128,128x8192x128,1x32768x128 --kv-cache-dtype auto,fp8_e4m3,fp8_ds_mla}" ${CANDIDATES:?name the candidate patches in CANDIDATES} ;;  # benchmarks/lab/candidates/*.patch beside main, two rounds
    layer-host) run layer-host 120 python3 benchmarks/lab/probe_layer_host.py --device cuda --out "$OUT/layer-host-probe.json" ;;  # the host's share of a paged prompt
    prefill-probe) run prefill-probe 540 bash -c 'python3 benchmarks/lab/probe_prefill_layer.py --flex-compile --shapes 1x1024,1x4096,4x2048 && TORCHINDUCTOR_COMPILE_THREADS=1 python3 benchmarks/lab/probe_prefill_layer.py --flex-compile --shapes 1x1024,1x4096,4x2048' ;;
    tp) run tp 400 python3 -m mla bench tp --out "$OUT" --tp 2 ;;  # 2 GPUs (nvidia-h200-x2)
    *) echo "unknown part $part" ;;
  esac
done
