#!/usr/bin/env bash
# One GPU session: kernel tests, correctness smoke, benchmarks. Run on the GPU machine from the repo root;
# results go to $OUT (or ./gpu-results). Carry .whl (dashscope, platformdirs wheels) along.
# Steps (STEPS="..."): tests (every engine test with its engines on CUDA but tests/test_pdl.py; the web app's
# tests need gradio & co. and are left out; skip counts and reasons go to tests_skips.txt and tests.txt), pdl
# (tests/test_pdl.py alone, after the parallel run: its producer kernels spin, bounded, while the next kernel
# runs, which other processes on the GPU only slow down; pdl.txt): the GPU suite is
# STEPS="tests pdl", hosttier (issue 33: the host tier's tests on CUDA and benchmarks/bench_host_copy.py), kernels,
# fused, smoke, sweep, sdpa, gemv, profile, bench, model, serving, workingset (benchmarks/bench_working_set.py
# at the 8B shape; WS_ARGS replaces its arguments but --out; default: the pressure workset, the four variants
# issue 19 compares (compact_fp8, on_pressure, on_pressure_steps, dense_fp8), 200 requests each, ~6-7 min, no
# variant started past 470 s), workingset_rest (the same for dense_bf16 and vision_only, ~3-4 min; ws_rest.json),
# workingset_host (issue 33, the host tier at pressure: on_pressure without it, host 1 x B and 4 x B, compact-first;
# ws_host.json), workingset_deep (knee's on_pressure, then the deep workset, >= 3 B: host 4 x B, no tier, dense with
# 4 x B, host 1 x B; ws_deep.json; the goal check needs both files' runs: working_set_report.py per file), tp
# (benchmarks/bench_tp.py: two GPUs), quality (benchmarks/bench_quality.py on the probe model, QUALITY_ARGS
# replaces its arguments but --out; default 2,500 held-out samples with the blind control and 500 of the transfer split, every selector x keep ratio), selectors
# (benchmarks/bench_selectors.py: each selector's miss / hit TTFT at the 8B shape beside uniform's), http (benchmarks/bench_http.py at the 8B shape, in_process and process),
# warm (benchmarks/bench_warm.py at the 8B shape through /v1; WARM_ARGS replaces its arguments but --out). fp8decode
# (benchmarks/bench_fp8_decode.py: every FP8 decode variant at five batch x context points; FP8_ARGS adds arguments), kamdebug
# (issue 36: benchmarks/debug_kam.py --sanitize, kam_p8's illegal address at 32x4k, one launch per process: p8 and its
# kam_p16 control, p8 under compute-sanitizer memcheck where the machine has one (else under TRITON_DEBUG=1), then the
# block_n 128 / 32, PV-on-mma.sync, CUDA-graph and no-PDL cases; under 2 minutes; KAM_ARGS adds arguments, e.g.
# --setting num_stages=1,waves=2; kam_debug.txt, and each case's TTGIR / PTX / SASS in kam_debug.tgz). HOST_COPY=0
# leaves bench_host_copy.py out of hosttier. Web steps (http, warm) need the web wheels (bench_http.py lists them; with
# fastapi >= 0.16x also opentelemetry-api, importlib-metadata, zipp), carried in .whl_web in calls of their own
# (benchmarks/gpu_wheels.sh builds .whl and .whl_web, and says how to fit .whl_web under the carry limit).
# STEPS=install installs the carried wheels only (with no STEPS the default kernels, smoke and bench run: minutes).
set -u
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# wheels carried in .whl (and, in a later call of the same machine, .whl_web: the carry limit is
# 64 MiB with the tree) go to /tmp/site, which lasts as long as the machine
for wheels in .whl .whl_web; do
  if ls $wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels/*.whl
  fi
done
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
for step in ${STEPS:-kernels smoke bench}; do
  case $step in
    install) ;;  # STEPS=install: only the carried wheels (.whl, .whl_web) into /tmp/site, nothing run
    fused) timeout 120 python3 -m pytest tests/test_triton_kernels.py -q -x -p no:cacheprovider -k "fused or store or move" 2>&1 | tail -5 | tee "$OUT/fused.txt" ;;
    profile) timeout 300 python3 benchmarks/profile_decode.py 2>&1 | grep -v Warning | tail -80 | tee "$OUT/profile.txt" ;;
    # tests_skips.txt (also appended to tests.txt): counts, every skip reason with its tests, tests run per
    # module, from the JUnit XML: the record that the GPU-only tests ran here, and why anything skipped
    tests) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PRISM_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-400} python3 -m pytest tests -q -p no:cacheprovider \
             -n ${TEST_WORKERS:-6} --dist load --ignore-glob='tests/test_app_*.py' --ignore-glob='tests/test_e2e_*.py' --ignore=tests/test_sessions.py --ignore=tests/test_video_app.py --ignore=tests/test_pdl.py \
             --junitxml="$OUT/tests_junit.xml" -o console_output_style=count 2>&1 | tee "$OUT/tests_full.txt" \
             | tail -40 | tee "$OUT/tests.txt"
           python3 benchmarks/junit_summary.py "$OUT/tests_junit.xml" > "$OUT/tests_skips.txt" 2>&1
           { echo "--- skips and tests run (benchmarks/junit_summary.py)"; cat "$OUT/tests_skips.txt"; } | tee -a "$OUT/tests.txt" \
             | head -60 ;;
    # the host tier's tests with their engines on CUDA (pinned chunks, the copy stream, staging) and its copy bench
    hosttier) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PRISM_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-300} python3 -m pytest \
             tests/test_host_tier.py tests/test_host_tier_data.py tests/test_prefix_cache.py tests/test_on_pressure.py \
             -q -p no:cacheprovider -n ${TEST_WORKERS:-4} --dist load -rs 2>&1 | tail -25 | tee "$OUT/hosttier_tests.txt"
           [ "${HOST_COPY:-1}" = 0 ] || timeout 120 python3 benchmarks/bench_host_copy.py --out "$OUT/host_copy.json" 2>&1 \
             | tail -30 | tee "$OUT/host_copy.txt" ;;
    pdl) timeout 300 python3 -m pytest tests/test_pdl.py -q -p no:cacheprovider -rs 2>&1 | tail -15 | tee "$OUT/pdl.txt" ;;
    gemv) timeout 400 python3 benchmarks/sweep_gemv.py 2>&1 | grep -v Warning | tee "$OUT/sweep_gemv.txt" | grep -v "^  " ;;
    sdpa) timeout 200 python3 benchmarks/sweep_sdpa.py 2>&1 | grep -v Warning | tail -30 | tee "$OUT/sweep_sdpa.txt" ;;
    sweep) timeout 300 python3 benchmarks/sweep_decode.py 8x16384 1x1700 2>&1 | grep -v Warning | tail -20 | tee "$OUT/sweep.txt" ;;
    model) timeout 300 python3 benchmarks/bench_model.py --shape 8b --device cuda --out "$OUT/bench_model.json" 2>&1 \
             | grep -v Warning | tail -30 | tee "$OUT/bench_model.txt" ;;
    serving) timeout 400 python3 benchmarks/bench_serving.py --shape 8b --device cuda --out "$OUT/bench_serving.json" \
             2>&1 | grep -v Warning | tail -30 | tee "$OUT/bench_serving.txt" ;;
    kernels) timeout 300 python3 -m pytest tests/test_triton_kernels.py -q -x -p no:cacheprovider -n ${TEST_WORKERS:-6} 2>&1 | tail -15 | tee "$OUT/kernels.txt" ;;
    # issue 36: the FP8 decode kernels' sweep (FP8_ARGS: e.g. --points 32x4k,8x16k); the workers' logs go back
    # as one archive (a call returns at most 8 files)
    fp8decode) timeout ${FP8_TIMEOUT:-450} python3 benchmarks/bench_fp8_decode.py "$OUT/fp8_decode.json" ${FP8_ARGS:-} 2>&1 \
             | grep -v Warning | tail -40 | tee "$OUT/fp8_decode.txt"
           [ -d "$OUT/fp8_decode.rows" ] && tar -czf "$OUT/fp8_decode_rows.tgz" -C "$OUT" fp8_decode.rows \
             && rm -rf "$OUT/fp8_decode.rows" ;;
    # issue 36: why kam_p8 faults (benchmarks/debug_kam.py: each case in a process of its own, < 2 minutes)
    kamdebug) timeout ${KAM_TIMEOUT:-115} python3 benchmarks/debug_kam.py --sanitize --dump "$OUT/kam_debug" ${KAM_ARGS:-} \
             > "$OUT/kam_debug.txt" 2>&1
           grep -v Warning "$OUT/kam_debug.txt" | tail -60
           [ -d "$OUT/kam_debug" ] && tar -czf "$OUT/kam_debug.tgz" -C "$OUT" kam_debug && rm -rf "$OUT/kam_debug" ;;
    smoke) timeout 300 python3 benchmarks/gpu_smoke.py 2>&1 | grep -v Warning | tail -30 | tee "$OUT/smoke.txt" ;;
    workingset) timeout 560 python3 benchmarks/bench_working_set.py --shape 8b --device cuda \
             ${WS_ARGS:---worksets pressure --requests 200 --time-budget-s 470 \
               --variants compact_fp8,on_pressure,on_pressure_steps,dense_fp8} --out "$OUT/ws.json" 2>&1 \
             | grep -v Warning | tail -40 | tee "$OUT/ws.txt" ;;
    workingset_rest) timeout 400 python3 benchmarks/bench_working_set.py --shape 8b --device cuda \
             --worksets pressure --requests 200 --time-budget-s 330 --variants dense_bf16,vision_only \
             --out "$OUT/ws_rest.json" 2>&1 | grep -v Warning | tail -40 | tee "$OUT/ws_rest.txt" ;;
    workingset_host) timeout 560 python3 benchmarks/bench_working_set.py --shape 8b --device cuda \
             ${WS_HOST_ARGS:---worksets pressure --requests 200 --time-budget-s 470 \
               --variants on_pressure,on_pressure_host1x,on_pressure_host4x,compact_first_host1x} \
             --out "$OUT/ws_host.json" 2>&1 | grep -v Warning | tail -40 | tee "$OUT/ws_host.txt" ;;
    workingset_deep) timeout 560 python3 benchmarks/bench_working_set.py --shape 8b --device cuda \
             ${WS_DEEP_ARGS:---worksets knee,deep --only knee=on_pressure --requests 200 --time-budget-s 470 \
               --variants on_pressure_host4x,on_pressure,dense_host4x,on_pressure_host1x} \
             --out "$OUT/ws_deep.json" 2>&1 | grep -v Warning | tail -40 | tee "$OUT/ws_deep.txt" ;;
    # issue 34: the first question after an upload, cold vs warmed, through /v1 (launch.py --ui off) at the 8B shape,
    # and a running stream's TPOT beside warms (writes the 16 GB random checkpoint under /tmp/bh once, as http does)
    warm) timeout ${WARM_TIMEOUT:-560} python3 benchmarks/bench_warm.py --device cuda --shape 8b --workdir /tmp/bh \
             ${WARM_ARGS:---images 8 --tpot-tokens 256} --out "$OUT/warm_8b.json" 2>&1 | grep -v Warning | tail -40 \
             | tee "$OUT/warm.txt" ;;
    # benchmarks/bench_http.py at the 8B shape (writes a 16 GB random checkpoint under /tmp/bh once): /v1 over HTTP
    # (launch.py --ui off) vs the engine API, in-process and the core in its own process; needs the web wheels in .whl
    http) timeout ${HTTP_TIMEOUT:-560} python3 benchmarks/bench_http.py --device cuda --shape 8b --workdir /tmp/bh \
             --engine in_process process ${HTTP_ARGS:-} --out "$OUT/bench_http_8b.json" 2>&1 | grep -v Warning | tail -30 \
             | tee "$OUT/bench_http_8b.txt" ;;
    # needs two GPUs (nvidia-h200-x2): TP2 beside TP1 at the 8B shape; NVLink multicast off
    tp) NCCL_NVLS_ENABLE=0 timeout 590 python3 benchmarks/bench_tp.py --shape 8b --device cuda ${TP_ARGS:-} \
             --out "$OUT/bench_tp.json" 2>&1 | grep -v Warning | tail -20 | tee "$OUT/bench_tp.txt" ;;
    selectors) timeout 500 python3 benchmarks/bench_selectors.py --shape 8b --device cuda ${SEL_ARGS:-} \
             --out "$OUT/selectors.json" 2>&1 | grep -v Warning | tail -16 | tee "$OUT/selectors.txt" ;;
    quality) timeout 560 python3 benchmarks/bench_quality.py ${QUALITY_ARGS:---model benchmarks/quality/probe \
             --device cuda --samples 2500 --blind --transfer 500} --out "$OUT/quality.json" 2>&1 | grep -v Warning | tail -30 \
             | tee "$OUT/quality.txt" ;;
    bench) timeout 560 python3 benchmarks/bench_gpu.py ${BENCH_ARGS:-} --out "$OUT/bench_gpu.json" 2>&1 | tail -40 | tee "$OUT/bench.txt" ;;
  esac
done
