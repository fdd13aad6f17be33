#!/usr/bin/env bash
# The GPU check: one prepared run on a lent H100/H200, from a clean committed tree, inside a hard budget of work
# (GPU_CHECK_BUDGET_S: 360 s on an H100, 300 s on an H200), so that 15 minutes of device time leave room to start the
# machine and to rerun what a first run could not finish.
#
#   GPU_CHECK_COMMIT=$(git rev-parse HEAD) RESULTS_DIR=$OUT bash benchmarks/tools/gpu_check.sh
#
# CPU rehearsal (CI runs it): INFOSIEVE_BENCH_SMOKE=1 makes every step run on the CPU at its script's smoke size, its
# archive going to RESULTS_DIR or a temporary folder.
#
# A queue ordered by value: what has never run on a GPU and what the issues' targets need most comes first. Each step
# has a limit in seconds; the limits sum to LIMITS_TOTAL_S (360), and a card with a smaller budget scales every limit
# by budget / 360, so no step can take another's time and the whole run ends within the budget:
#   preflight    25  the card, driver, versions, /dev/shm, free memory; one nvJPEG decode, one Triton kernel, one
#                    Inductor compile and one CUDA graph capture, each against its eager twin
#   train-step   80  bench_train's step alone (no epochs), one process, each variant written as it ends: published
#                    fp32, published bf16, the compiled default, fast_eager, fast_graph (CUDA graph), fast_all
#   kmeans-in1k  35  one SS-k-means round at ImageNet-1k size (1.28M x 768, K = 1000, balanced reference), bf16
#                    distances first, then tf32 and fp32
#   epoch-in1k   60  the ImageNet-1k epoch projected from >= 500 ViT-B/16 steps on streamed shards (the CPU-decode
#                    comparison after the projection, its failure its own)
#   cache-herb19 30  Herbarium19-size epochs (34k images) served from the decoded GPU cache
#   parity       45  the GPU parity tests (marker gpu_parity), serially: the CUDA-graph step (with auto
#                    checkpointing too) and the compiled step (Inductor's Triton lowering) against eager, k-means labels fp32 = tf32 = bf16 on CUDA and its segment sums, nvJPEG and the
#                    GPU cache, the fused kernels and the reference model patched with them
#   cub-epoch    35  bench_train's CUB-size epoch (feature pass, k-means, steps, checkpoint; 200-epoch projection)
#                    against the published epochs
#   kernels      15  bench_kernels, the training shapes first, each case written as it ends
#   resume       15  a run killed after epoch 1 and resumed on CUDA; a step under set_sync_debug_mode("error")
#   demo         20  the demo on CUDA (its projection head compiled first)
# Steps that run only when GPU_CHECK_STEPS names them, each under its own limit, outside the budget (never in a default
# run, never scaled):
#   train-methods 120  bench_train's method rows: GCD's, SimGCD's and SelEx's step (the compiled default with the
#                    method) against each method's published step, fp32 and bf16; each variant written as it ends
#   methods-sync  40  GCD's, SimGCD's and SelEx's training step under set_sync_debug_mode("error")
# Then the issues' targets against what the run measured (benchmarks/tools/gpu_targets.py) go into summary.txt and
# targets.json. To commit one: python -m benchmarks.tools.gpu_targets <card>-gpu-check.tar.gz --into benchmarks/results
# (each file as <card>-<file>, never over an existing one).
#
# Everything lands in one archive, RESULTS_DIR/<card>-gpu-check.tar.gz (<card>: a slug of the GPU's name), packed
# again (atomically) after every step and on any exit; every benchmark writes its JSON atomically after every case,
# variant or phase, so a step cut by its limit keeps what it measured. GPU_CHECK_STEPS=kernels,resume (a comma list
# of step names) runs only those, so a second run in the same lease can finish what the first one did not. The caller
# names the commit (the device copy of the tree may hold a stale .git); GPU_CHECK_DIRTY=1 marks an uncommitted tree.
# The tree hash in every JSON is computed from the files that ran.
set -u
cd "$(dirname "$0")/../.." || exit 2
SMOKE=${INFOSIEVE_BENCH_SMOKE:-0}
default_results=benchmarks/results
[ "$SMOKE" = 1 ] && default_results=${TMPDIR:-/tmp}/infosieve-gpu-check-rehearsal  # never beside real results
RESULTS=${1:-${RESULTS_DIR:-$default_results}}
PY=${PYTHON:-python3}
LIMITS_TOTAL_S=360
STEP_NAMES=preflight,train-step,kmeans-in1k,epoch-in1k,cache-herb19,parity,cub-epoch,kernels,resume,demo
NAMED_ONLY_STEPS=train-methods,methods-sync
selection=${GPU_CHECK_STEPS:-}
for selected in ${selection//,/ }; do
  if [[ ",$STEP_NAMES,$NAMED_ONLY_STEPS," != *",$selected,"* ]]; then
    echo "GPU_CHECK_STEPS: no step is called '$selected'; the steps: $STEP_NAMES; when named: $NAMED_ONLY_STEPS" >&2
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
export INFOSIEVE_COMMIT=$commit INFOSIEVE_DIRTY=$dirty  # read by the benchmarks (benchmarks/tools/provenance.py)

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
[ "$DEVICE" = cpu ] && gpu_name="cpu rehearsal"
card=$(printf '%s' "${gpu_name:-unknown-gpu}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
case "$card" in
  *h200*) default_budget=300 ;;
  *) default_budget=$LIMITS_TOTAL_S ;;
