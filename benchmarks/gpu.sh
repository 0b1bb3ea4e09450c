#!/usr/bin/env bash
# The benchmark suite on a CUDA machine (under 5 minutes on one modern GPU).
# Usage: bash benchmarks/gpu.sh [OUT]   (default benchmarks/RESULTS-gpu.md)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/RESULTS-gpu.md}"
python - <<'PY'
import jax
assert jax.default_backend() == "gpu", (
    f"no GPU visible to JAX (backend {jax.default_backend()!r}); install "
    "jax[cuda12] or jax[cuda13]"
)
PY
XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/step_overhead.py --out "$out"
# autocast against float32 and the hand-cast float16 model: step time and
# memory (needs flax, as the demo does).
XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/autocast.py \
    --out "${out%.md}-autocast.md"
# float8: every float8 matmul of the step must be a cuBLASLt float8 GEMM in
# the compiled HLO (a MISMATCH, printed in capitals, is a silent fallback:
# this line then fails the script, last so that the tables above are
# written), then the float8 step against bfloat16 autocast's, side by side,
# on the demo GPT at GPT-2-small shapes (12 layers, width 1024, context
# 1024). Needs compute capability 8.9 or more (Ada, Hopper, Blackwell).
XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/float8_gpu.py \
    --out "${out%.md}-float8.md"
