"""Where float16 loses the demo GPT's gradients (the numbers in transformer.md).

Trains the default GPT of ``python -m lossscale.demo --model gpt`` in
float32 (seed 0), and at two steps compares, on one fixed batch, the
gradients computed in float16 without scaling and in float16 with a loss
scale of 2**16 against the float32 ones, per kind of weight: the share of
elements that are exactly zero and the relative error ||g16 - g32|| /
||g32||. It also counts the gradients of the loss with respect to the
logits, (softmax - one_hot) / tokens, that float16 can only hold as
subnormals or not at all. About a minute on a 2-core CPU::

    PYTHONPATH=. python docs/gpt_gradients.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lossscale
from lossscale.demo import _common as common
from lossscale.demo import _gpt as gpt
from lossscale.demo import _text as text

SNAPSHOTS = (12, gpt.STEPS)
SCALE = 2.0**16


def gradients(params, dtype, batch, scale=1.0):
    """Unscaled gradients of the loss times ``scale``, computed in dtype
    (with lossscale.autocast, as the demo's float16 modes compute them)."""
    graphdef, _ = nnx.split(gpt.make_model(0), nnx.Param)

    def loss(p):
        logits = nnx.merge(graphdef, p)(batch[0])
        return gpt.cross_entropy(logits, batch[1])

    if dtype != jnp.float32:
        loss = lossscale.autocast(loss, dtype)
    scaled = loss

    def loss(p):
        return scaled(p) * scale

    grads = jax.jit(jax.grad(loss))(params)
    return jax.tree.map(lambda g: np.asarray(g, np.float64) / scale, grads)


GROUPS = {
    "qkv": "attention q, k, v",
    "attn_out": "attention output",
    "up": "MLP",
    "down": "MLP",
    "norm1": "LayerNorm",
    "norm2": "LayerNorm",
    "norm": "LayerNorm",
    "tokens": "embeddings",
    "positions": "embeddings",
}


def by_kind(tree):
    """Concatenated leaves, grouped by the kind of layer they belong to."""
    groups = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = re.findall(r"'(\w+)'", jax.tree_util.keystr(path))
        kind = GROUPS[next(n for n in names if n in GROUPS)]
        groups.setdefault(kind, []).append(leaf.ravel())
    return {
        k: np.concatenate(groups[k]) for k in dict.fromkeys(GROUPS.values())
    }


def report(step, params, batch):
    g32 = by_kind(gradients(params, jnp.float32, batch))
    g16 = by_kind(gradients(params, jnp.float16, batch))
    scaled = by_kind(gradients(params, jnp.float16, batch, SCALE))
    print(f"\nstep {step}")
    print(
        "| weights | elements | zero: f16 | zero: f16 x 2**16 | "
        "error: f16 | error: f16 x 2**16 |"
    )
    print("|---|---|---|---|---|---|")
    for kind, ref in g32.items():
        cells = [f"{np.mean(g[kind] == 0):.4f}" for g in (g16, scaled)]
        cells += [
            f"{np.linalg.norm(g[kind] - ref) / np.linalg.norm(ref):.4f}"
            for g in (g16, scaled)
        ]
        print(f"| {kind} | {ref.size} | " + " | ".join(cells) + " |")
    graphdef, _ = nnx.split(gpt.make_model(0), nnx.Param)
    logits = nnx.merge(graphdef, params)(batch[0])
    tokens = batch[1].size
    probs = jax.nn.softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(batch[1], text.VOCAB)
    dlogits = np.abs(np.asarray((probs - onehot) / tokens))
    print(
        f"logit gradients ({tokens} tokens): subnormal in float16 "
        f"{np.mean(dlogits < 2.0**-14):.3f}, flushed to zero "
        f"{np.mean(dlogits < 2.0**-25):.3f}; with the scale: subnormal "
        f"{np.mean(dlogits * SCALE < 2.0**-14):.3f}, zero "
        f"{np.mean(dlogits * SCALE < 2.0**-25):.3f}"
    )


def main():
    config = gpt.Config()
    corpus = text.load_corpus(gpt.TRAIN_CHARS, gpt.HELDOUT_CHARS)
    data = jnp.asarray(corpus.train)
    sample = gpt.sampler(config)
    graphdef, params = nnx.split(gpt.make_model(0), nnx.Param)
    tx = lossscale.loss_scaled(
        gpt.optimizer(gpt.STEPS, config.learning_rate),
        lossscale.NoOpLossScale(),
    )

    def loss_fn(p, batch):
        return gpt.cross_entropy(nnx.merge(graphdef, p)(batch[0]), batch[1])

    step = common.make_step(loss_fn, sample, tx)
    opt_state = tx.init(params)
    keys = jax.random.split(jax.random.key(1), gpt.STEPS)
    batch = sample(jax.random.key(12345), data)
    for i, key in enumerate(keys, start=1):
        params, opt_state, _ = step(params, opt_state, key, data)
        if i in SNAPSHOTS:
            report(i, params, batch)


if __name__ == "__main__":
    main()
