"""What loss scaling costs per step: lossscale against plain optax and peers.

Usage::

    python benchmarks/step_overhead.py          # full suite -> RESULTS.md
    python benchmarks/step_overhead.py --quick  # smoke test (CI), seconds

Everything runs in one process and is interleaved: each round times every
variant once (best of a few calls), and the reported number is the median
over rounds of the per-round ratio to plain optax, which cancels most of the
machine's drift. Steps are jitted with donated parameter and optimizer-state
buffers. Peak memory is XLA's own buffer analysis of the compiled step
(arguments + outputs + temporaries - aliased), which is exact, not timed.

The peers are reproduced at equal function (scale the loss, unscale, check,
skip parameters *and* optimizer state on overflow, adapt the scale):

- ``jmp``: ``unscale`` -> ``jmp.all_finite`` -> ``adjust`` ->
  ``jmp.select_tree`` over (params, opt_state), as in dm-haiku's ImageNet
  example;
- ``flax``: flax's ``DynamicScale`` recipe from its ImageNet example
  (gradients cast to float32 and divided by the scale, finiteness, then
  ``jnp.where`` over params and opt_state);
- ``optax_aif``: ``optax.apply_if_finite`` with manual unscaling and a
  scale that backs off on overflow.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import pathlib
import platform
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale
from lossscale import _transform

HERE = pathlib.Path(__file__).resolve().parent
LEAVES = 40


def _load(name: str):
    """A module of this folder (run as a script or loaded by the tests)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


transformer = _load("transformer")


def make_params(n_params: int, leaves: int = LEAVES, dtype=jnp.float32):
    size = n_params // leaves
    key = jax.random.key(0)
    return {
        f"layer{i:03d}": jax.random.normal(
            jax.random.fold_in(key, i), (size,), dtype
        )
        * 0.01
        for i in range(leaves)
    }


# --- optimizer-only steps: (params, state, scaled_grads) -> (params, state) -


def plain_step(inner):
    def init(params):
        return inner.init(params)

    def step(params, state, grads):
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return init, step


def loss_scaled(inner, loss_scale, impl="select", **kwargs):
    """``lossscale.loss_scaled`` with the skip made by ``impl``, taking
    the step's gradients as given (they are inputs here, not marked)."""
    kwargs.setdefault("require_scaled_by", False)
    with _transform.skip_impl(impl):
        return lossscale.loss_scaled(inner, loss_scale, **kwargs)


def lossscale_step(inner, impl="select", **kwargs):
    tx = loss_scaled(inner, lossscale.DynamicLossScale(), impl, **kwargs)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx.init, step


def jmp_step(inner):
    import jmp

    def init(params):
        return (inner.init(params), jmp.DynamicLossScale(jnp.float32(2**16)))

    def step(params, state, grads):
        opt_state, ls = state
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        ls = ls.adjust(finite)
        updates, new_opt = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt), (params, opt_state)
        )
        return params, (opt_state, ls)

    return init, step


def flax_step(inner):
    from flax.training.dynamic_scale import DynamicScale

    def init(params):
        ds = DynamicScale(fin_steps=jnp.int32(0), scale=jnp.float32(2**16))
        return (inner.init(params), ds)

    def step(params, state, grads):
        opt_state, ds = state
        # DynamicScale.value_and_grad's post-processing, on given grads.
        grads = jax.tree.map(
            lambda g: jnp.asarray(g, jnp.float32) / ds.scale, grads
        )
        finite = jnp.array(True)
        for g in jax.tree.leaves(grads):
            finite &= jnp.all(jax.lax.is_finite(g))
        grow = ds.fin_steps == ds.growth_interval
        fin_scale = jnp.where(
            grow & finite,
            jnp.minimum(
                ds.scale * ds.growth_factor, jnp.finfo(jnp.float32).max
            ),
            ds.scale,
        )
        inf_scale = jnp.maximum(ds.scale * ds.backoff_factor, ds.minimum_scale)
        ds = ds.replace(
            scale=jnp.where(finite, fin_scale, inf_scale),
            fin_steps=jnp.where(grow | ~finite, 0, ds.fin_steps + 1),
        )
        updates, new_opt = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        opt_state = jax.tree.map(
            functools.partial(jnp.where, finite), new_opt, opt_state
        )
        params = jax.tree.map(
            functools.partial(jnp.where, finite), new_params, params
        )
        return params, (opt_state, ds)

    return init, step


