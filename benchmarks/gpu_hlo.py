"""GPU kernels without a GPU: what XLA compiles a jitted step into for an
NVIDIA H200 (or H100), counted in the optimized HLO, on a CPU machine.

XLA's GPU compiler runs without a device when it is given the device's
description (``gpu_specs/*.txtpb``, a ``stream_executor`` target config):
``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=...)`` makes compile-only devices of it, and a step lowered
with arguments placed on them compiles for that GPU (sm_90, its fusion and
GEMM rewrites) on this CPU. It needs only the CUDA plugin of the installed
jaxlib, not CUDA, a driver or a GPU::

    version=$(python -c 'import jax; print(jax.__version__)')
    pip install "jax[cuda13-local]==$version"
    JAX_PLATFORMS=cpu python benchmarks/gpu_hlo.py [--target h200] [--quick]
        [--sections optimizer,leaves,mlp,autocast] [--gemm cublas|xla]
        [--out FILE]

``JAX_PLATFORMS=cpu`` keeps JAX from initialising the plugin as a backend
(it would look for a GPU and print why it found none); the topology loads
the plugin by itself.

What is counted (:func:`census`): every instruction of the entry
computation that launches work on the GPU (a fusion, a custom call such as
a cuBLAS GEMM, a copy, an unfused operation), and a while loop's body and
condition once per iteration where XLA knows the trip count (a scan over
layers). Parameters, constants, tuples, bitcasts and get-tuple-elements
launch nothing. Not counted: what the runtime does with them (XLA:GPU may
capture runs of kernels into CUDA graphs at execution), and autotuning,
which needs the device: without it XLA makes Triton GEMM fusions, where
the autotuned H200 program had cuBLAS(Lt) calls (a ``__cublas$lt$matmul$f8``
for every float8 dot), so ``--gemm cublas`` (the default) turns Triton
GEMMs off, as there, and ``--gemm xla`` keeps XLA's choice.
"GEMMs" are the library calls that do a matmul's work: cuBLAS(Lt)
GEMMs, Triton GEMM fusions, and cuDNN's fused attention. ``bytes`` is
each non-GEMM kernel's operands and results added up, of a stacked buffer
only the slices that dynamic slices and gathers inside the kernel read,
and of an in-place update only the update (a scan's stacked inputs and
residuals): the memory traffic, about, of everything but the GEMMs, at
4.8 TB/s on an H200 1 ms per 4.8 GB; an estimate, since caches and other
partial reads (a broadcast, a slice) are not modelled. cuDNN's
attention needs its library to compile (``pip install
"nvidia-cudnn-cu13>=9.8,<10"``, which ``jax[cuda13]`` brings and
``jax[cuda13-local]`` does not): without it those variants say so in
place of their counts.

Kernel counts are deterministic for one jax version and target; times
are not measured here (``gpu.sh`` measures them on a GPU).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import importlib.util
import math
import pathlib
import re
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = pathlib.Path(__file__).resolve().parent
SPECS = HERE / "gpu_specs"
# A GPU's description, or "attached": this machine's first GPU, whose
# compile autotunes (on the GPU machine, to check the census against).
TARGETS = (*sorted(p.stem for p in SPECS.glob("*.txtpb")), "attached")


def _sibling(name: str) -> Any:
    """A module of this folder (``benchmarks/`` is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- the compile-only GPU ---------------------------------------------------


def _install_hint() -> str:
    return (
        'pip install "jax[cuda13-local]=='
        f'{jax.__version__}" (the CUDA plugin of this jaxlib; no GPU needed)'
    )


@functools.cache
def _devices(target: str) -> tuple[Any, ...]:
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: expected one of {TARGETS}")
    if target == "attached":
        try:
            return (jax.devices("gpu")[0],)
        except RuntimeError as err:
            raise RuntimeError(f"no GPU attached here ({err})") from err
    from jax.experimental import topologies

    config = (SPECS / f"{target}.txtpb").read_text()
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology="1x1x1"
        )
    except Exception as err:  # no plugin: a RuntimeError or a KeyError
        raise RuntimeError(
            f"cannot compile for a CUDA GPU here ({type(err).__name__}: "
            f"{err}); {_install_hint()}"
        ) from err
    return tuple(topology.devices)


