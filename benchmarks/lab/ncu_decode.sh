#!/usr/bin/env bash
# Nsight Compute's counts of one warm decode call's stage-1 kernel, for each of: mla on the three
# cache layouts and FlashMLA's dense decode (bf16), at one shape. Two passes a subject: the
# SpeedOfLight, MemoryWorkloadAnalysis_Tables, ComputeWorkloadAnalysis and WarpStateStats
# sections, then the metrics of METRICS that this ncu knows (shared-memory banks and wavefronts,
# the tensor pipe, warp stalls). Text under OUT_DIR, one file a subject and pass, and the metrics
# as JSON (OUT_DIR/ncu-decode.json, ncu_decode.py --summarize). SOURCE=1 adds a third pass: the
# SourceCounters section saved as a report (SUBJECT-source.ncu-rep), then its source page printed
# from it: the SASS, each instruction with its executed counts, as CSV (SUBJECT-source.csv).
# SUBJECTS picks the subjects (default: all four, FlashMLA where it imports), PASSES the first
# two passes (default "sections metrics"; "" for the source pass alone), EXTRA_METRICS more
# metric names for the metrics pass (space-separated), S_Q the new tokens a sequence (default 1).
#   bash benchmarks/lab/ncu_decode.sh OUT_DIR [BxTxH]
#   SOURCE=1 PASSES= SUBJECTS="mla:auto flashmla:auto" bash benchmarks/lab/ncu_decode.sh OUT_DIR
# Run from the repository root on the GPU machine with PYTHONPATH=.peers:. (FlashMLA is skipped
# when it does not import). ncu runs with --clock-control none (the device README's advice), so
# its durations are at the clocks the GPU picks.
set -u
out=$(mkdir -p "$1" && cd "$1" && pwd) shape=${2:-64x4096x128}
METRICS="gpu__time_duration.sum sm__cycles_elapsed.avg smsp__inst_executed.sum
l1tex__data_bank_reads.sum l1tex__data_bank_writes.sum
l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
l1tex__throughput.avg.pct_of_peak_sustained_elapsed sm__throughput.avg.pct_of_peak_sustained_elapsed
dram__throughput.avg.pct_of_peak_sustained_elapsed sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
sm__inst_executed_pipe_tensor_op_gmma.sum
smsp__warp_issue_stalled_barrier_per_warp_active.pct smsp__warp_issue_stalled_membar_per_warp_active.pct
smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct
smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct smsp__warp_issue_stalled_wait_per_warp_active.pct
smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct smsp__warp_issue_stalled_sleeping_per_warp_active.pct
smsp__warp_issue_stalled_dispatch_stall_per_warp_active.pct smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct
smsp__warp_issue_stalled_selected_per_warp_active.pct smsp__warp_issue_stalled_not_selected_per_warp_active.pct
${EXTRA_METRICS:-}"
ncu --query-metrics > "$out/query-metrics.txt" 2>&1
known=$(for m in $METRICS; do grep -q "^${m%%.*} " "$out/query-metrics.txt" && echo -n "$m,"; done)
echo "metrics ncu knows: ${known%,}" > "$out/metrics-used.txt"
subjects="mla:auto mla:fp8_e4m3 mla:fp8_ds_mla"
python3 -c "import flash_mla" 2>/dev/null && subjects="$subjects flashmla:auto"
subjects=${SUBJECTS:-$subjects}
for s in $subjects; do
  who=${s%%:*} kind=${s##*:} name=${s/:/-}
  for pass in ${PASSES-sections metrics} $([ "${SOURCE:-0}" = 1 ] && echo source); do
    case $pass in
      sections) what="--section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section WarpStateStats" ;;
      metrics) what="--metrics ${known%,}" ;;
      source) what="--section SourceCounters --import-source no -f -o $out/$name-source" ;;
    esac
    # shellcheck disable=SC2086  # ncu's arguments, split as written
    ncu --clock-control none -k "regex:mla_decode_sm90_kernel|mla_decode_sm80|flash_fwd_splitkv_mla_kernel" \
      --launch-skip 2 --launch-count 1 $what \
      python3 benchmarks/lab/ncu_decode.py --who "$who" --kv-cache-dtype "$kind" --shape "$shape" --s-q "${S_Q:-1}" \
      > "$out/$name-$pass.txt" 2>&1
    echo "$name $pass rc=$?"
    if [ "$pass" = source ]; then
      ncu -i "$out/$name-source.ncu-rep" --page source --print-source sass --csv > "$out/$name-source.csv" 2>&1
      echo "$name source page rc=$? ($(wc -l < "$out/$name-source.csv") lines)"
    fi
  done
done
python3 benchmarks/lab/ncu_decode.py --summarize "$out" --shape "$shape" --out "$out/ncu-decode.json" \
  --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
