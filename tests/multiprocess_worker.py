"""One process of the two-process test in test_multiprocess.py.

Usage: python multiprocess_worker.py PORT PROCESS_ID [INIT_TIMEOUT_S]

Joins a 2-process x 2-CPU-device job over loopback, runs one sharded-jit
train step whose global batch holds an inf only in process 1's rows, and
prints one JSON line with what this process saw on its own devices.
"""

import inspect
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale


def main(port: int, process_id: int, init_timeout_s: int = 30) -> None:
    # Set before JAX initialises a backend (nothing has, on import).
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"127.0.0.1:{port}"
    timeouts = {
        "initialization_timeout": init_timeout_s,
        "heartbeat_timeout_seconds": 10,
        "shutdown_timeout_seconds": 10,  # jax >= 0.8
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(
        coordinator_address=address,
        coordinator_bind_address=address,
        num_processes=2,
        process_id=process_id,
        **{k: v for k, v in timeouts.items() if k in accepted},
    )
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    # Explicit axes, spelled out (the default changed in jax 0.9).
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4,), ("data",), axis_types=(explicit,))
    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data"))

    tx = lossscale.loss_scaled(
        optax.adam(0.1),
        lossscale.DynamicLossScale(256.0),
        require_scaled_by=False,
    )
    params = jax.device_put({"w": jnp.ones(3)}, replicated)
    state = jax.jit(tx.init, out_shardings=replicated)(params)

    def loss_fn(p, x):
        return jnp.mean(jnp.sum(x * p["w"], axis=-1))

    @jax.jit
    def step(p, s, x):
        scale = lossscale.get_loss_scale(s)
        grads = jax.grad(lambda q: scale.scale(loss_fn(q, x)))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    def batch(poison: bool):
        local = np.ones((2, 3), np.float32) * (process_id + 1)
        if poison and process_id == 1:
            local[1, 2] = np.inf
        return jax.make_array_from_process_local_data(rows, local)

    new_p, new_s = step(params, state, batch(poison=True))
    flags = [bool(x.data) for x in new_s.grads_finite.addressable_shards]
    scales = [
        float(x.data) for x in new_s.loss_scale.loss_scale.addressable_shards
    ]
    unchanged = all(
        np.array_equal(np.asarray(x.data), np.ones(3))
        for x in new_p["w"].addressable_shards
    )
    ctrl_p, ctrl_s = step(params, state, batch(poison=False))
    control_applied = all(
        not np.any(np.asarray(x.data) == 1.0)
        for x in ctrl_p["w"].addressable_shards
    ) and all(bool(x.data) for x in ctrl_s.grads_finite.addressable_shards)
    print(
        json.dumps(
            {
                "process": process_id,
                "finite_flags": flags,
                "scales": scales,
                "params_unchanged": unchanged,
                "control_applied": control_applied,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