def unavailable(target: str = "h200") -> str | None:
    """Why this machine cannot compile for ``target`` (None if it can)."""
    try:
        _devices(target)
    except RuntimeError as err:
        return str(err)
    return None


def device_kind(target: str = "h200") -> str:
    return _devices(target)[0].device_kind


# XLA without the device cannot autotune, so it takes its default GEMM
# backend: Triton GEMM fusions (float8 ones too). On the H200 the autotuned
# program had cuBLASLt GEMMs (``__cublas$lt$matmul$f8`` for every float8
# dot, benchmarks/RESULTS-gpu-float8.md); with Triton GEMMs off XLA
# rewrites every dot into cuBLAS(Lt) calls, as there.
CUBLAS = {"xla_gpu_enable_triton_gemm": False}


def compile_hlo(
    fn: Any,
    *args: Any,
    target: str = "h200",
    donate_argnums: Any = (),
    compiler_options: dict[str, Any] | None = None,
) -> tuple[str, Any]:
    """``jax.jit(fn)`` compiled for ``target`` with arguments shaped like
    ``args`` (arrays or ``ShapeDtypeStruct``s): its optimized HLO text and
    the compiled object (``memory_analysis`` works on it; it cannot run).

    The arguments are flattened to arrays before lowering, so that a state
    whose pytree class rejects abstract leaves (jmp's loss scales) lowers
    too; ``donate_argnums`` indexes ``args``, as for ``jax.jit``;
    ``compiler_options`` are XLA's (:data:`CUBLAS`, say).
    """
    (device,) = _devices(target)
    mesh = jax.sharding.Mesh(np.asarray([device]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    donate = (
        (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
    )
    flat, treedefs, positions = [], [], []
    for i, arg in enumerate(args):
        leaves, treedef = jax.tree.flatten(arg)
        treedefs.append(treedef)
        if i in donate:
            positions.extend(range(len(flat), len(flat) + len(leaves)))
        flat.extend(leaves)
    sizes = [t.num_leaves for t in treedefs]

    def flat_fn(*leaves: Any) -> Any:
        rebuilt, start = [], 0
        for treedef, size in zip(treedefs, sizes, strict=True):
            rebuilt.append(
                jax.tree.unflatten(treedef, leaves[start : start + size])
            )
            start += size
        return fn(*rebuilt)

    abstract = [
        jax.ShapeDtypeStruct(
            jnp.shape(x), jnp.result_type(x), sharding=sharding
        )
        for x in flat
    ]
    # Traced under the GPU's one-device mesh, as on a machine with one GPU:
    # with no mesh in context, a host of several devices (the tests' eight
    # simulated CPUs) would hide the arguments' sharding from the trace.
    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    with set_mesh(mesh):
        lowered = jax.jit(flat_fn, donate_argnums=tuple(positions)).lower(
            *abstract
        )
    compiled = lowered.compile(compiler_options=compiler_options)
    return compiled.as_text() or "", compiled


# --- the census -------------------------------------------------------------

# Instructions that launch nothing on the GPU.
_FREE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "after-all",
        "opt-barrier",
        "partition-id",
        # The second half of an asynchronous pair: its -start launched it.
        "fusion-done",
        "copy-done",
        "all-gather-done",
        "all-reduce-done",
        "collective-permute-done",
        "async-done",
        "send-done",
        "recv-done",
        "replica-id",
    }
)
_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1, "s4": 1, "u4": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
    "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TRUE = re.compile(r"\btrue_computation=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r"\bkind=(\w+)")
_BACKEND_KIND = re.compile(r'"kind":"([^"]+)"')
_OP_NAME = re.compile(r'op_name="(?:[^"]*/)?([^"/]+)"')


