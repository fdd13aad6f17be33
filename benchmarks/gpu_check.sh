#!/usr/bin/env bash
# One GPU check on a rented H100/H200 (issue 3): environment, kernel parity tests on CUDA, kernel benchmarks, and the
# k-means benchmark if present. Every step has its own timeout (about 8 minutes in all); a failing step does not stop
# the others, but the script exits non-zero at the end if any failed.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]        # default: $RESULTS_DIR, else benchmarks/results
#   RESULTS_DIR=$OUT bash benchmarks/gpu_check.sh     # the device tool returns only files written under $OUT
#
# Writes <card>-env.txt, <card>-tests.txt, <card>-kernels.json (+ .log), <card>-kmeans.json (+ .log),
# <card>-demo.txt (a demo training run on CUDA) and <card>-summary.txt, where <card> is a slug of the GPU name (e.g. nvidia-h200). Wheels in .whl/, if any, are
# installed into /tmp/site first (the machine has no package registry). Env: PYTHON (default python3),
# KERNEL_BUDGET_S (bench_kernels' time budget, default 150).
set -u
cd "$(dirname "$0")/.." || exit 2
RESULTS=${1:-${RESULTS_DIR:-benchmarks/results}}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET INFOSIEVE_KERNELS  # real kernels, dispatch by device

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
card=$(printf '%s' "${gpu_name:-unknown-gpu}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
summary="$RESULTS/$card-summary.txt"
: >"$summary"
failed=0

step() {  # step NAME SECONDS LOGFILE CMD...: run with a timeout, tee the output, record the outcome
  local name=$1 secs=$2 log=$3; shift 3
  echo "=== $name (timeout ${secs}s): $*"
  local t0=$SECONDS rc
  set -o pipefail
  timeout --kill-after=10 "$secs" "$@" 2>&1 | tee "$log"
  rc=$?
  set +o pipefail
  local msg="ok"
  if [ "$rc" -ne 0 ]; then
    failed=1
    msg="FAILED rc=$rc"
    [ "$rc" -eq 124 ] && msg="FAILED: timed out after ${secs}s"
  fi
  echo "$name: $msg ($((SECONDS - t0)) s)" | tee -a "$summary"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) uncommitted paths"
  nvidia-smi || echo "nvidia-smi failed"
  "$PY" - <<'EOF'
import platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton import failed:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "sm", f"{p.major}{p.minor}", "SMs", p.multi_processor_count, "GiB", round(p.total_memory / 2**30, 1))
else:
    print("torch sees no GPU")
EOF
} 2>&1 | tee "$RESULTS/$card-env.txt"

# GPU_CHECK_SHORT=1: a ~3-minute version for a nearly spent device budget (parity subset, short kernel bench, 4-epoch demo).
short=${GPU_CHECK_SHORT:-0}

tests=()
for t in tests/test_kernels_code_head.py tests/test_kernels_contrastive.py tests/test_compat.py; do
  if [ -f "$t" ]; then tests+=("$t"); else echo "missing test file: $t" | tee -a "$summary"; failed=1; fi
done
if [ "$short" = 1 ]; then
  step "parity subset (CUDA)" 45 "$RESULTS/$card-tests.txt" "$PY" -m pytest tests/test_kernels_contrastive.py \
    -k "dtype0 or two_rows or paths_agree or dispatch" -q -rfEs -p no:cacheprovider
elif [ "${#tests[@]}" -gt 0 ]; then
  step "parity tests (CUDA)" 120 "$RESULTS/$card-tests.txt" "$PY" -m pytest "${tests[@]}" -q -rfEs -p no:cacheprovider
fi

[ "$short" = 1 ] && kernel_budget=45 || kernel_budget=${KERNEL_BUDGET_S:-150}
step "bench_kernels" $((kernel_budget + 30)) "$RESULTS/$card-kernels.log" \
  "$PY" benchmarks/bench_kernels.py --device cuda --budget-s "$kernel_budget" --json "$RESULTS/$card-kernels.json"

if [ "$short" = 1 ]; then
  echo "bench_kmeans: skipped (short mode)" | tee -a "$summary"
elif [ -f benchmarks/bench_kmeans.py ]; then
  help=$(timeout 30 "$PY" benchmarks/bench_kmeans.py --help 2>&1)
  args=()
  grep -q -- "--device" <<<"$help" && args+=(--device cuda)
  grep -q -- "--json" <<<"$help" && args+=(--json "$RESULTS/$card-kmeans.json")
  step "bench_kmeans" 70 "$RESULTS/$card-kmeans.log" "$PY" benchmarks/bench_kmeans.py "${args[@]}"
else
  echo "bench_kmeans: skipped (benchmarks/bench_kmeans.py not present)" | tee -a "$summary"
fi

# The whole training path on CUDA: bf16 autocast, the Triton kernels chosen by the dispatch, k-means on the GPU.
[ "$short" = 1 ] && demo_epochs=4 demo_secs=60 || demo_epochs=12 demo_secs=120
step "demo training (CUDA)" "$demo_secs" "$RESULTS/$card-demo.txt" "$PY" -m infosieve_fast.cli train --config configs/demo.yaml \
  --out "/tmp/gpu-demo-$$" --set train.device=cuda --set schedule.epochs=$demo_epochs

echo "=== summary ($RESULTS)"
cat "$summary"
exit "$failed"
