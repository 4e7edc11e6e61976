#!/usr/bin/env bash
# Loop the offload jobs of `make test` and count the runs that exit non-zero (issue 29, item 3).
#
# usage: benchmarks/loop_offload_exit.sh [N] [JOBS]
#   N     iterations (default 20)
#   JOBS  comma list of: resume (resume_exact.py offload, Lightning's launcher, 2 ranks),
#         torchrun (offload_parity.py ZeRO-2/3 host-memory combos + resume, torchrun, 2 ranks),
#         launcher (the same under Lightning's launcher), short (one ZeRO-3 host-memory combo, no DDP baseline, no
#         resume, torchrun, 2 ranks: the same exit path in a fraction of the time); default resume,torchrun
# Each run holds the machine-wide lock $LOCK (default /tmp/ld-dist.lock) only while it runs. A run "trained correctly" when
# every rank printed its RESULT lines; a run that did and still exited non-zero is a spurious exit failure.
# Logs of failing runs: $LOG_DIR (default /tmp/loop_offload_exit.<pid>).
set -u
N=${1:-20}
JOBS=${2:-resume,torchrun}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
LOG_DIR=${LOG_DIR:-/tmp/loop_offload_exit.$$}
LOCK=${LOCK:-/tmp/ld-dist.lock}
mkdir -p "$LOG_DIR"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(cd "$(dirname "$PY")/.." && pwd)/torch_extensions}
unset LOCAL_RANK RANK WORLD_SIZE NODE_RANK GROUP_RANK LOCAL_WORLD_SIZE
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
declare -A runs fails spurious
IFS=, read -ra jobs <<<"$JOBS"
for i in $(seq 1 "$N"); do
  for job in "${jobs[@]}"; do
    out=$(mktemp -d /tmp/loop_offload.XXXX)
    export MASTER_PORT=$(port)
    case $job in
      resume) cmd=("$PY" tests/scenarios/resume_exact.py "$out" offload); want=2 ;;
      torchrun) cmd=("$PY" -m torch.distributed.run --nproc-per-node=2 --master-addr=127.0.0.1 --master-port="$MASTER_PORT"
                     tests/scenarios/offload_parity.py 2:cpu:-,3:cpu:cpu --resume 3:cpu:cpu --nvme-root "$out"); want=10 ;;
      short) cmd=("$PY" -m torch.distributed.run --nproc-per-node=2 --master-addr=127.0.0.1 --master-port="$MASTER_PORT"
                  tests/scenarios/offload_parity.py 3:cpu:cpu --no-ddp); want=4 ;;
      launcher) cmd=("$PY" tests/scenarios/offload_parity.py 2:cpu:-,3:cpu:cpu --devices 2 --resume 3:cpu:cpu
                     --nvme-root "$out"); want=10 ;;
      *) echo "unknown job $job" >&2; exit 2 ;;
    esac
    start=$(date +%s)
    # the run's own time is measured inside the lock (waiting for it can take minutes on a shared machine)
    (cd "$ROOT" && flock "$LOCK" bash -c 'date +%s >"$0/started"; exec timeout 900 "${@}"' "$out" "${cmd[@]}" \
       >"$out/stdout" 2>"$out/stderr")
    rc=$?
    ran=$(( $(date +%s) - $(cat "$out/started" 2>/dev/null || echo "$start") ))
    got=$(grep -o 'RESULT ' "$out/stdout" | wc -l)
    runs[$job]=$(( ${runs[$job]:-0} + 1 ))
    verdict=ok
    if [ "$rc" != 0 ]; then
      fails[$job]=$(( ${fails[$job]:-0} + 1 ))
      verdict=FAILED
      if [ "$got" -ge "$want" ]; then spurious[$job]=$(( ${spurious[$job]:-0} + 1 )); verdict="FAILED after training correctly"; fi
      cp "$out/stdout" "$LOG_DIR/$job.$i.stdout"; cp "$out/stderr" "$LOG_DIR/$job.$i.stderr"
    fi
    echo "run $i $job: rc=$rc results=$got/$want ran ${ran}s (waited $(( $(date +%s) - start - ran ))s for the lock) $verdict"
    rm -rf "$out"
  done
done
for job in "${jobs[@]}"; do
  echo "SUMMARY $job: ${runs[$job]:-0} runs, ${fails[$job]:-0} non-zero exits, ${spurious[$job]:-0} after training correctly"
done
echo "logs of failing runs: $LOG_DIR"
