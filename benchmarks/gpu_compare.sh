#!/usr/bin/env bash
# Before / after on one GPU machine, in one run: the same latency and working-set benchmarks on an older
# tree (BASE, e.g. `git archive <commit> | tar -x -C .gl/baseline`, carried) and on this one, one after the other
# (base first). BASE must be an absolute path.
# Latency: benchmarks/bench_gpu.py at the 8B shape without transformers (decode TPOT at batch 1 / 8 / 32, cold
# and prefix-hit TTFT). Working set: benchmarks/bench_working_set.py, the pressure workset, on_pressure, WS_N
# requests. Photos come from this tree's tests/media for both (PRISM_MEDIA_DIR). Results: $OUT/{gpu,ws}_{base,new}.json
# and compare.txt (each run's summary lines).
set -u
BASE=${BASE:?set BASE to the older tree}
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PRISM_MEDIA_DIR=$PWD/tests/media
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site:
fi
NEW=$PWD
run() {  # run SIDE DIR
  local side=$1 dir=$2
  (cd "$dir" && PYTHONPATH=$SITE$dir timeout ${GPU_TIMEOUT:-170} python3 benchmarks/bench_gpu.py --shapes 8b \
     --no-transformers --out "$OUT/gpu_$side.json" 2>&1 | grep -v Warning | tail -12 | sed "s/^/[gpu $side] /")
  (cd "$dir" && PYTHONPATH=$SITE$dir timeout ${WS_TIMEOUT:-120} python3 benchmarks/bench_working_set.py --shape 8b \
     --device cuda --worksets pressure --requests ${WS_N:-100} --time-budget-s 90 --variants on_pressure --no-plot \
     --out "$OUT/ws_$side.json" 2>&1 | grep -v Warning | tail -6 | sed "s/^/[ws $side] /")
}
{ run base "$BASE"; run new "$NEW"; } 2>&1 | tee "$OUT/compare.txt"