def _type_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _BYTES.get(dtype, 4)
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """``(type, remainder)`` of an instruction's right-hand side."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :]
    head, _, tail = rest.partition(" ")
    return head, tail


class _Instruction(NamedTuple):
    name: str
    type: str
    op: str
    operands: tuple[str, ...]
    line: str


def _computations(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
    comps: dict[str, list[_Instruction]] = {}
    current, entry = None, ""
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            lhs, rest = line.split(" = ", 1)
            name = lhs.strip().removeprefix("ROOT ").strip().lstrip("%")
            typ, rest = _split_type(rest)
            op, _, args = rest.strip().partition("(")
            depth, end = 1, len(args)
            for i, ch in enumerate(args):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    end = i
                    break
            operands = tuple(re.findall(r"%([\w.\-]+)", args[:end]))
            comps[current].append(_Instruction(name, typ, op, operands, line))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _kind(inst: _Instruction, comps: dict[str, list[_Instruction]]) -> str:
    if inst.op in ("fusion", "fusion-start"):  # -start: an async fusion
        called = re.search(r"calls=%([\w.\-]+)", inst.line)
        inner = [
            i
            for i in comps.get(called.group(1) if called else "", [])
            if i.op == "custom-call"
        ]
        if len(inner) == 1:
            # A library call inside a fusion: a GEMM on a dynamic slice
            # of a scan's stacked weights (XLA's dynamic-slice fusion).
            return _kind(inner[0], comps)
        kind = _FUSION_KIND.search(inst.line)
        label = f"fusion:{kind.group(1) if kind else '?'}"
        backend = _BACKEND_KIND.search(inst.line)
        if label == "fusion:kCustom" and backend:
            label += f":{backend.group(1)}"
        return label
    if inst.op == "custom-call":
        target = _TARGET.search(inst.line)
        return f"custom-call:{target.group(1) if target else '?'}"
    return inst.op


def is_gemm(kind: str) -> bool:
    """Whether a census kind is a matrix multiplication's kernel."""
    return (
        kind.startswith("custom-call:__cublas")
        or kind.startswith("custom-call:__cudnn")
        or (kind.startswith("fusion:kCustom:") and "gemm" in kind)
        or kind.endswith(":__cudnn$fusion")
        or kind == "dot"
    )


@dataclasses.dataclass
class Census:
    """The kernels of one compiled program, per step.

    Attributes:
        kinds: kernels launched per step, by kind (``fusion:kLoop``,
            ``fusion:kInput`` (a reduction), ``custom-call:<target>``,
            ``copy``, ...); a while loop's kernels times its trip count.
        static: kernels in the program text (a loop body once).
        bytes: operand and result bytes of the non-GEMM kernels per step.
        loops: the trip counts of the while loops (an unknown one as 1).
        sources: ``bytes`` by the JAX operation a kernel's root came from
            (the last part of its ``op_name``: ``exp``,
            ``lossscale_float8_quantize``, ``dynamic_update_slice``, ...).
        flops: the cuBLAS(Lt) GEMMs' floating-point operations per step
            (two per multiply-add), by operand dtype (``bf16``, ``f8``).
    """

    kinds: collections.Counter
    static: int
    bytes: int
    loops: list[int]
    sources: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )
    flops: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    @property
    def gemms(self) -> int:
        return sum(n for k, n in self.kinds.items() if is_gemm(k))

    @property
    def fp8_gemms(self) -> int:
        return self.kinds.get("custom-call:__cublas$lt$matmul$f8", 0)

    @property
    def reductions(self) -> int:
        return self.kinds.get("fusion:kInput", 0)

    @property
    def others(self) -> int:
        """Kernels that are neither GEMMs nor reductions."""
        return self.total - self.gemms - self.reductions


def _result_type(inst: _Instruction) -> str:
    """An instruction's result type; an async ``fusion-start``'s is the
    middle of its ``((operands), result, context)``."""
    if inst.op != "fusion-start":
        return inst.type
    rest = _split_type(inst.type[1:])[1].lstrip(", ")
    return _split_type(rest)[0].rstrip(",")


def _read(
    name: str, full: int, body: list[_Instruction], types: dict[str, str]
) -> int:
    """The bytes a fused computation reads of its value ``name`` (``full``
    bytes): only the slices that dynamic slices and gathers take of it,
    nothing of the buffer a dynamic update writes into in place (a scan's
    stacked inputs and residuals, one slice an iteration), else all."""
    total = 0
    for user in body:
        for position, operand in enumerate(user.operands):
            if operand != name:
                continue
            if user.op == "bitcast":
                total += _read(user.name, full, body, types)
            elif user.op in ("dynamic-slice", "gather") and position == 0:
                total += _type_bytes(user.type)
            elif user.op == "dynamic-update-slice" and position == 0:
                pass  # written in place: the update is counted as written
            else:
                return full
    return min(total, full)


