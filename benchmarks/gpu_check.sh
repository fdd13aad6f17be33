#!/usr/bin/env bash
# The GPU check (issues 3 and 8): one run of about 8 minutes on a rented H100/H200, from a clean committed tree.
#
#   GPU_CHECK_COMMIT=$(git rev-parse HEAD) RESULTS_DIR=$OUT bash benchmarks/gpu_check.sh
#
# The device tool's copy of the tree may hold no .git or a stale one, so the caller names the commit (GPU_CHECK_COMMIT;
# GPU_CHECK_DIRTY=1 if the tree had uncommitted changes); without them it is read from git. Steps, in order of
# importance, each under its own timeout (a failing step does not stop the others; the script exits non-zero at the
# end if any failed):
#   1. bench_train: the whole step (published fp32 / bf16 autocast / infosieve-fast default / + each off-by-default
#      optimisation) and a CUB-size epoch against the published epoch, ViT-B/16 at 224, 128 samples per step;
#   2. the demo run killed after epoch 1 and resumed on CUDA, against an uninterrupted run, and a training step under
#      torch.cuda.set_sync_debug_mode("error") (tests/test_engine.py);
#   3. a 12-epoch demo training run on CUDA;
#   4. every kernel parity test on CUDA (pytest-xdist from .whl/ when carried);
#   5. bench_kmeans on the GPU against the published k-means (its broadcast chunk distance) on the GPU;
#   6. one k-means pseudo-label round at ImageNet-1k size (1.28M x 768 fp16 features, K = 1000, 10 x 10, balanced
#      reference mode) with fp32, tf32 and bf16 nearest-centre searches: seconds and peak memory beyond the features;
#   7. an ImageNet-1k epoch projected from 512 ViT-B/16 steps on synthetic JPEG shards streamed with nvJPEG
#      (bench_epoch_scale.py: loader alone, CPU vs GPU decode, loader wait, GPU utilisation; uses step 6's k-means).
# Writes <card>-env.txt, -train.json (+ .log), -resume.txt, -demo.txt, -tests.txt, -kmeans.json (+ .log),
# -kmeans-imagenet1k.json (+ .log), -epoch-imagenet1k.json (+ .log) and -summary.txt into RESULTS_DIR (default benchmarks/results), <card> being a slug
# of the GPU's name. Wheels in .whl/ are installed into /tmp/site first (the machine has no package registry).
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

commit=${GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [ -n "${GPU_CHECK_DIRTY:-}" ]; then
  dirty=$GPU_CHECK_DIRTY
elif git rev-parse HEAD >/dev/null 2>&1; then
  dirty=$([ -n "$(git status --porcelain)" ] && echo 1 || echo 0)
else
  dirty=unknown
fi
export INFOSIEVE_COMMIT=$commit INFOSIEVE_DIRTY=$dirty  # read by the benchmarks when git is absent

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
card=$(printf '%s' "${gpu_name:-unknown-gpu}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
summary="$RESULTS/$card-summary.txt"
echo "commit $commit dirty=$dirty" >"$summary"
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
  echo "commit: $commit dirty=$dirty"
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

step "bench_train step + epoch (ViT-B/16)" 240 "$RESULTS/$card-train.log" \
  "$PY" benchmarks/bench_train.py --device cuda --epoch --epoch-variants fast_default,fast_frozen_bf16,fast_all \
  --variants published_fp32,published_bf16,fast_default,fast_frozen_bf16,fast_checkpoint,fast_all \
  --json "$RESULTS/$card-train.json"

step "kill after epoch 1 + resume, no-sync step (CUDA)" 70 "$RESULTS/$card-resume.txt" \
  "$PY" -m pytest tests/test_engine.py -k "(two_epoch and cuda) or never_waits" -q -rfEs -p no:cacheprovider

step "demo training (CUDA)" 50 "$RESULTS/$card-demo.txt" "$PY" -m infosieve_fast.cli train --config configs/demo.yaml \
  --out "/tmp/gpu-demo-$$" --set train.device=cuda

xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)
step "kernel parity tests (CUDA)" 100 "$RESULTS/$card-tests.txt" "$PY" -m pytest "${xdist[@]}" \
  tests/test_kernels_code_head.py tests/test_kernels_contrastive.py tests/test_compat.py \
  tests/test_data_stream_exact.py -q -rfEs -p no:cacheprovider

step "bench_kmeans vs published k-means (GPU)" 55 "$RESULTS/$card-kmeans.log" "$PY" benchmarks/bench_kmeans.py \
  --device cuda --cases a,b --ref-inits 1,1 --ref-distance broadcast --modes plain,reference --repeat 1 \
  --json "$RESULTS/$card-kmeans.json"

step "k-means round at ImageNet-1k size (GPU)" 120 "$RESULTS/$card-kmeans-imagenet1k.log" "$PY" \
  benchmarks/bench_kmeans.py --device cuda --scale imagenet1k --distance-precision fp32,tf32,bf16 \
  --json "$RESULTS/$card-kmeans-imagenet1k.json"

step "ImageNet-1k epoch projection, streamed shards (GPU)" 240 "$RESULTS/$card-epoch-imagenet1k.log" "$PY" \
  benchmarks/bench_epoch_scale.py --device cuda --kmeans-json "$RESULTS/$card-kmeans-imagenet1k.json" \
  --json "$RESULTS/$card-epoch-imagenet1k.json"

echo "=== summary ($RESULTS)"
cat "$summary"
exit "$failed"
