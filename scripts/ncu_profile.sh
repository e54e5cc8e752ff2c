#!/usr/bin/env bash
# ncu on one sparse-MLA call shape (scripts/profile_one.py), for each named kernel_bench variant: the summary sections
# and, with NCU_SOURCE=1, the per-instruction stall samples (SASS source page as CSV, gzipped). Device use only.
#   bash scripts/ncu_profile.sh HEADS TOKENS VARIANT... ; files go to $OUT (or results/kernels/ncu)
# The clocks are left alone (--clock-control none: the device's METHOD.md); each variant runs under its own timeout.
set -u -o pipefail
if [ $# -lt 3 ]; then
  echo "usage: bash scripts/ncu_profile.sh HEADS TOKENS VARIANT... (kernel_bench.GLUON_VARIANTS names;" \
       "NCU_SOURCE=1 for the per-instruction stall samples, NCU_S=<seconds> a profile)" >&2
  exit 2
fi
heads=$1 tokens=$2; shift 2
out=${OUT:-results/kernels/ncu}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
 --section SchedulerStats --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy"
target="python3 scripts/profile_one.py --heads $heads --tokens $tokens --layout fp8_ds_mla --calls 2"
for v in "$@"; do
  tag="${v}_H${heads}_T${tokens}"
  t0=$(date +%s)
  timeout "${NCU_S:-90}" ncu --clock-control none $sections -k regex:sparse_mla_rows -c 1 $target --variant "$v" \
    > "$out/ncu_$tag.txt" 2>&1 || echo "ncu $tag: exit $?" >> "$out/ncu_$tag.txt"
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    rm -f "/tmp/src_$tag.ncu-rep"
    timeout "${NCU_S:-90}" ncu --clock-control none --section SourceCounters --section WarpStateStats \
      -k regex:sparse_mla_rows -c 1 -o "/tmp/src_$tag" $target --variant "$v" > "$out/ncu_src_log_$tag.txt" 2>&1 \
      && timeout "${NCU_S:-90}" ncu -i "/tmp/src_$tag.ncu-rep" --page source --print-source sass --csv \
         | gzip > "$out/ncu_source_$tag.csv.gz" || echo "ncu source page $tag: failed" >> "$out/ncu_src_log_$tag.txt"
  fi
  echo "$tag: $(( $(date +%s) - t0 )) s"
done
