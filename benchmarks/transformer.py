"""A GPT-style decoder as plain JAX functions, for the benchmarks.

12 layers of pre-LayerNorm causal self-attention and a GELU MLP, width 256,
a vocabulary of 1024 with tied embeddings: 99 parameter leaves, float32
master weights and float16 compute (LayerNorm statistics and the softmax in
float32). ``scan=True`` stacks the layers' parameters (11 leaves) and runs
them under ``jax.lax.scan``, the layout large models use to compile fast.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WIDTH, VOCAB, HEADS, SEQ, BATCH = 256, 1024, 4, 64, 8


def init(key: jax.Array, layers: int = 12, *, scan: bool = False) -> Any:
    def dense(k, fan_in, fan_out):
        return jax.random.normal(k, (fan_in, fan_out)) / np.sqrt(fan_in)

    def layer(k):
        k1, k2, k3, k4 = jax.random.split(k, 4)
        return {
            "ln1_scale": jnp.ones(WIDTH),
            "ln1_bias": jnp.zeros(WIDTH),
            "w_qkv": dense(k1, WIDTH, 3 * WIDTH),
            "w_out": dense(k2, WIDTH, WIDTH),
            "ln2_scale": jnp.ones(WIDTH),
            "ln2_bias": jnp.zeros(WIDTH),
            "w_up": dense(k3, WIDTH, 4 * WIDTH),
            "w_down": dense(k4, 4 * WIDTH, WIDTH),
        }

    k_tok, k_pos, k_layers = jax.random.split(key, 3)
    blocks = [layer(k) for k in jax.random.split(k_layers, layers)]
    if scan:
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return {
        "tokens": jax.random.normal(k_tok, (VOCAB, WIDTH)) * 0.02,
        "positions": jax.random.normal(k_pos, (SEQ, WIDTH)) * 0.02,
        "ln_final": jnp.ones(WIDTH),
        "layers": blocks,
    }


def _layer_norm(x, scale, bias=None):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale
    return (y if bias is None else y + bias).astype(x.dtype)


def _block(h, p, dtype):
    batch, steps, _ = h.shape
    x = _layer_norm(h, p["ln1_scale"], p["ln1_bias"])
    q, k, v = jnp.split(x @ p["w_qkv"].astype(dtype), 3, axis=-1)

    def heads(t):
        t = t.reshape(batch, steps, HEADS, WIDTH // HEADS)
        return t.transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    logits = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32)
    logits = logits / np.sqrt(WIDTH // HEADS)
    causal = jnp.tril(jnp.ones((steps, steps), jnp.bool_))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    o = (weights.astype(dtype) @ v).transpose(0, 2, 1, 3)
    h = h + o.reshape(batch, steps, WIDTH) @ p["w_out"].astype(dtype)
    x = _layer_norm(h, p["ln2_scale"], p["ln2_bias"])
    up = jax.nn.gelu(x @ p["w_up"].astype(dtype))
    return h + up @ p["w_down"].astype(dtype)


def loss_fn(
    params: Any, tokens: jax.Array, *, scan: bool = False, dtype=jnp.float16
) -> jax.Array:
    """Mean next-token cross-entropy, computed in ``dtype``."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    h = params["tokens"][x] + params["positions"][: x.shape[1]]
    h = h.astype(dtype)
    if scan:
        h, _ = jax.lax.scan(
            lambda h, p: (_block(h, p, dtype), None), h, params["layers"]
        )
    else:
        for p in params["layers"]:
            h = _block(h, p, dtype)
    h = _layer_norm(h, params["ln_final"])
    logits = (h @ params["tokens"].astype(dtype).T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def batch(seed: int = 0) -> jax.Array:
    return jax.random.randint(
        jax.random.key(seed), (BATCH, SEQ + 1), 0, VOCAB, jnp.int32
    )