def optax_aif_step(inner):
    tx = optax.apply_if_finite(inner, max_consecutive_errors=10**9)

    def init(params):
        return (tx.init(params), jnp.float32(2**16))

    def step(params, state, grads):
        opt_state, scale = state
        grads = jax.tree.map(lambda g: g / scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        scale = jnp.where(opt_state.last_finite, scale, scale / 2)
        return optax.apply_updates(params, updates), (opt_state, scale)

    return init, step


OPTIMIZER_VARIANTS = {
    "plain optax": plain_step,
    "lossscale": lossscale_step,
    "lossscale (cond)": functools.partial(lossscale_step, impl="cond"),
    "lossscale, report_nonfinite": functools.partial(
        lossscale_step, report_nonfinite=True
    ),
    "jmp": jmp_step,
    "flax DynamicScale": flax_step,
    "optax.apply_if_finite": optax_aif_step,
}


def interleaved(fns: dict, states: dict, args, rounds: int, calls: int):
    """Median over rounds of each variant's time ratio to the first one."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():  # compile and warm up
        states[name] = jax.block_until_ready(fn(*states[name], *args))
    for _ in range(rounds):
        for name, fn in fns.items():
            best = float("inf")
            for _ in range(calls):
                start = time.perf_counter()
                states[name] = jax.block_until_ready(fn(*states[name], *args))
                best = min(best, time.perf_counter() - start)
            times[name].append(best)
    base = np.asarray(times[next(iter(fns))])
    return {
        name: (
            statistics.median(t) * 1e3,
            float(np.median(np.asarray(t) / base)),
        )
        for name, t in times.items()
    }


def optimizer_only(n_params: int, *, overflow: bool, rounds: int, calls: int):
    inner = optax.adam(1e-3)
    params = make_params(n_params)
    grads = jax.tree.map(lambda p: p * 2.0**10, params)
    if overflow:
        first = next(iter(grads))
        grads[first] = grads[first].at[0].set(jnp.inf)
    fns, states = {}, {}
    for name, make in OPTIMIZER_VARIANTS.items():
        init, step = make(inner)
        p = jax.tree.map(jnp.copy, params)
        states[name] = (p, init(p))
        fns[name] = jax.jit(step, donate_argnums=(0, 1))
    return interleaved(fns, states, (grads,), rounds, calls)


# --- a full float16-compute train step -------------------------------------


def mlp_problem(width: int, depth: int, batch: int):
    key = jax.random.key(0)
    params = [
        {
            "w": jax.random.normal(
                jax.random.fold_in(key, i), (width, width), jnp.float32
            )
            / np.sqrt(width),
            "b": jnp.zeros(width, jnp.float32),
        }
        for i in range(depth)
    ]
    x = jax.random.normal(jax.random.fold_in(key, 10_001), (batch, width))
    y = jax.random.normal(jax.random.fold_in(key, 10_002), (batch, width))

    def loss_fn(params):
        h = x.astype(jnp.float16)
        for layer in params:
            w, b = (
                layer["w"].astype(jnp.float16),
                layer["b"].astype(jnp.float16),
            )
            h = jax.nn.relu(h @ w + b)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    return params, loss_fn


def mlp_steps(width: int, depth: int, batch: int):
    """The float16 MLP's params and its full train steps, by name: each
    ``(step(params, opt_state) -> (params, opt_state), init)``."""
    params, loss_fn = mlp_problem(width, depth, batch)
    inner = optax.adam(1e-4)
    tx = lossscale.loss_scaled(inner, lossscale.DynamicLossScale(2.0**10))

    def by_hand(params, state):
        # The same loss scaling done by hand, with no check and no skip:
        # the baseline for what the wrapper adds (a step that does not
        # scale at all computes something else, so it is listed last).
        grads = jax.grad(lambda p: loss_fn(p) * 2.0**10)(params)
        grads = jax.tree.map(lambda g: g * 2.0**-10, grads)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def plain(params, state):
        grads = jax.grad(loss_fn)(params)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def wrapper(tx):
        def wrapped(params, state):
            scale = lossscale.get_loss_scale(state)
            grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)
            updates, state = tx.update(grads, state, params, scaled_by=scale)
            return optax.apply_updates(params, updates), state

        return wrapped, tx.init

    cond = loss_scaled(
        inner,
        lossscale.DynamicLossScale(2.0**10),
        "cond",
        require_scaled_by=True,
    )
    return params, {
        "plain optax, loss scaled by hand": (by_hand, inner.init),
        "lossscale": wrapper(tx),
        "lossscale (cond)": wrapper(cond),
        "plain optax, unscaled": (plain, inner.init),
    }


def full_step(width: int, depth: int, batch: int, rounds: int, calls: int):
    params, steps = mlp_steps(width, depth, batch)
    fns = {
        name: jax.jit(f, donate_argnums=(0, 1))
        for name, (f, _) in steps.items()
    }
    states = {
        name: (jax.tree.map(jnp.copy, params), init(params))
        for name, (_, init) in steps.items()
    }
    return interleaved(fns, states, (), rounds, calls)


# --- a transformer: whole train steps, compile time, kernels ----------------

SCALE = 2.0**10


def by_hand_step(inner):
    """Plain optax with the loss scaled by hand: the baseline train step."""

    def init(params):
        return inner.init(params)

    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g * (1 / SCALE), grads)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return init, step


def runtime_scale_step(inner):
    """Plain optax, the loss scaled by hand by a scale kept in the state.

    What any dynamic loss scaling pays before checking anything: the scale
    is a value, not a constant XLA can fold into the backward pass.
    """

    def init(params):
        return inner.init(params), jnp.float32(SCALE)

    def step(params, state, grads):
        inner_state, scale = state
        grads = jax.tree.map(lambda g: g * (1 / scale), grads)
        updates, inner_state = inner.update(grads, inner_state, params)
        return optax.apply_updates(params, updates), (inner_state, scale)

    return init, step


# The scale each variant's state asks the next forward pass for.
SCALE_OF = {
    "plain optax, loss scaled by hand": lambda state: SCALE,
    "plain optax, scale in the state": lambda state: state[1],
    "lossscale": lambda state: lossscale.get_loss_scale(state).loss_scale,
    "lossscale (cond)": lambda s: lossscale.get_loss_scale(s).loss_scale,
    "lossscale, report_nonfinite": lambda s: (
        lossscale.get_loss_scale(s).loss_scale
    ),
    "jmp": lambda state: state[1].loss_scale,
    "flax DynamicScale": lambda state: state[1].scale,
    "optax.apply_if_finite": lambda state: state[1],
}
TRAIN_VARIANTS = {
    "plain optax, loss scaled by hand": by_hand_step,
    "plain optax, scale in the state": runtime_scale_step,
    **{k: v for k, v in OPTIMIZER_VARIANTS.items() if k != "plain optax"},
}


def train_steps(make_inner, loss_fn, names=None):
    """Whole train steps (scaled loss, grad, update) for each variant."""
    steps = {}
    for name in names or TRAIN_VARIANTS:
        init, opt_step = TRAIN_VARIANTS[name](make_inner())
        scale_of = SCALE_OF[name]

        def step(params, state, batch, opt_step=opt_step, scale_of=scale_of):
            scale = scale_of(state)
            grads = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
            return opt_step(params, state, grads)

        steps[name] = (init, step)
    return steps


def adamw():
    return optax.adamw(1e-3, weight_decay=0.1)


def clipped_adamw():
    return optax.chain(optax.clip_by_global_norm(1.0), adamw())


def transformer_compile(layers: int, *, scan: bool, clip: bool, rounds: int):
    """Trace, then lower and compile a whole transformer train step."""
    params = transformer.init(jax.random.key(0), layers, scan=scan)
    batch = transformer.batch()
    loss_fn = functools.partial(transformer.loss_fn, scan=scan)
    # jmp's DynamicLossScale cannot be lowered ahead of time (see
    # peak_memory), which is how compile time is split from tracing here.
    names = [name for name in TRAIN_VARIANTS if name != "jmp"]
    steps = train_steps(clipped_adamw if clip else adamw, loss_fn, names)
    return compile_times(steps, params, batch, rounds, donate=True)


def compile_times(steps: dict, params, data, rounds: int, *, donate=False):
    """Trace, then lower and compile each ``step(params, state, data)``.

    Caches are cleared before each, so every round compiles from scratch.
    """
    donate_argnums = (0, 1) if donate else ()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (init, step) in steps.items():
            state = init(params)
            jax.clear_caches()
            start = time.perf_counter()
            traced = jax.jit(step, donate_argnums=donate_argnums).trace(
                params, state, data
            )
            middle = time.perf_counter()
            traced.lower().compile()
            times[name].append((middle - start, time.perf_counter() - middle))
    return split_times(times)


def split_times(times: dict) -> dict:
    """Median trace, compile and total time; median ratio of the totals."""
    base = np.asarray([t + c for t, c in next(iter(times.values()))])
    return {
        name: (
            statistics.median(t for t, _ in parts) * 1e3,
            statistics.median(c for _, c in parts) * 1e3,
            statistics.median(t + c for t, c in parts) * 1e3,
            float(np.median(np.asarray([t + c for t, c in parts]) / base)),
        )
        for name, parts in times.items()
    }


def transformer_step_time(layers: int, *, scan: bool, rounds: int, calls: int):
    params = transformer.init(jax.random.key(0), layers, scan=scan)
    batch = transformer.batch()
    loss_fn = functools.partial(transformer.loss_fn, scan=scan)
    steps = train_steps(adamw, loss_fn)
    fns, states = {}, {}
    for name, (init, step) in steps.items():
        fns[name] = jax.jit(step, donate_argnums=(0, 1))
        states[name] = (jax.tree.map(jnp.copy, params), init(params))
    return interleaved(fns, states, (batch,), rounds, calls)


def kernels(compiled) -> int:
    """The fusions (kernels) in a compiled program, counted in its HLO.

    Every fusion instruction, whatever its result type (a variadic
    reduction's is a tuple).
    """
    return len(re.findall(r" fusion\(.*calls=", compiled.as_text()))


def transformer_kernels(layer_counts, *, scan: bool):
    """Kernels of plain optax's step, and those lossscale adds to it."""
    names = ["plain optax, loss scaled by hand", "lossscale"]
    rows = {}
    for clip in (False, True):
        for layers in layer_counts:
            params = transformer.init(jax.random.key(0), layers, scan=scan)
            batch = transformer.batch()
            loss_fn = functools.partial(transformer.loss_fn, scan=scan)
            steps = train_steps(
                clipped_adamw if clip else adamw, loss_fn, names
            )
            counts = []
            for name in names:
                init, step = steps[name]
                compiled = (
                    jax.jit(step, donate_argnums=(0, 1))
                    .lower(params, init(params), batch)
                    .compile()
                )
                counts.append(kernels(compiled))
            leaves = len(jax.tree.leaves(params))
            label = f"{layers} layers, {leaves} leaves"
            label += ", clip_by_global_norm + adamw" if clip else ", adamw"
            rows[label] = (counts[0], counts[1], counts[1] - counts[0])
    return rows


def count_table(title: str, rows: dict) -> str:
    lines = [
        f"### {title}",
        "",
        "| step | plain optax | lossscale | added by lossscale |",
        "|---|---|---|---|",
    ]
    for name, (plain, ours, added) in rows.items():
        lines.append(f"| {name} | {plain} | {ours} | {added} |")
    return "\n".join(lines) + "\n"


# --- compile time and memory ------------------------------------------------


def check_only_step(inner):
    """Unscale and check, then plain ``inner``: loss scaling without a skip.

    Not a correct loss scaler (an overflow reaches the parameters); it is
    here to split the compile-time cost between the check and the skip.
    """

    def init(params):
        scale = lossscale.DynamicLossScale()
        return inner.init(params), scale, jnp.ones((), jnp.bool_)

    def step(params, state, grads):
        inner_state, scale, _ = state
        grads = scale.unscale(grads)
        finite = lossscale.all_finite(grads)
        updates, inner_state = inner.update(grads, inner_state, params)
        new_state = (inner_state, scale, finite)
        return optax.apply_updates(params, updates), new_state

    return init, step


def compile_time(leaves: int, rounds: int):
    """Trace, then lower and compile: median times and ratios to plain."""
    params = make_params(leaves * 64, leaves=leaves)
    grads = params
    variants = {
        "plain optax": plain_step(optax.adam(1e-3)),
        "lossscale": lossscale_step(optax.adam(1e-3)),
        "lossscale (cond)": lossscale_step(optax.adam(1e-3), "cond"),
        "unscale + all_finite, no skip": check_only_step(optax.adam(1e-3)),
    }
    return compile_times(variants, params, grads, rounds)


def peak_memory(n_params: int):
    params = make_params(n_params)
    grads = params
    out = {}
    for name, make in OPTIMIZER_VARIANTS.items():
        if name == "jmp":
            # jmp's DynamicLossScale cannot be lowered ahead of time: its
            # __post_init__ runs on JAX's abstract arguments and fails.
            continue
        init, step = make(optax.adam(1e-3))
        state = init(params)
        compiled = (
            jax.jit(step, donate_argnums=(0, 1))
            .lower(params, state, grads)
            .compile()
        )
        m = compiled.memory_analysis()
        peak = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
        out[name] = peak
    base = out["plain optax"]
    return {name: (peak / 2**20, peak / base) for name, peak in out.items()}


# --- report -----------------------------------------------------------------

OTHER_BACKEND = """## What was tried

What was tried, and why the numbers are what they are on a CPU, is in
`benchmarks/RESULTS.md`; its figures are a CPU's, not this machine's.
"""

NOTES = """## What was tried, and why the numbers are what they are

Measured on the CPU above (details in the git log).

- **The skip** is a branch-free select written so that XLA copies nothing
  (`lossscale/_skip.py`): the inner update is traced to a jaxpr and
  evaluated with every new state value replaced by `where(finite, new,
  old)` from the moment it is computed, so the updates read the *selected*
  state. XLA then writes the state in place first and reads it in the
  parameter update after, which stays fused into `optax.apply_updates`: no
  state copy, no updates buffer, no host round-trip for the predicate. The
  textbook select (`new if finite else old` after the update, as jmp's and
  flax's recipes do) makes XLA copy the state every step: most of those
  peers' cost above. `lax.cond` around the inner update (`lossscale
  (cond)`) copies no state, but its updates leave the conditional as a
  parameter-sized buffer instead of fusing into `apply_updates`.
- **The finiteness check.** `jnp.all(jnp.isfinite(g))` per leaf is what
  GPUs and TPUs get. On CPU XLA rewrites each such reduction into a
  windowed pre-reduction whose input it materialises: a byte per gradient
  element written and read back (a quarter of the gradients' size in
  temporaries). Variadic reductions (several operands at once) are left
  alone and fuse the `isfinite`: leaves of one shape and sharding share
  one, up to 16 at a time, and a leaf alone reduces `isfinite` and `isnan`
  together (two copies of one operand are merged back into a plain
  reduction). No temporary; fewer kernels than leaves. How many leaves
  per reduction: 4 large ones read fastest (20M parameters in 40 leaves:
  1.4 ms for the check, against 2.3 ms with 16 per reduction, 2.0 ms for
  the 0.1.0 tiles and 3.2 ms for a plain reduction per leaf); small ones
  (at most 4096 elements) go 16 at a time, for fewer kernels to compile.
  The 0.1.0 check (16 x 16 tiles, concatenated small leaves, optimization
  barriers) also avoided the temporary, but compiled slower (measured:
  +28% of plain's XLA time for the check alone, against +8% now) and
  could not run under explicit sharding (its reshapes split sharded axes).
- **Checking the scaled gradients.** Where the scale cannot go below 1
  (the default floor), the check reads the gradients as they arrive: a
  finite value divided by a scale of at least 1 cannot overflow. XLA then
  does not fuse the unscale multiply into every check kernel.
- **One global reduction** (a sum of squares, a max of |g|, a sum of
  `g * 0`, the form `clip_by_global_norm` computes) instead of a flag per
  leaf: XLA fuses the scalar chain that combines the per-leaf results into
  every consumer of the flag, one per state leaf and update, which made
  the transformer's compile 3.5x plain's. Combining per-leaf *flags* with
  one reduction over their stack avoids it.
- **Sharing `clip_by_global_norm`'s norm**, measured inside the wrapper
  (12-layer loop, clip + adamw, 3 rounds in one run): a per-leaf flag
  `isfinite(sum(u * u))` of the unscaled gradients `u`, the sums clipping
  computes too, lets XLA merge the two (13 kernels added instead of 27)
  but compiles no faster (1.13x plain optax, as the current check did in
  that run); `optax.tree.norm` of the unscaled gradients, clipping's own
  expression, adds only 8 kernels but compiles at 1.33x; and an
  optimization barrier on the flag, to keep its scalar chain out of the
  consumers, made XLA's compile 4.3x. Fewer kernels is not less compile
  time here, and a sum of squares can overflow where no gradient does
  (|g| > 1e19), so the check stays as it is.
- **Tracing.** The inner update is traced once, to a jaxpr, and its
  equations are bound again with the selects in place. Python's garbage
  collector, scanning the heap of a large train step's trace every few
  hundred allocations, took 0.1 s of the 0.16 s the wrapper added to the
  12-layer transformer's trace; `update` now defers it while it runs. What
  is left (about 0.06 s there) is the re-binding and the check.
- **Bookkeeping.** The loss scale's update and the wrapper's five counters
  are scalar operations, each its own small kernel on CPU; together about
  5% of the scanned transformer's compile. Packing the counters into one
  vector made more kernels (XLA slices each output back out), so they
  stay separate. Passing every scalar of the new state through one
  variadic reduction (each scalar stacked with its identity) did make them
  one kernel: 7 fewer kernels, but no faster under scan (1.14x against
  1.16x in that run) and 2.4x plain's compile for the loop of layers, where
  XLA copied the fused scalar chain into every consumer of the flag.
- **Where XLA's compile time goes** (`jax.profiler` trace of one compile,
  12-layer loop, lossscale against plain optax with the scale in the
  state). XLA's CPU backend compiles each distinct kernel on its own (about
  5 ms for a scalar one) and compiles identical ones once: the 12 layers'
  Adam kernels are compiled once, not 12 times. The skip's selects, fused
  into those kernels, add no kernel compile time; they add instructions
  (a parameter, a broadcast and a select per state leaf and update; the
  optimized HLO is 12% longer) to every HLO pass: the passes took about
  80 ms longer in the profiled compile.
  The check adds about 9 distinct kernels (its reductions and the one
  combining their flags), the bookkeeping about 7.
- **Transposed gradients.** Every weight matrix's gradient in this
  transformer arrives in transposed layout (the backward `dot` writes it
  that way and Adam reads it so, fused). XLA's CPU layout assignment gives
  a reduction's operands the default layout, and its `reduce(transpose(x))`
  simplification skips variadic reductions, so each check kernel
  transposes its operands before reducing them. Reading those gradients
  in their own layout (measured by checking `g.T` for the matrices known to
  be transposed here; not a fix, since the layout is XLA's choice, unknown
  when tracing) removed 36 transposes and left the compile time as it was.
- **Fewer flags to combine.** The flags of the leaves in one reduction,
  and-ed elementwise before reducing (two operands per reduction, so that
  XLA keeps it variadic), leave about 20 flags to combine instead of 102:
  no faster to compile with 4 or 16 leaves per reduction (1.16x against
  1.15x in that run), slower with 12 or 64 (1.22x).
- **Ordering the check before the update** (an optimization barrier on the
  flag and the gradients) changed neither the buffers nor the compile
  time.
- **The dynamic scale itself.** Loss scaled by hand with a constant (the
  baseline) lets XLA fold the scale into the backward pass; any dynamic
  loss scaling keeps it in the state as a value, which costs the compile
  (`plain optax, scale in the state`) before the wrapper adds anything.

In sum, on this CPU: the optimizer-only step at 20M parameters costs
about 1.14-1.16x plain optax (the check's read of the gradients), the
full float16 MLP step about 1.03x, the transformer's step within 1%, and
peak memory is plain optax's. The transformer's compile time is about
1.17-1.20x plain optax's for the loop of layers and 1.09-1.12x under
`lax.scan`, between runs. Keeping the scale in the state costs about 1.04x
on its own in the loop layout (1.04-1.15x between runs); the rest is the
skip (a select per state leaf and update, in kernels Adam already has) and
the check (fewer kernels than leaves, but each reads its gradients), about
half each: with the check replaced by a read of one element, the wrapper
compiled 0.06x of plain's time faster, without the skip 0.07x faster, and
with neither exactly as fast as plain optax with the scale in the state
(the bookkeeping is within noise). Ratios move by a few hundredths between
runs here. The newest JAX gives the same picture: on jax 0.12.0.1 (Python
3.13), one run of 5 rounds put lossscale at 1.17x plain optax for the loop
of layers and 1.13x under scan (the scale in the state alone: 1.05x,
1.03x).
"""


def table(title: str, rows: dict, *units: str) -> str:
    """A markdown table: one value column per unit, then the ratio."""
    head = " | ".join(units)
    lines = [
        f"### {title}",
        "",
        f"| variant | {head} | ratio to {next(iter(rows))} |",
        "|---" * (len(units) + 2) + "|",
    ]
    for name, (*values, ratio) in rows.items():
        cells = " | ".join(f"{v:.1f}" for v in values)
        lines.append(f"| {name} | {cells} | {ratio:.3f} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    dev = jax.devices()[0]
    return (
        f"{datetime.date.today().isoformat()}; {platform.platform()}; "
        f"{platform.processor() or platform.machine()}; "
        f"{jax.device_count()} x {dev.device_kind} ({jax.default_backend()}); "
        f"python {platform.python_version()}, jax {jax.__version__}, "
        f"optax {optax.__version__}, lossscale {lossscale.__version__}"
    )


SECTIONS = ("optimizer", "mlp", "transformer", "compile", "memory")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "RESULTS.md")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        parser.error(f"--sections must name some of {','.join(SECTIONS)}")
    command = "python benchmarks/step_overhead.py" + (
        " --quick" if args.quick else ""
    )
    if args.quick:
        sizes, rounds, calls = [100_000], 2, 1
        mlp, compile_leaves, compile_rounds = (128, 2, 32), 20, 1
        layers, kernel_layers = 1, (1, 2)
    else:
        sizes, rounds, calls = [1_000_000, 10_000_000, 20_000_000], 9, 3
        mlp, compile_leaves, compile_rounds = (1024, 4, 256), 500, 3
        layers, kernel_layers = 12, (12, 24)
    parts = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}.",
        "",
        "Medians over interleaved rounds of each variant's time ratio to "
        "plain optax in the same round; lower is better. Produced by "
        f"`{command}`.",
        "",
    ]
    for n in sizes if "optimizer" in sections else []:
        if n == sizes[0]:
            parts += ["## Optimizer-only step (adam, float32, 40 leaves)", ""]
        for overflow in (False, True):
            path = (
                "skip path (an inf in the gradients)"
                if overflow
                else "finite path"
            )
            rows = optimizer_only(
                n, overflow=overflow, rounds=rounds, calls=calls
            )
            parts.append(table(f"{n / 1e6:g}M parameters, {path}", rows, "ms"))
    if "mlp" in sections:
        parts += [
            "## Full train step (float16-compute MLP: forward, backward, adam)",
            "",
            table(
                f"width {mlp[0]}, depth {mlp[1]}, batch {mlp[2]}",
                full_step(*mlp, rounds=rounds, calls=calls),
                "ms",
            ),
        ]
    if "transformer" in sections:
        parts += transformer_sections(
            layers, kernel_layers, rounds, calls, quick=args.quick
        )
    if "compile" in sections:
        parts += [
            "## Compile time",
            "",
            table(
                f"{compile_leaves}-leaf parameter tree",
                compile_time(compile_leaves, compile_rounds),
                "trace ms",
                "lower + compile ms",
                "total ms",
            ),
        ]
    if "memory" in sections:
        parts += [
            "## Peak memory (XLA buffer analysis of the compiled step)",
            "",
            table(
                f"{sizes[-1] / 1e6:g}M parameters",
                peak_memory(sizes[-1]),
                "MiB",
            ),
        ]
    # The notes explain CPU measurements (their figures are a CPU's):
    # another backend's report points to them instead of repeating them.
    parts.append(NOTES if jax.default_backend() == "cpu" else OTHER_BACKEND)
    report = "\n".join(parts)
    args.out.write_text(report)
    print(report)
    return report


