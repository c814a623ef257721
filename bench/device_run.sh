#!/usr/bin/env bash
# One call on a GPU machine with nothing installed (torch and triton from its image):
#   bash bench/device_run.sh PART[,PART...]
# PARTs, run in the order given:
#   flashmla  make FlashMLA v1.0.0 importable from .peers/FlashMLA (a prepared tree, ../shared/peers/flashmla.md):
#             reuse a build cat'ed back into .peers/FlashMLA/flash_mla/, or build it in the background (~100 s)
#   hf        install transformers (the layer tests' real client) from wheels carried in .wheels/ (no index there)
#   tests     pytest on the GPU ($TESTS: test paths and options, default the whole suite with CPU-sized grids, on
#             $TESTS_WORKERS processes, default 8;
#             ANYMLA_HOPPER_KERNELS=0 runs it on the portable kernels, with DISABLE_MMA_V3=1 on the mma.sync path;
#             $TESTS_K: a -k expression; $TESTS_VERSION: a version bench.ab prepared in $AB_DIR, tested instead of
#             the working tree's package, with the working tree's tests)
#   overhead  python -m anymla.bench.overhead, in a fresh Triton cache (its cold-start part counts compiles)
#   sweep     the harness's tile sweep ($SWEEP_SUITE, default tp; $SWEEP_CASES: case names, default all;
#             $SWEEP_ARGS: more options, e.g. --portable, with DISABLE_MMA_V3=1 for the mma.sync stand-in)
#   bench     python -m anymla.bench ($BENCH_ARGS, default --suite canonical --suite tp), FlashMLA included
#   standins  issue 13's table: python -m anymla.bench --suite canonical --backends triton on the shipped path,
#             --portable, --mma-sync and --mma-sync with ANYMLA_MMA_V2=0, each in a fresh Triton cache, then
#             python -m anymla.bench.standins over the four (standins.md)
#   layer     python -m anymla.bench.layer ($LAYER_ARGS, e.g. --writers-only --writer-tiles 4x1,8x2)
#   ab        python3 bench/ab.py run over the versions prepared in $AB_DIR (default .ab_var, carried along) on
#             $AB_CASES ($AB_ARGS passed on, e.g. --stand-in portable; $AB_TIMEOUT, default 300 s)
#   ncu       Nsight Compute on one kernel launch of each of $NCU_CASES (cases of $NCU_SUITE, default tp; kernels
#             matching $NCU_KERNEL; $NCU_ARGS passed on to bench.profile_case, e.g. --portable): the report, its
#             details page, its SASS source page as CSV (stall samples an instruction) and that page summed per
#             warp-specialized partition with its mbarrier retry counts (bench.stall_regions)
# REQUIRE_GPU: a part of the GPU's name (e.g. H200); on any other GPU nothing runs, so a call that must time on
# one kind of card costs only its start on another.
# Makes `anymla` importable without pip (the folders map onto the package as in pyproject.toml) and leaves logs
# and CSVs in $OUT (default ./device_out).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
# A folder holding `anymla` made of the package folders under $1 (the working tree, or a version bench.ab prepared)
package_site() {
  local site
  site=$(mktemp -d)
  mkdir -p "$site/anymla"
  cp -r "$1/dispatch/." "$site/anymla/"
  for pkg in triton_kernels ascendc_kernels bench; do ln -s "$(realpath "$1/$pkg")" "$site/anymla/$pkg"; done
  echo "$site"
}
site=$(package_site "$PWD")
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpu=$(python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())")
echo "$gpu" | tee "$OUT/gpu.txt"
if [[ -n ${REQUIRE_GPU:-} && $gpu != *"$REQUIRE_GPU"* ]]; then echo "not a $REQUIRE_GPU: nothing run"; exit 0; fi
fm=$PWD/.peers/FlashMLA
flashmla_wait() { [[ -n ${FLASHMLA_PID:-} ]] && { wait "$FLASHMLA_PID"; echo "flashmla build: $(tail -1 "$OUT/flashmla.log")"; FLASHMLA_PID=; }; }
IFS=, read -ra parts <<< "${1:-tests}"
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  case $part in
    flashmla)
      export PYTHONPATH="$PYTHONPATH:$fm"
      if ls "$fm"/flash_mla/cuda*.so > /dev/null 2>&1; then echo "flashmla: reusing $(ls "$fm"/flash_mla/cuda*.so)"
      else bash .peers/build_flashmla.sh "$fm" > "$OUT/flashmla.log" 2>&1 & FLASHMLA_PID=$! FLASHMLA_BUILT=1; fi ;;
    hf)
      python3 -m pip install -q --no-index --find-links .wheels transformers 2>&1 | tail -3
      python3 -c "import transformers; print('transformers', transformers.__version__)" ;;
    tests)
      tests_path=$PYTHONPATH
      [[ -n ${TESTS_VERSION:-} ]] && tests_path="$(package_site "${AB_DIR:-.ab_var}/$TESTS_VERSION")${PYTHONPATH#"$site"}"
      # shellcheck disable=SC2086
      # SIGINT at the time limit: pytest then still lists the failures so far (-rf)
      PYTHONPATH=$tests_path ANYMLA_TEST_GRID=${ANYMLA_TEST_GRID:-small} timeout -s INT "${TESTS_TIMEOUT:-1000}" python3 -m pytest -q -rfs --tb=line -n "${TESTS_WORKERS:-8}" -p no:cacheprovider --import-mode=importlib \
        ${TESTS:-tests} ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/tests.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -60 ;;
    overhead)
      flashmla_wait
      TRITON_CACHE_DIR=$(mktemp -d) python3 -m anymla.bench.overhead --csv "$OUT/overhead.csv" ${OVERHEAD_ARGS:-} 2>&1 | tee "$OUT/overhead.log" ;;
    sweep)
      cases=(); for c in ${SWEEP_CASES:-}; do cases+=(--case "$c"); done
      timeout "${SWEEP_TIMEOUT:-1000}" python3 -m anymla.triton_kernels.harness --suite "${SWEEP_SUITE:-tp}" --sweep \
        ${SWEEP_ARGS:-} "${cases[@]}" --csv "$OUT/sweep.csv" > "$OUT/sweep.log" 2>&1; tail -60 "$OUT/sweep.log" ;;
    bench)
      flashmla_wait
      # shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT:-1000}" python3 -m anymla.bench ${BENCH_ARGS:---suite canonical --suite tp} \
        --out "$OUT/bench" > "$OUT/bench.log" 2>&1
      tail -80 "$OUT/bench.log" ;;
    ncu)
      for c in ${NCU_CASES:-tp-sdecode-v32-b128-h16}; do
        # shellcheck disable=SC2086
        rep="$OUT/ncu_$c${NCU_ARGS:+_portable}"
        timeout 300 ncu --clock-control none -k "regex:${NCU_KERNEL:-.}" --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
          --section Occupancy --section LaunchStats --section SourceCounters -f -o "$rep" \
          python3 -m anymla.bench.profile_case --suite "${NCU_SUITE:-tp}" --case "$c" ${NCU_ARGS:-} > "$rep.log" 2>&1
        ncu -i "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
        # Stall samples a SASS instruction: which warpgroup of a warp-specialized kernel waits, and on what
        ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
        python3 -m anymla.bench.stall_regions "$rep.sass.csv" > "$rep.stalls.txt" 2>&1
        grep -A1 "^== " "$rep.stalls.txt" | head -24
        grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Stall|Issued Warp|No Eligible|Registers|Shared Memory Config|L2 Hit|L1/TEX Hit|==PROF==|rror" \
          "$rep.txt" "$rep.log" | head -40
      done ;;
    standins)
      for run in shipped: portable:--portable mma_sync:--mma-sync mma_sync_triton:--mma-sync; do
        name=${run%%:*}
        # each run in a Triton cache of its own: run 135's two unexplained cells came from four runs sharing one
        # shellcheck disable=SC2046
        env $([[ $name == mma_sync_triton ]] && echo ANYMLA_MMA_V2=0) TRITON_CACHE_DIR="$(mktemp -d)" timeout "${STANDINS_TIMEOUT:-400}" \
          python3 -m anymla.bench --suite canonical --backends triton ${run#*:} --out "$OUT/$name" > "$OUT/$name.log" 2>&1
        echo "$name: $(tail -1 "$OUT/$name.log")"
      done
      python3 -m anymla.bench.standins "$OUT"/{shipped,portable,mma_sync,mma_sync_triton}/results.csv \
        | tee "$OUT/standins.md" ;;
    layer)
      # shellcheck disable=SC2086
      python3 -m anymla.bench.layer --out "$OUT/layer" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer.log" | tail -40 ;;
    ab)
      # shellcheck disable=SC2086
      timeout "${AB_TIMEOUT:-300}" python3 bench/ab.py run "${AB_DIR:-.ab_var}" ${AB_CASES:?AB_CASES: the cases to time} \
        ${AB_ARGS:-} --csv "$OUT/ab.csv" > "$OUT/ab.log" 2>&1; tail -30 "$OUT/ab.log" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
flashmla_wait
# A build made here goes back in pieces (to be cat'ed into .peers/FlashMLA/flash_mla/); a reused one stays.
so=$(ls "$fm"/flash_mla/cuda*.so 2>/dev/null | head -1)
if [[ -n ${FLASHMLA_BUILT:-} && -n $so ]]; then basename "$so" > "$OUT/flashmla_so_name"; split -b 15M -d "$so" "$OUT/flashmla_so.part"; fi
# At most 8 files come back from the machine: everything but the FlashMLA build goes back as one archive
# (written beside $OUT first: tar must not read the file it writes).
tgz=$(mktemp --suffix=.tgz)
(cd "$OUT" && tar czf "$tgz" --exclude='flashmla_so*' . && mv "$tgz" results.tgz \
  && find . -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name 'flashmla_so*' -exec rm -rf {} +)
