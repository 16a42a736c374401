#!/usr/bin/env bash
# The quality curves split over processes on one GPU (issue 35.4): one process answers compaction
# off, the blind control and the transfer split; one more per selector answers its keep ratios.
# Each writes $OUT/q_<name>.json; merge them with benchmarks/quality_report.py q_*.json.
#
#   SAMPLES=1250 SELECTORS="uniform staggered attention coverage random staggered+merge" \
#       bash benchmarks/quality/gpu_curves.sh          # on the device, repo root as cwd
#
# The probe is tiny and each configuration launch-bound, so the processes share the GPU well
# (4 GiB of KV each). At most 7 selectors: the device returns 8 files (the log is the 8th).
set -uo pipefail
OUT=${OUT:?set OUT}
SAMPLES=${SAMPLES:-1250}
TRANSFER=${TRANSFER:-250}
RATIOS=${RATIOS:-0.8,0.6,0.4,0.25}
MODEL=${MODEL:-benchmarks/quality/probe}
SELECTORS=${SELECTORS:-"uniform staggered attention coverage random staggered+merge"}
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-560}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$OUT"
common=(--model "$MODEL" --device cuda --samples "$SAMPLES" --kv-cache-gib 4)
timeout "$LIMIT" "$PY" benchmarks/bench_quality.py "${common[@]}" --selectors "" --blind --transfer "$TRANSFER" \
    --out "$OUT/q_dense.json" > "$OUT/log_dense.txt" 2>&1 &
for s in $SELECTORS; do
    name=${s//+/_}
    timeout "$LIMIT" "$PY" benchmarks/bench_quality.py "${common[@]}" --no-dense --selectors "$s" --ratios "$RATIOS" \
        --transfer "$TRANSFER" --out "$OUT/q_$name.json" > "$OUT/log_$name.txt" 2>&1 &
done
wait
cat "$OUT"/log_*.txt | grep -v Warning > "$OUT/curves_log.txt"
rm -f "$OUT"/log_*.txt
tail -n 40 "$OUT/curves_log.txt"