def _written(
    name: str, comps: dict[str, list[_Instruction]], body: list[_Instruction]
) -> int:
    """The bytes a fused computation writes of its value ``name``: of a
    dynamic update, the update; of a tuple, each element's."""
    inst = next(i for i in body if i.name == name)
    types = {i.name: i.type for i in body}
    if inst.op == "tuple":
        return sum(_written(o, comps, body) for o in inst.operands)
    if inst.op == "bitcast":
        return _written(inst.operands[0], comps, body)
    if inst.op == "dynamic-update-slice":
        return _type_bytes(types.get(inst.operands[1], ""))
    return _type_bytes(inst.type)


def _moved(
    inst: _Instruction,
    types: dict[str, str],
    comps: dict[str, list[_Instruction]] | None = None,
) -> int:
    """The bytes a kernel reads and writes: its operands and results, but
    of a buffer only the slices read by a dynamic slice or a gather inside
    it, and of a dynamic update only the update written in place."""
    comps = comps or {}
    operands = [types.get(o, "") for o in inst.operands]
    result = _result_type(inst)
    if inst.op == "dynamic-update-slice":
        return 2 * _type_bytes(operands[1])
    if inst.op in ("dynamic-slice", "gather"):
        return 2 * _type_bytes(result) + sum(map(_type_bytes, operands[1:]))
    if inst.op == "scatter":  # reads and writes the updated elements
        return 3 * _type_bytes(operands[-1]) + _type_bytes(operands[1])
    called = re.search(r"calls=%([\w.\-]+)", inst.line)
    body = comps.get(called.group(1), []) if called else []
    if inst.op not in ("fusion", "fusion-start") or not body:
        return _type_bytes(result) + sum(map(_type_bytes, operands))
    body_types = {i.name: i.type for i in body}
    params = {
        int(m.group(1)): i.name
        for i in body
        if i.op == "parameter"
        and (m := re.search(r"parameter\((\d+)\)", i.line))
    }
    read = sum(
        _read(params[k], _type_bytes(t), body, body_types)
        for k, t in enumerate(operands)
        if k in params
    )
    root = next((i for i in body if i.line.lstrip().startswith("ROOT ")), None)
    written = _written(root.name, comps, body) if root else _type_bytes(result)
    return read + written


_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _gemm_flops(
    inst: _Instruction, comps: dict[str, list[_Instruction]], types: dict
) -> tuple[str, int] | None:
    """``(operand dtype, flops)`` of a cuBLAS(Lt) call, or of the one a
    fusion wraps; None for anything else."""
    if inst.op != "custom-call":
        called = re.search(r"calls=%([\w.\-]+)", inst.line)
        inner = [
            i
            for i in comps.get(called.group(1) if called else "", [])
            if i.op == "custom-call"
        ]
        if len(inner) != 1 or not called:
            return None
        types = {i.name: i.type for i in comps[called.group(1)]}
        inst = inner[0]
    target = _TARGET.search(inst.line)
    contracting = _CONTRACTING.search(inst.line)
    if not (target and contracting and "__cublas" in target.group(1)):
        return None
    out = _ARRAY.findall(inst.type)
    lhs = _ARRAY.findall(types.get(inst.operands[0], ""))
    if not out or not lhs:
        return None
    lhs_dims = [int(d) for d in lhs[0][1].split(",") if d]
    k = math.prod(
        lhs_dims[int(d.strip('" '))] for d in contracting.group(1).split(",")
        if d.strip('" ')
    )  # fmt: skip
    n = math.prod(int(d) for d in out[0][1].split(",") if d)
    dtype = "f8" if lhs[0][0].startswith("f8") else lhs[0][0]
    return dtype, 2 * n * k


