#!/usr/bin/env bash
# The benchmark suite on a CUDA machine (at most 11 minutes: each part's
# time limit below; most of it compiling).
# Usage: bash benchmarks/gpu.sh [OUT]   (default benchmarks/RESULTS-gpu.md)
#
# Each part writes its own file beside OUT (OUT with -float8.md,
# -float8-remat.md, -autocast.md, -collectives.md, -hlo.md in place of
# .md) as soon as it ends, and runs under a time limit, so that a part
# that fails or runs long leaves the others' results; the script's status
# is the first failing part's.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/RESULTS-gpu.md}"
stem="${out%.md}"
hlo="${HLO_DIR:-}"  # a folder for the float8 steps' compiled HLO, if set
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python - <<'PY' || exit 1
import jax
assert jax.default_backend() == "gpu", (
    f"no GPU visible to JAX (backend {jax.default_backend()!r}); install "
    "jax[cuda12] or jax[cuda13]"
)
import flax, optax, sys
print(jax.devices(), f"Python {sys.version.split()[0]}, jax {jax.__version__}, "
      f"flax {flax.__version__}, optax {optax.__version__}")
PY
status=0
part() {  # part SECONDS COMMAND...: runs it, keeps the first failure
    local limit=$1
    shift
    echo "== $* (limit ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== status $rc after $((SECONDS - start)) s"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}
# float8: every float8 matmul of the step must be a cuBLASLt float8 GEMM in
# the compiled HLO (a MISMATCH, printed in capitals, is a silent fallback
# and fails the part), then each recipe's float8 step against bfloat16
# autocast's, side by side, on the demo GPT (12 layers, width 1024,
# context 1024): without remat, then with each block
# under nnx.remat(policy=dots_with_no_batch_dims_saveable), tensorwise
# only. HLO_DIR=DIR keeps the float8 steps' compiled HLO. Needs compute
# capability 8.9 or more (Ada, Hopper, Blackwell).
part 200 python benchmarks/float8_gpu.py --remat none --rounds 3 \
    --out "$stem-float8.md" ${hlo:+--hlo "$hlo/hlo-float8.txt.gz"}
part 150 python benchmarks/float8_gpu.py --recipes tensorwise \
    --remat dots_with_no_batch_dims_saveable --rounds 3 \
    --out "$stem-float8-remat.md" ${hlo:+--hlo "$hlo/hlo-float8-remat.txt.gz"}
# The dtypes and bytes of an FSDP step's collectives as XLA's GPU pipeline
# leaves them (on one GPU it may remove them).
part 40 python benchmarks/collectives.py --out "$stem-collectives.md"
# autocast against float32 and the hand-cast float16 model: step time and
# memory (needs flax, as the demo does).
part 70 python benchmarks/autocast.py --rounds 3 --out "$stem-autocast.md"
# What loss scaling costs per step, against plain optax and its peers.
part 80 python benchmarks/step_overhead.py \
    --sections optimizer,mlp,memory --out "$out"
# The kernels of those steps as compiled (and autotuned) for this GPU: the
# census that benchmarks/gpu_hlo.py makes without a GPU (RESULTS-gpu-hlo.md),
# checked against the device's own compile.
part 120 python benchmarks/gpu_hlo.py --target attached \
    --sections optimizer,leaves --out "$stem-hlo.md"
exit "$status"
