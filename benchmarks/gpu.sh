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