def census(hlo: str) -> Census:
    """Counts the kernels of an optimized HLO module's text (see above)."""
    comps, entry = _computations(hlo)
    kinds: collections.Counter = collections.Counter()
    sources: collections.Counter = collections.Counter()
    flops: collections.Counter = collections.Counter()
    static, nbytes, loops = 0, 0, []

    def walk(name: str, times: int) -> None:
        nonlocal static, nbytes
        types = {inst.name: inst.type for inst in comps[name]}
        for inst in comps[name]:
            if inst.op in _FREE:
                continue
            if inst.op in ("while", "conditional", "call"):
                trip = _TRIP.search(inst.line)
                n = int(trip.group(1)) if trip and inst.op == "while" else 1
                if inst.op == "while":
                    loops.append(n)
                body = re.search(r"\bbody=%([\w.\-]+)", inst.line)
                condition = re.search(r"\bcondition=%([\w.\-]+)", inst.line)
                if condition and condition.group(1) in comps:
                    # A loop's condition runs once more than its body.
                    walk(condition.group(1), times * (n + 1))
                called = [body.group(1)] if body else []
                branches = _BRANCHES.search(inst.line)
                # A conditional runs one branch: count the first (of a
                # boolean one, the true branch).
                if branches:
                    called.append(branches.group(1).split(",")[0].strip(" %"))
                called += _TRUE.findall(inst.line)
                if inst.op == "call":
                    called += re.findall(r"to_apply=%([\w.\-]+)", inst.line)
                for sub in called:
                    if sub in comps:
                        walk(sub, times * n)
                if inst.op == "conditional":
                    kinds["conditional"] += times
                    static += 1
                continue
            kind = _kind(inst, comps)
            kinds[kind] += times
            static += 1
            if not is_gemm(kind):
                moved = _moved(inst, types, comps) * times
                nbytes += moved
                source = _OP_NAME.search(inst.line)
                sources[source.group(1) if source else "?"] += moved
            else:
                found = _gemm_flops(inst, comps, types)
                if found:
                    flops[found[0]] += found[1] * times

    walk(entry, 1)
    return Census(kinds, static, nbytes, loops, sources, flops)


# --- what is compiled -------------------------------------------------------


def optimizer_census(
    n_params: int,
    leaves: int,
    target: str,
    variants: Any = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Census]:
    """The optimizer-only variants of ``step_overhead.py`` (all, or those
    named in ``variants``): adam, float32, the gradients scaled by 2**10,
    params and state donated."""
    so = _sibling("step_overhead")
    inner = optax.adam(1e-3)
    params = so.make_params(n_params, leaves)
    grads = jax.tree.map(lambda p: p * 2.0**10, params)
    out = {}
    for name, make in so.OPTIMIZER_VARIANTS.items():
        if variants is None or name in variants:
            init, step = make(inner)
            args = (params, init(params), grads)
            out[name] = _donated_census(step, args, target, options)
    return out


def mlp_census(
    width: int,
    depth: int,
    batch: int,
    target: str,
    options: dict[str, Any] | None = None,
) -> dict[str, Census]:
    """The float16 MLP's full train step (``step_overhead.mlp_steps``):
    the loss scaled by hand, and lossscale's."""
    params, steps = _sibling("step_overhead").mlp_steps(width, depth, batch)
    return {
        name: _donated_census(step, (params, init(params)), target, options)
        for name, (step, init) in steps.items()
        if name in ("plain optax, loss scaled by hand", "lossscale")
    }


def _donated_census(
    step: Any, args: tuple, target: str, options: dict[str, Any] | None
) -> Census:
    """The census of ``step(*args)`` compiled with its params and state
    (the first two arguments) donated, as a train loop would."""
    hlo, _ = compile_hlo(
        step,
        *args,
        target=target,
        donate_argnums=(0, 1),
        compiler_options=options,
    )
    return census(hlo)


def autocast_census(
    config: Any,
    target: str,
    remat: str | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, tuple[Census, float, float] | str]:
    """The demo GPT's train step (``float8.py``'s variants, and
    :data:`OTHERS`): the census, the temporary memory (MB) and the compile
    time (s) of each; for a variant with cuDNN's attention that does not
    compile here (its library, ``nvidia-cudnn``, is missing), why."""
    bench = _sibling("float8")
    config = dataclasses.replace(config, remat=remat)
    out: dict[str, tuple[Census, float, float] | str] = {}
    variants = {name: {} for name in bench.VARIANTS} | OTHERS
    for name, kwargs in variants.items():
        reference = (
            name.split(",")[0] if name.startswith("float8") else bench.REFERENCE
        )
        start = time.perf_counter()
        try:
            step, args, _ = bench.build(reference, config, **kwargs)
            hlo, compiled = compile_hlo(
                step, *args, target=target, compiler_options=options
            )
        except Exception as err:  # cuDNN's library missing, say
            if "attention" not in kwargs:
                raise
            # One line: the cell of a markdown table.
            why = " ".join(str(err).split())
            out[name] = f"{type(err).__name__}: {why[:160]}"
            continue
        seconds = time.perf_counter() - start
        temp = compiled.memory_analysis().temp_size_in_bytes / 1e6
        out[name] = (census(hlo), temp, seconds)
    return out