esac
# the rehearsal checks that every step runs on a busy 2-core CPU, not its time
[ "$SMOKE" = 1 ] && default_budget=$((3 * LIMITS_TOTAL_S))
BUDGET=${GPU_CHECK_BUDGET_S:-$default_budget}
work=$(mktemp -d)
out="$work/$card"
mkdir -p "$out"
summary="$out/summary.txt"
archive="$RESULTS/$card-gpu-check.tar.gz"
pack() { tar -czf "$archive.tmp" -C "$work" "$card" && mv -f "$archive.tmp" "$archive"; }
trap pack EXIT
failed=0
started=$SECONDS

step() {  # step NAME LIMIT_S CMD...: run under min(LIMIT_S scaled to the budget, budget left), log, record, pack
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then
    echo "$name: not selected (GPU_CHECK_STEPS=$GPU_CHECK_STEPS)" | tee -a "$summary"
    return
  fi
  local scaled=$((limit * BUDGET / LIMITS_TOTAL_S)) left=$((BUDGET - (SECONDS - started)))
  local secs=$((scaled < left ? scaled : left))
  if [ "$secs" -lt 5 ]; then
    echo "$name: SKIPPED, ${left}s of the ${BUDGET}s budget left" | tee -a "$summary"
    failed=1
    return
  fi
  run_step "$name" "$secs" "$@"
}

named_step() {  # named_step NAME LIMIT_S CMD...: only when GPU_CHECK_STEPS names it, under its own LIMIT_S
  local name=$1 limit=$2; shift 2
  if [[ ",${GPU_CHECK_STEPS:-}," != *",$name,"* ]]; then
    echo "$name: not selected (runs only when GPU_CHECK_STEPS names it)" | tee -a "$summary"
    return
  fi
  run_step "$name" "$limit" "$@"
}

run_step() {  # run_step NAME SECS CMD...: run under SECS, log, record, pack
  local name=$1 secs=$2; shift 2
  echo "=== $name (timeout ${secs}s): $*"
  local t0=$SECONDS rc
  set -o pipefail
  timeout --kill-after=5 "$secs" "$@" 2>&1 | tee "$out/$name.log"
  rc=$?
  set +o pipefail
  local msg="ok"
  if [ "$rc" -ne 0 ]; then
    failed=1
    msg="FAILED rc=$rc"
    [ "$rc" -eq 124 ] && msg="CUT: its ${secs}s limit was reached (what it wrote is kept)"
  fi
  echo "$name: $msg ($((SECONDS - t0)) s)" | tee -a "$summary"
  pack
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $commit dirty=$dirty tree_hash=$("$PY" -m benchmarks.tools.provenance)"
  echo "budget: ${BUDGET}s of work (limits sum to ${LIMITS_TOTAL_S}s, scaled by ${BUDGET}/${LIMITS_TOTAL_S}); steps: ${GPU_CHECK_STEPS:-all}"
  nvidia-smi 2>/dev/null || echo "nvidia-smi: not available"
} >"$out/env.txt" 2>&1
cp "$out/env.txt" "$summary"