def transformer_sections(
    layers, kernel_layers, rounds, calls, *, quick=False
) -> list[str]:
    """Compile time, step time and kernels of the transformer's train step.

    Each layout with and without clipping; the smoke test (``quick``) runs
    the loop of layers with adamw only.
    """
    gpt = f"{layers}-layer transformer"
    compile_rounds = max(1, rounds // 3)
    parts = [
        "## A transformer train step (float16 compute, float32 weights)",
        "",
        "Whole train steps (forward, backward, adamw), jitted with donation; "
        "the baseline scales the loss by hand and checks nothing. "
        "Compile time is tracing, then lowering and compiling.",
        "",
    ]
    for scan in (False,) if quick else (False, True):
        layout = "layers under lax.scan" if scan else "a loop of layers"
        for clip in (False,) if quick else (False, True):
            chain = "clip_by_global_norm + adamw" if clip else "adamw"
            parts.append(
                table(
                    f"Compile time: {gpt}, {layout}, {chain}",
                    transformer_compile(
                        layers, scan=scan, clip=clip, rounds=compile_rounds
                    ),
                    "trace ms",
                    "lower + compile ms",
                    "total ms",
                )
            )
        parts.append(
            table(
                f"Step time: {gpt}, {layout}, adamw",
                transformer_step_time(
                    layers, scan=scan, rounds=rounds, calls=calls
                ),
                "ms",
            )
        )
        parts.append(
            count_table(
                f"Kernels in the compiled step: {layout}",
                transformer_kernels(kernel_layers, scan=scan),
            )
        )
    return parts


if __name__ == "__main__":
    main()