def cudnn_attention(q: Any, k: Any, v: Any) -> Any:
    """Causal attention by cuDNN's flash attention (its forward and
    backward kernels), on q, k and v rounded to bfloat16, as the kernel
    takes them (autocast keeps the call as it is)."""
    dtype = jnp.bfloat16
    out = jax.nn.dot_product_attention(
        q.astype(dtype),
        k.astype(dtype),
        v.astype(dtype),
        is_causal=True,
        implementation="cudnn",
    )
    return out.astype(q.dtype)


# Beside float8.py's variants: the bfloat16 and the per-tensor float8
# autocast steps with cuDNN's attention, and the model cast by hand
# (flax's dtype=, its scores and logits float32, as before autocast), with
# either attention: what the autocast step is measured against (issue 50
# item 4).
OTHERS = {
    "autocast bfloat16, cuDNN attention": dict(attention=cudnn_attention),
    "float8 tensorwise, cuDNN attention": dict(attention=cudnn_attention),
    "hand-cast bfloat16": dict(hand_cast=jnp.bfloat16),
    "hand-cast bfloat16, cuDNN attention": dict(
        hand_cast=jnp.bfloat16, attention=cudnn_attention
    ),
}


# --- the report -------------------------------------------------------------


def _kinds_cell(c: Census) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(c.kinds.items()))


def _added_table(rows: dict[str, Census], base: str, title: str) -> list[str]:
    lines = [
        f"### {title}",
        "",
        f"| variant | kernels | added to {base} | reductions | copies | "
        "bytes moved, MB |",
        "|---|---|---|---|---|---|",
    ]
    ref = rows[base].total
    for name, c in rows.items():
        lines.append(
            f"| {name} | {c.total} | {c.total - ref:+d} | {c.reductions} "
            f"| {c.kinds.get('copy', 0)} | {c.bytes / 1e6:.1f} |"
        )
    return [*lines, ""]


def _header(args: argparse.Namespace) -> str:
    import flax

    import lossscale

    if args.target == "attached":
        where = (
            f"this machine's {device_kind(args.target)}, autotuned, by "
            "`python benchmarks/gpu_hlo.py --target attached"
        )
    else:
        where = (
            f"{device_kind(args.target)} (`benchmarks/gpu_specs/"
            f"{args.target}.txtpb`) on a CPU machine, without autotuning "
            "(it needs the GPU), by `python benchmarks/gpu_hlo.py"
        )
    default = "xla" if args.target == "attached" else "cublas"
    sections = (
        "" if args.sections == SECTIONS else f" --sections {args.sections}"
    )
    flags = (
        (" --quick" if args.quick else "")
        + sections
        + ("" if args.gemm == default else f" --gemm {args.gemm}")
    )
    gemms = (
        "GEMMs are cuBLAS(Lt) calls (Triton GEMM fusions off), as the "
        "autotuned H200 program had them."
        if args.gemm == "cublas"
        else "GEMMs are XLA's choice."
    )
    return (
        f"Compiled {datetime.date.today()} for {where}{flags}`: jax "
        f"{jax.__version__} with its CUDA plugin, optax {optax.__version__}, "
        f"flax {flax.__version__}, lossscale {lossscale.__version__}. "
        "Kernels launched per step, counted in XLA's optimized GPU module "
        f"(`benchmarks/gpu_hlo.py`'s docstring says what counts). {gemms} "
        "Bytes are each non-GEMM kernel's operands and results added up "
        "(an estimate: caches and partial reads are not modelled). "
        "Deterministic: counts, not times."
    )