require_gpu=()
[ "$DEVICE" = cuda ] && require_gpu=(--require-gpu)
step preflight 25 "$PY" -m benchmarks.tools.gpu_preflight --device "$DEVICE" "${require_gpu[@]}" \
  --json "$out/preflight.json"

step train-step 80 "$PY" -m benchmarks.bench_train --device "$DEVICE" \
  --variants published_fp32,published_bf16,fast_default,fast_eager,fast_graph,fast_all --json "$out/train-step.json"

step kmeans-in1k 35 "$PY" -m benchmarks.bench_kmeans --device "$DEVICE" --scale imagenet1k \
  --distance-precision bf16,tf32,fp32 --json "$out/kmeans-imagenet1k.json"

step epoch-in1k 60 "$PY" -m benchmarks.bench_epoch_scale --device "$DEVICE" \
  --kmeans-json "$out/kmeans-imagenet1k.json" --json "$out/epoch-imagenet1k.json"

step cache-herb19 30 "$PY" -m benchmarks.bench_gpu_cache --device "$DEVICE" --json "$out/gpu-cache-herbarium19.json"

# the compiled step last: it lowers a tiny ViT's graphs to Triton first, the longest wait of the selection
parity=(tests/test_step_graph.py tests/test_recompute.py tests/test_kmeans.py tests/test_data_stream_exact.py
  tests/test_kernels_code_head.py tests/test_kernels_contrastive.py tests/test_compat.py tests/test_compiling_inductor.py)
report=(-v -rfEs)  # each test's outcome on its own line: a cut run's log still says which passed
[ "$DEVICE" = cpu ] && report=(--collect-only -q)  # the rehearsal lists the selection; CI runs these tests
step parity 45 "$PY" -m pytest -m gpu_parity "${parity[@]}" "${report[@]}" -p no:cacheprovider

step cub-epoch 35 "$PY" -m benchmarks.bench_train --device "$DEVICE" --variants none --epoch \
  --epoch-variants fast_default --as-released-subset 1024 --json "$out/train-epoch.json"

step kernels 15 "$PY" -m benchmarks.bench_kernels --device "$DEVICE" --budget-s 11 --json "$out/kernels.json"

step resume 15 "$PY" -m pytest tests/test_engine.py -k "(two_epoch and cuda) or never_waits" -q -rfEs \
  -p no:cacheprovider

demo_epochs=()
[ "$DEVICE" = cpu ] && demo_epochs=(--set schedule.epochs=1 --set train.train_subset=256 --set kmeans.n_init=1
  --set train.max_steps_per_epoch=2)
step demo 20 "$PY" -m infosieve_fast.cli train --config configs/demo.yaml --out "$work/demo-run" \
  --set train.device="$DEVICE" "${demo_epochs[@]}"
cp "$work/demo-run/metrics.json" "$out/demo-metrics.json" 2>/dev/null

named_step train-methods 120 "$PY" -m benchmarks.bench_train --device "$DEVICE" --variants none \
  --methods gcd,simgcd,selex --json "$out/train-methods.json"

named_step methods-sync 40 "$PY" -m pytest tests/test_engine.py -k each_methods_step_runs_without_a_host_sync \
  -q -rfEs -p no:cacheprovider

# the issues' targets against this run's results (benchmarks/tools/gpu_targets.py), into the summary and targets.json
{ echo; "$PY" -m benchmarks.tools.gpu_targets "$out" --json "$out/targets.json"; } >>"$summary" 2>&1 \
  || echo "targets: FAILED (see above)" >>"$summary"
pack

echo "=== summary ($archive)"
echo "total: $((SECONDS - started)) s of work" | tee -a "$summary"
cat "$summary"
exit "$failed"
