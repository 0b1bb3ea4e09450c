"""Compiled temporary memory of Hugging Face's FlaxGPT2LMHeadModel's
gradient: float32, its own ``dtype=float16`` path, and the float32 model
under ``lossscale.autocast`` (issue 32's client model).

Needs a transformers release with Flax models (4.x; version 5 removed
them), which lossscale's test dependencies do not include:

    pip install "transformers<5" && python benchmarks/hf_gpt2_memory.py

``tests/test_autocast_memory.py`` holds the same model rebuilt in flax
linen, as a unit test.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=64
    )
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 1000, (8, 64)))

    def loss_of(dtype):
        model = FlaxGPT2LMHeadModel(config, seed=0, dtype=dtype)

        def loss(params, ids):
            logits = model(ids, params=params, train=False).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1].astype(jnp.float32), ids[:, 1:]
            ).mean()

        return loss, model.params

    def temp(loss, params):
        compiled = jax.jit(jax.grad(loss)).lower(params, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 1e6

    loss32, params = loss_of(jnp.float32)
    loss16, _ = loss_of(jnp.float16)
    f32 = temp(loss32, params)
    hand = temp(loss16, params)
    auto = temp(lossscale.autocast(loss32, jnp.float16), params)
    print(
        f"transformers {transformers.__version__}, jax {jax.__version__}; "
        "FlaxGPT2LMHeadModel, 4 layers x 128, batch 8 x 64, gradient's "
        f"temporary memory: float32 {f32:.1f} MB, its dtype=float16 "
        f"{hand:.1f} MB, autocast {auto:.1f} MB ({auto / f32:.2f}x float32, "
        f"{auto / hand:.2f}x its float16 path)"
    )


if __name__ == "__main__":
    main()