SECTIONS = "optimizer,leaves,mlp,autocast"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--target", default="h200", choices=TARGETS)
    parser.add_argument(
        "--sections", default=SECTIONS,
        help="comma-separated: optimizer, leaves, mlp, autocast",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument(
        "--gemm",
        default=None,
        choices=("cublas", "xla"),
        help="cublas (the default without a GPU): Triton GEMM fusions off, "
        "as the autotuned H200 program had them (CUBLAS); xla (the default "
        "for --target attached): XLA's own choice",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    why = unavailable(args.target)
    if why:
        raise SystemExit(why)
    sections = args.sections.split(",")
    if args.gemm is None:
        args.gemm = "xla" if args.target == "attached" else "cublas"
    options = CUBLAS if args.gemm == "cublas" else None
    lines = [
        "# GPU kernels"
        + ("" if args.target == "attached" else ", compiled without a GPU"),
        "",
        _header(args),
        "",
    ]
    sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000, 20_000_000]

    def written() -> None:
        # After each section, so that a run stopped by a time limit (as
        # gpu.sh's parts are) leaves the sections it finished.
        if args.out:
            pathlib.Path(args.out).write_text("\n".join(lines))

    if "optimizer" in sections:
        lines += ["## Optimizer-only step (adam, float32, 40 leaves)", ""]
        for n in sizes:
            rows = optimizer_census(n, 40, args.target, options=options)
            lines += _added_table(
                rows, "plain optax", f"{n // 10**6}M parameters"
            )
    written()
    if "leaves" in sections:
        counts = (4, 40) if args.quick else (4, 40, 160)
        lines += [
            "## Kernels added to plain optax, by leaf count (1M parameters)",
            "",
            "| variant | " + " | ".join(f"{n} leaves" for n in counts) + " |",
            "|---|" + "---|" * len(counts),
        ]
        by_leaves = {
            n: optimizer_census(1_000_000, n, args.target, options=options)
            for n in counts
        }
        for name in by_leaves[counts[0]]:
            cells = [
                f"{rows[name].total - rows['plain optax'].total:+d}"
                for rows in (by_leaves[n] for n in counts)
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    written()
    if "mlp" in sections:
        width, depth, batch = (256, 2, 64) if args.quick else (1024, 4, 256)
        rows = mlp_census(width, depth, batch, args.target, options)
        base = "plain optax, loss scaled by hand"
        lines += _added_table(
            rows, base,
            f"Full train step: float16 MLP, width {width}, depth {depth}, "
            f"batch {batch}",
        )  # fmt: skip
    written()
    if "autocast" in sections:
        gpt = _sibling("float8").gpt
        config = (
            gpt.Config(layers=2, width=128, heads=4, context=64, batch=2)
            if args.quick
            else gpt.Config(
                layers=12, width=1024, heads=16, context=1024, batch=8
            )
        )
        policies = (
            [None] if args.quick else [None, "dots_with_no_batch_dims_saveable"]
        )
        for remat in policies:
            found = autocast_census(config, args.target, remat, options)
            failed = {k: v for k, v in found.items() if isinstance(v, str)}
            rows = {k: v for k, v in found.items() if not isinstance(v, str)}
            lines += [
                f"## The demo GPT's train step: layers {config.layers}, width "
                f"{config.width}, heads {config.heads}, batch {config.batch} "
                f"x {config.context}, remat {remat or 'none'}",
                "",
                "Per step (the scanned layers' body times its trip count "
                f"{sorted(set(rows[next(iter(rows))][0].loops)) or '-'}).",
                "",
                "| variant | kernels | GEMMs | float8 GEMMs | reductions | "
                "other kernels | non-GEMM bytes, MB | cuBLAS TFLOP (float8) "
                "| temp MB | compile s |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for name, (c, temp, seconds) in rows.items():
                lines.append(
                    f"| {name} | {c.total} | {c.gemms} | {c.fp8_gemms} | "
                    f"{c.reductions} | {c.others} | {c.bytes / 1e6:.0f} | "
                    f"{sum(c.flops.values()) / 1e12:.3g} "
                    f"({c.flops.get('f8', 0) / 1e12:.3g}) | "
                    f"{temp:.0f} | {seconds:.1f} |"
                )
            lines += [f"| {name} | not compiled here: {why} |" for name, why
                      in failed.items()]  # fmt: skip
            lines += [
                "",
                "Where the non-GEMM bytes go (GB per step, by the JAX "
                "operation of each kernel's root; the largest six):",
                "",
            ]
            for name, (c, _, _) in rows.items():
                top = ", ".join(
                    f"`{op}` {moved / 1e9:.2f}"
                    for op, moved in c.sources.most_common(6)
                )
                lines.append(f"- {name}: {top}")
            lines.append("")
    written()
    report = "\n".join(lines)
    print(report)
    if args.out:
        pathlib.Path(args.out).write_text(report)
    return report


if __name__ == "__main__":
    main()
