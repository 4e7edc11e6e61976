#!/usr/bin/env bash
# The prepared GPU check of issue 15, for the next session that is lent a CUDA machine (do not run it on CPU).
#
#   bash benchmarks/gpu_smoke.sh [deps|unit|smoke|bench|all] ...   (default: all, in that order)
#
# Writes everything under $OUT (the device tool's folder that comes back), else ./gpu_out:
#   deps  - the GPU machines have torch, Lightning and torchmetrics but no jsonargparse, DeepSpeed, tensorboardX or
#           pydantic, and no network: install them from wheels in $WHEELS (default .whl, a folder of the checkout
#           that `.git/info/exclude` ignores and the device tool's `carry` names; fill it here with
#           `pip download --no-deps -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux_2_17_x86_64
#           jsonargparse tensorboardX pydantic pydantic-core hjson ninja py-cpuinfo msgpack ...` plus
#           `pip download --no-deps --no-binary=:all: -d .whl deepspeed`); DeepSpeed is an sdist, built with DS_BUILD_OPS=0 and
#           --no-build-isolation (its ops, cpu_adam included, compile on first use into TORCH_EXTENSIONS_DIR);
#   unit  - the unit tests, GPU-only ones included (SyncBN torch-kernel parity, measured reports);  ~1-2 min
#   smoke - every registered strategy, 3 steps of a tiny GPT on CUDA (benchmarks/gpu.py --smoke);    ~3-5 min
#   bench - both tables of the issue side by side (benchmarks/gpu.py), goals checked in gpu.json;   ~8-10 min
# Each part stays under the device tool's 10-minute limit per command: with little device time left, run
# `smoke` and `bench` as separate calls, or `bench` with fewer runs: RUNS=offload_zero2,anchor_deepspeed_zero_offload
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PY:-python}
WHEELS=${WHEELS:-.whl}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
export PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(deps unit smoke bench)
[ "${parts[0]}" = all ] && parts=(deps unit smoke bench)

for part in "${parts[@]}"; do
  echo "=== $part ($(date -u +%H:%M:%S))"
  case "$part" in
    deps)
      nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
      "$PY" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"
      if [ -d "$WHEELS" ]; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" jsonargparse tensorboardX pydantic 2>&1 | tail -3
        DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-build-isolation deepspeed 2>&1 | tail -3
      else
        echo "no wheel folder $WHEELS: DeepSpeed runs (offload, offload_zero2, the ZeRO-Offload anchor) will fail"
      fi
      "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
      ;;
    unit)
      timeout 540 "$PY" -m pytest -q -m "not distributed" -rs tests/unit 2>&1 | tee "$OUT/unit.txt" | tail -25
      ;;
    smoke)
      timeout 560 "$PY" benchmarks/gpu.py --smoke --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.txt" | tail -30
      ;;
    bench)
      timeout 580 "$PY" benchmarks/gpu.py --steps "${STEPS:-25}" --warmup "${WARMUP:-8}" --timeout 240 \
        ${RUNS:+--runs "$RUNS"} --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.txt" | tail -45
      ;;
    *) echo "unknown part $part (deps|unit|smoke|bench|all)"; exit 2 ;;
  esac
done
