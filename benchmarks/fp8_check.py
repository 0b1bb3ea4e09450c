"""Counting float8 matmuls: in jaxprs, and cuBLASLt float8 GEMMs in HLO.

On a GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell) with
CUDA 12, XLA's ``gemm_rewriter`` turns a ``dot`` of float8 operands into a
custom call to cuBLASLt whose target is ``__cublas$lt$matmul$f8``
(``kCublasLtMatmulF8CallTarget``, ``xla/service/gpu/cublas_cudnn.cc``);
where it cannot, the dot runs in a wider type and the count is lower than
the jaxpr's. Both counts are plain functions of text and jaxprs, so that
the GPU check (``benchmarks/gpu.sh``) only compares them.

Usage::

    python benchmarks/fp8_check.py   # the counts for a small example
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

__all__ = ["FP8_GEMM_TARGET", "Fp8Dots", "count_fp8_dots", "count_fp8_gemms"]

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
_GEMM = re.compile(r'custom_call_target="' + re.escape(FP8_GEMM_TARGET) + '"')


def count_fp8_gemms(hlo_text: str) -> int:
    """The cuBLASLt float8 GEMM custom calls in compiled HLO text
    (``jax.jit(f).lower(*args).compile().as_text()``)."""
    return len(_GEMM.findall(hlo_text))


class Fp8Dots(NamedTuple):
    """``dot_general`` equations with float8 operands, by operand types."""

    forward: int  # e4m3 x e4m3
    backward: int  # one e5m2 operand, one e4m3 (cuBLASLt's HYBRID)
    other: int  # any other float8 pair (e5m2 x e5m2 has no cuBLASLt GEMM)


def count_fp8_dots(jaxpr: Any) -> Fp8Dots:
    """Counts the float8 ``dot_general``s of a (closed) jaxpr and of every
    jaxpr nested in its equations' params (``jit``, ``scan``, ``cond``,
    ``checkpoint``, ``shard_map``, custom derivatives)."""
    forward = backward = other = 0
    for eqn in _equations(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        names = sorted(np.dtype(v.aval.dtype).name for v in eqn.invars)
        if not all(n.startswith("float8") for n in names):
            continue
        if names == ["float8_e4m3fn", "float8_e4m3fn"]:
            forward += 1
        elif names == ["float8_e4m3fn", "float8_e5m2"]:
            backward += 1
        else:
            other += 1
    return Fp8Dots(forward, backward, other)


def _equations(jaxpr: Any) -> Any:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from _equations(sub)


def _main() -> None:
    import jax
    import jax.numpy as jnp

    import lossscale
    from lossscale._autocast import _fp8

    x = jnp.ones((32, 64), jnp.float32)
    w = jnp.ones((64, 16), jnp.float32)
    dims = (((1,), (0,)), ((), ()))

    def loss(x: Any, w: Any) -> Any:
        y = _fp8.dot_general(x, w, dims, lossscale.Float8())
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.grad(loss, (0, 1))
    dots = count_fp8_dots(jax.make_jaxpr(grad)(x, w))
    hlo = jax.jit(grad).lower(x, w).compile().as_text()
    print(f"backend: {jax.default_backend()}")
    print(f"float8 dots in the jaxpr: {dots}")
    print(f"cuBLASLt float8 GEMMs in the compiled HLO: {count_fp8_gemms(hlo)}")


if __name__ == "__main__":
    _main()
