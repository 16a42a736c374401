#!/usr/bin/env bash
# Three probe-training variants at once on one GPU (issue 35), the best one's weights kept.
#
# The probe is tiny and its training launch-bound (~17 steps/s alone on an H200), so three
# processes share the GPU; each has 4 DataLoader workers (3 x (1 + 4) processes on 16 cores).
# Every variant trains for $MINUTES minutes, then answers $EVAL held-out samples with its
# bfloat16 weights. Nothing is downloaded: the skeleton (config + tokenizer files) is built on a
# machine with the tokenizer and carried along (a default-size one serves every variant: the
# trainer writes each run's own config.json).
#
#   python -m benchmarks.quality.checkpoint skeleton skel        # here, before; carry skel
#   MINUTES=7.5 bash benchmarks/quality/gpu_train_sweep.sh       # on the device, repo root as cwd
#
# Variants (VARIANTS="a b c" by default, any subset):
#   a  from scratch, --curriculum binding2, --aux-weight $AUX, the committed probe's size
#   b  as a with a wider vision tower: width 160 (5 heads of 32), MLP 640 (49.6 MiB folder;
#      width 192 would be 51.8 MiB, over the 50 MiB limit)
#   c  --init benchmarks/quality/probe (the committed weights), binding2, aux, lr 1e-3, warm-up 50
#
# What comes back under $OUT (8 files at most, none over 15 MiB):
#   sweep.json    {variant: metrics JSON of the run} plus "best" (by held-out "all" accuracy)
#   best/         the best run's transfer folder: weight shards in parts, index, config.json,
#                 sha256.json; here: python -m benchmarks.quality.checkpoint join best DIR
#                 (DIR holding a skeleton; config.json comes from the parts, so the size is right)
# Logs stay in $WORK/<variant>/log.txt; each run's last lines and a one-line summary are printed.
set -uo pipefail

MINUTES=${MINUTES:-7.5}
EVAL=${EVAL:-2000}
AUX=${AUX:-0.5}
WORKERS=${WORKERS:-4}
BATCH=${BATCH:-256}
SKEL=${SKEL:-skel}
VARIANTS=${VARIANTS:-"a b c"}
EXTRA=${EXTRA:-}  # options added to every run (a CPU dry run: EXTRA="--toy --device cpu --steps 2 --batch 4")
OUT=${OUT:?set OUT to the folder whose files come back}
WORK=${WORK:-/tmp/probe_sweep}
PY=${PYTHON:-python3}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

if [ ! -f "$SKEL/tokenizer.json" ] || [ ! -f "$SKEL/preprocessor_config.json" ]; then
    echo "building the skeleton in $SKEL (needs the cached tokenizer files; else build it before and carry it)"
    "$PY" -m benchmarks.quality.checkpoint skeleton "$SKEL" || { echo "no skeleton: stop"; exit 2; }
fi

variant_args() {
    case "$1" in
        a) echo "--curriculum binding2 --aux-weight $AUX" ;;
        b) echo "--curriculum binding2 --aux-weight $AUX --vision-width 160 --vision-mlp 640" ;;
        c) echo "--init benchmarks/quality/probe --curriculum binding2 --aux-weight $AUX --lr 1e-3 --warmup 50" ;;
        *) echo "unknown variant $1" >&2; return 1 ;;
    esac
}

# wall-clock guard per run: the budget plus start-up, evaluation and saving
LIMIT=$("$PY" -c "print(int(float('$MINUTES') * 60 + 150))")
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
declare -A PIDS
for v in $VARIANTS; do
    extra=$(variant_args "$v") || exit 2
    mkdir -p "$WORK/$v"
    # shellcheck disable=SC2086  # extra is a list of options
    timeout "$LIMIT" "$PY" -m benchmarks.quality.train --skeleton "$SKEL" --out "$WORK/$v/ckpt" \
        --transfer "$WORK/$v/transfer" --metrics "$WORK/$v/metrics.json" --minutes "$MINUTES" \
        --batch "$BATCH" --workers "$WORKERS" --eval "$EVAL" --log-every 200 --ckpt-minutes 0 \
        --seed 0 $extra $EXTRA >"$WORK/$v/log.txt" 2>&1 &
    PIDS[$v]=$!
    echo "started $v (pid ${PIDS[$v]}): $extra"
done
for v in $VARIANTS; do
    wait "${PIDS[$v]}"
    echo "variant $v exited with $?"
done
for v in $VARIANTS; do
    echo "--- $v: last lines of its log"
    tail -n 4 "$WORK/$v/log.txt"
done

"$PY" - "$WORK" "$OUT" $VARIANTS <<'EOF'
import json
import pathlib
import shutil
import sys

work, out, variants = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
sweep, best, best_acc = {}, None, -1.0
for v in variants:
    path = work / v / "metrics.json"
    if not path.exists():
        print(f"SUMMARY {v}: no metrics (failed or timed out; see {work / v / 'log.txt'})")
        continue
    m = json.loads(path.read_text())
    sweep[v] = m
    h = m["heldout"]
    acc = {k: h[k]["accuracy"] for k in ("colour", "which_image", "count", "word", "position", "all") if k in h}
    last = next((e for e in reversed(m["history"]) if "aux_kind_accuracy" in e), {})
    print(f"SUMMARY {v}: steps {m['steps']} ({m['steps_per_second']}/s), vision {m['vision_config']['hidden_size']}"
          f"x{m['vision_config']['depth']}, {m['projected_folder_bytes'] / 2**20:.2f} MiB, held-out n={h['n']} "
          + " ".join(f"{k} {a:.3f}" for k, a in acc.items())
          + (f" | aux kind {last['aux_kind_accuracy']} colour {last['aux_colour_accuracy']}" if last else "")
          + f" | train shape {m['history'][-1]['train_first_token_accuracy'].get('shape') if m['history'] else None}")
    if acc.get("all", -1) > best_acc:
        best, best_acc = v, acc["all"]
sweep["best"] = best
(out / "sweep.json").write_text(json.dumps(sweep, indent=1) + "\n")
if best is not None:
    shutil.copytree(work / best / "transfer", out / "best")
    print(f"BEST {best}: all {best_acc:.3f}; its weights in {out / 'best'} ({len(list((out / 'best').iterdir()))} files)")
else:
    print("BEST none: no variant finished")
EOF
