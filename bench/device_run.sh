#!/usr/bin/env bash
# One call on a lent GPU machine (nothing installed; torch and triton from its image):
#   bash bench/device_run.sh [harness|bench|tests|all] [extra arguments for that part]
# Makes `anymla` importable without pip (the folders map onto the package as in pyproject.toml), runs the
# requested parts and leaves logs and CSVs in $OUT (default ./device_out).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
site=$(mktemp -d)
mkdir -p "$site/anymla"
cp -r dispatch/. "$site/anymla/"
for pkg in triton_kernels ascendc_kernels bench; do ln -s "$PWD/$pkg" "$site/anymla/$pkg"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
what=${1:-all}; shift || true
if [[ $what == harness || $what == all ]]; then
  python3 -m anymla.triton_kernels.harness "$@" --csv "$OUT/harness.csv" 2>&1 | tee "$OUT/harness.log"
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m anymla.bench --suite canonical --out "$OUT/h200" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -x -n 8 -p no:cacheprovider --import-mode=importlib tests "$@" 2>&1 | tee "$OUT/tests.log"
fi
