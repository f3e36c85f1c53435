#!/usr/bin/env bash
# H200 script: Nsight Compute summaries of one launch per case, as text under $1.
#
#   bash tools/device_ncu.sh OUT_DIR LABEL KERNEL_REGEX -- python3 SCRIPT ARGS... [;; LABEL ...]
#
# For each case: speed of light (SM clock, throughputs), compute pipes, occupancy and warp
# state on one page (OUT_DIR/LABEL.txt), then the per-instruction stall summary of
# tools/ncu_stalls.py appended to it. The .ncu-rep files stay in /tmp.
set -euo pipefail
out=$1
shift
mkdir -p "$out"
while [ $# -gt 0 ]; do
    label=$1 regex=$2
    shift 2
    [ "$1" = "--" ] && shift
    cmd=()
    while [ $# -gt 0 ] && [ "$1" != ";;" ]; do cmd+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    rep=/tmp/ncu_$label
    ncu --clock-control none -k "regex:$regex" -c 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SourceCounters \
        --section MemoryWorkloadAnalysis -f -o "$rep" "${cmd[@]}" > "$out/$label.log" 2>&1 || true
    {
        ncu --import "$rep.ncu-rep" --page details 2>&1 || true
        ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>/dev/null || true
        python3 tools/ncu_stalls.py "$rep.csv" --top 30 2>&1 || true
    } > "$out/$label.txt"
    echo "$label: $(wc -l < "$out/$label.txt") lines"
done
