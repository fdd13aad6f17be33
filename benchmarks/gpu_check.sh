#!/usr/bin/env bash
# The GPU check: one prepared run on a lent H100/H200, from a clean committed tree, within GPU_CHECK_BUDGET_S
# (360 s) of work, so that 15 minutes of device time leave room to start the machine and to rerun.
#
#   GPU_CHECK_COMMIT=$(git rev-parse HEAD) RESULTS_DIR=$OUT bash benchmarks/gpu_check.sh
#
# CPU rehearsal (CI runs it): INFOSIEVE_BENCH_SMOKE=1 makes every step run on the CPU at its script's smoke size, its
# archive going to RESULTS_DIR or a temporary folder.
#
# Everything lands in one archive, RESULTS_DIR/<card>-gpu-check.tar.gz (<card>: a slug of the GPU's name), packed
# again after every step and on any exit, so a run cut short keeps what it measured; each benchmark also writes its
# JSON as it goes. The never-measured steps run first:
#   preflight      the GPU, one nvJPEG decode against the CPU's, one Triton kernel against its PyTorch twin
#   kmeans-in1k    one SS-k-means round at ImageNet-1k size (1.28M x 768, K = 1000, 10 x 10, balanced reference)
#   epoch-in1k     the ImageNet-1k epoch projected from >= 500 ViT-B/16 steps on streamed shards (nvJPEG vs CPU)
#   cache-herb19   a Herbarium19-size set (34k images, shorter side 256) served from the decoded GPU cache
#   train          bench_train: the default and the fastest variant against the published step and epoch, and the
#                  step replayed from a CUDA graph (train.cuda_graph=on, last)
#   kernels        bench_kernels, short
#   parity         every kernel parity test on CUDA, and a CUDA-graph step against the eager step
#   resume         a run killed after epoch 1 and resumed on CUDA; a step under set_sync_debug_mode("error")
#   demo           the demo on CUDA
# Then the issues' GPU targets against what the run measured (benchmarks/gpu_targets.py) go into summary.txt and
# targets.json. To commit a run: python -m benchmarks.gpu_targets <card>-gpu-check.tar.gz --into benchmarks/results
# (each file as <card>-<file>, never over an existing one).
# Each step runs under a timeout of at most its own limit and what is left of the budget; a step that no longer fits
# is skipped and says so. GPU_CHECK_STEPS=train,kernels (a comma list of step names) runs only those, so a second
# run in the same lease can finish what the first one skipped. The caller names the commit (the device copy of the tree may hold a stale .git);
# GPU_CHECK_DIRTY=1 marks an uncommitted tree. The tree hash in every JSON is computed from the files that ran.
set -u
cd "$(dirname "$0")/.." || exit 2
SMOKE=${INFOSIEVE_BENCH_SMOKE:-0}
default_results=benchmarks/results
[ "$SMOKE" = 1 ] && default_results=${TMPDIR:-/tmp}/infosieve-gpu-check-rehearsal  # never beside real results
RESULTS=${1:-${RESULTS_DIR:-$default_results}}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-360}
STEP_NAMES=preflight,kmeans-in1k,epoch-in1k,cache-herb19,train,kernels,parity,resume,demo
selection=${GPU_CHECK_STEPS:-}
for selected in ${selection//,/ }; do
  if [[ ",$STEP_NAMES," != *",$selected,"* ]]; then
    echo "GPU_CHECK_STEPS: no step is called '$selected'; the steps: $STEP_NAMES" >&2
    exit 2
  fi
done
mkdir -p "$RESULTS"

if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu
  export TRITON_INTERPRET=1
else
  DEVICE=cuda
  unset TRITON_INTERPRET INFOSIEVE_KERNELS  # the real kernels, dispatched by device
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

commit=${GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [ -n "${GPU_CHECK_DIRTY:-}" ]; then
  dirty=$GPU_CHECK_DIRTY
elif git rev-parse HEAD >/dev/null 2>&1; then
  dirty=$([ -n "$(git status --porcelain)" ] && echo 1 || echo 0)
else
  dirty=unknown
fi
export INFOSIEVE_COMMIT=$commit INFOSIEVE_DIRTY=$dirty  # read by the benchmarks (benchmarks/provenance.py)

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
[ "$DEVICE" = cpu ] && gpu_name="cpu rehearsal"
card=$(printf '%s' "${gpu_name:-unknown-gpu}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
work=$(mktemp -d)
out="$work/$card"
mkdir -p "$out"
summary="$out/summary.txt"
archive="$RESULTS/$card-gpu-check.tar.gz"
pack() { tar -czf "$archive.tmp" -C "$work" "$card" && mv -f "$archive.tmp" "$archive"; }
trap pack EXIT
failed=0
started=$SECONDS

step() {  # step NAME LIMIT_S CMD...: run under min(LIMIT_S, budget left), log to NAME.log, record, pack
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then
    echo "$name: not selected (GPU_CHECK_STEPS=$GPU_CHECK_STEPS)" | tee -a "$summary"
    return
  fi
  local left=$((BUDGET - (SECONDS - started)))
  local secs=$((limit < left ? limit : left))
  if [ "$secs" -lt 15 ]; then
    echo "$name: SKIPPED, ${left}s of the ${BUDGET}s budget left" | tee -a "$summary"
    failed=1
    return
  fi
  echo "=== $name (timeout ${secs}s): $*"
  local t0=$SECONDS rc
  set -o pipefail
  timeout --kill-after=10 "$secs" "$@" 2>&1 | tee "$out/$name.log"
  rc=$?
  set +o pipefail
  local msg="ok"
  if [ "$rc" -ne 0 ]; then
    failed=1
    msg="FAILED rc=$rc"
    [ "$rc" -eq 124 ] && msg="FAILED: timed out after ${secs}s"
  fi
  echo "$name: $msg ($((SECONDS - t0)) s)" | tee -a "$summary"
  pack
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $commit dirty=$dirty tree_hash=$("$PY" -m benchmarks.provenance)"
  echo "budget: ${BUDGET}s of work; steps: ${GPU_CHECK_STEPS:-all}"
  nvidia-smi 2>/dev/null || echo "nvidia-smi: not available"
} >"$out/env.txt" 2>&1
cp "$out/env.txt" "$summary"

require_gpu=()
[ "$DEVICE" = cuda ] && require_gpu=(--require-gpu)
step preflight 60 "$PY" -m benchmarks.gpu_preflight --device "$DEVICE" "${require_gpu[@]}" --json "$out/preflight.json"

step kmeans-in1k 90 "$PY" -m benchmarks.bench_kmeans --device "$DEVICE" --scale imagenet1k \
  --distance-precision bf16,tf32,fp32 --json "$out/kmeans-imagenet1k.json"

step epoch-in1k 150 "$PY" -m benchmarks.bench_epoch_scale --device "$DEVICE" \
  --kmeans-json "$out/kmeans-imagenet1k.json" --json "$out/epoch-imagenet1k.json"

step cache-herb19 90 "$PY" -m benchmarks.bench_gpu_cache --device "$DEVICE" --json "$out/gpu-cache-herbarium19.json"

step train 120 "$PY" -m benchmarks.bench_train --device "$DEVICE" --epoch --epoch-variants fast_default,fast_all \
  --variants published_fp32,published_bf16,fast_default,fast_eager,fast_all,fast_graph --as-released-subset 1024 \
  --json "$out/train.json"

step kernels 90 "$PY" -m benchmarks.bench_kernels --device "$DEVICE" --budget-s 70 --json "$out/kernels.json"

xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)
parity=(tests/test_kernels_code_head.py tests/test_kernels_contrastive.py tests/test_compat.py
  tests/test_data_stream_exact.py tests/test_step_graph.py)
[ "$DEVICE" = cpu ] && parity+=(--collect-only)  # the rehearsal checks that the step starts; CI runs these tests
step parity 90 "$PY" -m pytest "${xdist[@]}" "${parity[@]}" -q -rfEs -p no:cacheprovider

step resume 60 "$PY" -m pytest tests/test_engine.py -k "(two_epoch and cuda) or never_waits" -q -rfEs \
  -p no:cacheprovider

# 18 s eager on an H200 at 71b264b; its projection head now compiles first (the probe used to fail on its 1 channel)
demo_epochs=()
[ "$DEVICE" = cpu ] && demo_epochs=(--set schedule.epochs=1 --set train.train_subset=256 --set kmeans.n_init=1)
step demo 75 "$PY" -m infosieve_fast.cli train --config configs/demo.yaml --out "$work/demo-run" \
  --set train.device="$DEVICE" "${demo_epochs[@]}"
cp "$work/demo-run/metrics.json" "$out/demo-metrics.json" 2>/dev/null

# the issues' targets against this run's results (benchmarks/gpu_targets.py), into the summary and targets.json
{ echo; "$PY" -m benchmarks.gpu_targets "$out" --json "$out/targets.json"; } >>"$summary" 2>&1 \
  || echo "targets: FAILED (see above)" >>"$summary"
pack

echo "=== summary ($archive)"
echo "total: $((SECONDS - started)) s of work" | tee -a "$summary"
cat "$summary"
exit "$failed"
