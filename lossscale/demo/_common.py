"""What the demo's models share: the train step, the loop, table and figure.

Every model of ``python -m lossscale.demo`` trains through
:func:`make_step` and :func:`run_steps`, so each mode differs only in its
compute dtype and loss scale, and every mode records the same things per
step: the true (unscaled) loss, the loss scale, whether the step was
skipped, and the fraction of gradient elements that are exactly zero after
unscaling.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale

# One colour and line style per mode in every panel; the modes that train
# alike overlap, so they differ in style as well as colour.
# float32, the reference, is drawn last and on top, dashed, so that the
# runs it matches do not hide it.
STYLES = {
    "f32": dict(color="black", ls=(0, (4, 3)), lw=1.6, zorder=4),
    "f16": dict(color="tab:red", ls="-", lw=1.0),
    "static": dict(color="tab:blue", ls="-", lw=1.2),
    "dynamic": dict(color="tab:green", ls=":", lw=1.6),
    "bf16": dict(color="tab:purple", ls="-.", lw=1.2),
    "hand": dict(color="tab:orange", ls="--", lw=1.0),
    "fp8": dict(color="tab:brown", ls="-", lw=1.2),
    "fp8-rowwise": dict(color="tab:pink", ls="--", lw=1.2),
    "fp8-rowwise-gw-hp": dict(color="tab:cyan", ls=":", lw=1.6),
}
# How often the progress bar shows the loss, in steps.
LOSS_EVERY = 10


def require(module: str):
    """Import ``module``, or exit with how to install the demo extra."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as err:
        raise SystemExit(
            f"lossscale.demo needs {module.split('.')[0]}: "
            'pip install -e ".[demo]"'
        ) from err


def compute_dtype(mode: str):
    """The activation dtype of a mode; the weights stay float32 in all."""
    return {"f32": jnp.float32, "bf16": jnp.bfloat16}.get(mode, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Model:
    """What the command line needs to know of one of the demo's models."""

    modes: tuple[str, ...]  # every mode --modes accepts
    steps: int  # the default number of steps per mode
    train: Callable[..., Result]  # train(mode, steps, seed, progress)
    describe: str  # "the 8-layer sigmoid MLP", for "Training ..."
    plot: Callable[[Sequence[Result], pathlib.Path], None]
    test_label: str  # the table's name for the evaluation loss
    results: str  # file names in the output folder
    figure: str
    # The modes run without --modes (default: all of them).
    default_modes: tuple[str, ...] | None = None


@dataclasses.dataclass
class Result:
    """One mode's run: per-step records and the final evaluation."""

    mode: str
    losses: np.ndarray
    scales: np.ndarray
    skipped: np.ndarray
    zero_fraction: np.ndarray
    test_loss: float
    test_accuracy: float | None
    seconds: float

    @property
    def final_loss(self) -> float:
        """The mean training loss over the last 5% of the steps."""
        return float(self.losses[-max(1, len(self.losses) // 20) :].mean())


def make_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    sample: Callable[[jax.Array, Any], Any],
    tx: optax.GradientTransformation,
):
    """A jitted ``step(params, opt_state, key, data)``.

    Args:
        loss_fn: ``loss_fn(params, batch)``, the mean loss in float32.
        sample: ``sample(key, data)``, a training batch drawn on the device.
        tx: an optimizer wrapped by :func:`lossscale.loss_scaled`.

    Returns:
        A function returning the new parameters and optimizer state and a
        record: the true loss, the scale for the next step, whether this
        step was skipped, and the fraction of unscaled gradient elements
        that are exactly zero.
    """

    @jax.jit
    def step(params, opt_state, key, data):
        batch = sample(key, data)
        scale = lossscale.get_loss_scale(opt_state)
        loss, grads = lossscale.value_and_grad(loss_fn, opt_state)(
            params, batch
        )
        true_grads = scale.unscale(grads)
        leaves = jax.tree.leaves(true_grads)
        zeros = sum(jnp.sum(g == 0) for g in leaves) / sum(
            g.size for g in leaves
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        m = lossscale.metrics(opt_state)
        record = (
            loss,
            m["loss_scale"],
            ~m["grads_finite"],
            zeros,
        )
        return optax.apply_updates(params, updates), opt_state, record

    return step


def run_steps(step, params, opt_state, data, keys, desc: str, progress: bool):
    """Run ``step`` once per key; return the parameters, records and time.

    The time covers the first step's compilation too, as a user would
    wait for it. With ``progress``, a tqdm bar on stderr shows the steps
    and, every ``LOSS_EVERY`` steps, the loss; tqdm leaves it out where
    stderr is not a terminal (a log, a pipe, a test), so that the log
    holds the figures, not the redrawn bar.
    """
    bar = None
    if progress:
        tqdm = require("tqdm").tqdm
        bar = tqdm(
            total=len(keys),
            desc=f"{desc:>7}",
            leave=False,
            ncols=80,
            disable=None,
        )
    records = []
    start = time.perf_counter()
    try:
        for i in range(len(keys)):
            params, opt_state, record = step(params, opt_state, keys[i], data)
            records.append(record)
            if bar is not None and not bar.disable:
                bar.update()
                # Reading the loss waits for the step: only now and then.
                if (i + 1) % LOSS_EVERY == 0:
                    bar.set_postfix(loss=f"{float(record[0]):.4f}")
    finally:
        if bar is not None:
            bar.close()
    records = jax.device_get(records)
    seconds = time.perf_counter() - start
    losses, scales, skipped, zeros = (
        np.asarray(r) for r in zip(*records, strict=True)
    )
    return params, (losses, scales, skipped, zeros), seconds


def result(mode, records, test_loss, test_accuracy, seconds) -> Result:
    """A :class:`Result` from :func:`run_steps`' records."""
    losses, scales, skipped, zeros = records
    return Result(
        mode=mode,
        losses=losses.astype(np.float64),
        scales=scales.astype(np.float64),
        skipped=skipped.astype(bool),
        zero_fraction=zeros.astype(np.float64),
        test_loss=float(test_loss),
        test_accuracy=None if test_accuracy is None else float(test_accuracy),
        seconds=seconds,
    )


def _columns(test_label: str, accuracy: bool) -> list[str]:
    return [
        "mode",
        "final train loss",
        test_label,
        *["test accuracy"] * accuracy,
        "zero-gradient fraction",
        "skipped steps",
        "final scale",
        "time (s)",
    ]


def _cells(r: Result, accuracy: bool) -> list[str]:
    # Losses to 4 decimals, as docs/transformer.md and the float8 guide
    # quote them: to 3, bf16's 2.0940 and a float8 recipe's 2.0935 are
    # both 2.094.
    return [
        r.mode,
        f"{r.final_loss:.4f}",
        f"{r.test_loss:.4f}",
        *([f"{r.test_accuracy:.3f}"] if accuracy else []),
        f"{r.zero_fraction.mean():.3f}",
        f"{int(r.skipped.sum())}",
        f"{r.scales[-1]:g}",
        f"{r.seconds:.1f}",
    ]


def table(results: Sequence[Result], test_label: str = "test loss") -> str:
    """A markdown table of the results, one row per mode.

    The accuracy column appears only if the results have an accuracy.
    """
    accuracy = all(r.test_accuracy is not None for r in results)
    columns = _columns(test_label, accuracy)
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        rows.append("| " + " | ".join(_cells(r, accuracy)) + " |")
    return "\n".join(rows)


def summary(
    r: Result, wall_seconds: float, test_label: str = "test loss"
) -> str:
    """One mode's row of :func:`table` as a line, and its wall time.

    The demo prints it as soon as the mode ends, so that a run stopped
    half way still shows the modes it finished.

    Args:
        r: the mode's result.
        wall_seconds: the mode's whole time: data, training, evaluation.
        test_label: the table's name for the evaluation loss.
    """
    accuracy = r.test_accuracy is not None
    named = zip(
        _columns(test_label, accuracy)[1:-1],
        _cells(r, accuracy)[1:-1],
        strict=True,
    )
    figures = ", ".join(f"{name} {cell}" for name, cell in named)
    return (
        f"{r.mode} done: {figures}; {r.seconds:.1f} s training, "
        f"{wall_seconds:.1f} s in all"
    )


def plot(
    results: Sequence[Result],
    path: pathlib.Path,
    title: str,
    zero_ylim: tuple[float, float] | None = (0, 1),
    difference_window: int | None = None,
) -> None:
    """Save the loss, loss-scale and zero-gradient panels as a PNG.

    Args:
        results: the runs to draw, one line each.
        path: the PNG to write.
        title: the figure's title.
        zero_ylim: the zero-gradient panel's y range; None to fit the data.
        difference_window: if given (and an ``f32`` run is among the
            results), a fourth panel shows each run's training loss minus
            float32's, as a moving average over this many steps: gaps too
            small to see on the loss curves themselves.
    """
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot")
    reference = next((r for r in results if r.mode == "f32"), None)
    window = None
    if difference_window is not None and reference is not None:
        # Runs shorter than the window get one mean.
        window = min(difference_window, len(reference.losses))
    difference = window is not None
    # Three panels are stacked, one above the other on a shared step axis:
    # a figure about as wide as a page (880 px), whose legends stay
    # readable where the README and the docs show it, unscaled or nearly.
    shape, size = ((2, 2), (12, 8)) if difference else ((3, 1), (8, 9))
    fig, axes = plt.subplots(*shape, figsize=size, sharex=not difference)
    axes = axes.ravel()
    for r in results:
        steps = np.arange(1, len(r.losses) + 1)
        style = STYLES[r.mode]
        axes[0].plot(steps, r.losses, label=r.mode, **style)
        # Several runs lie on 0 here: the legend gives each one's mean.
        mean = f"{r.mode}: mean {r.zero_fraction.mean():.3f}"
        axes[2].plot(steps, r.zero_fraction, label=mean, **style)
        if r.mode in ("static", "dynamic"):
            axes[1].plot(steps, r.scales, label=r.mode, **style)
        if r.skipped.any():
            axes[1].scatter(
                steps[r.skipped],
                r.scales[r.skipped],
                marker="x",
                color=style["color"],
                label=f"{r.mode}: a skipped step (x), at the scale it left",
                zorder=5,
            )
        if window is not None and reference is not None and r is not reference:
            kernel = np.ones(window) / window
            gap = np.convolve(r.losses - reference.losses, kernel, "valid")
            axes[3].plot(steps[window - 1 :], gap, label=r.mode, **style)
    axes[0].set(title="training loss", xlabel="step", ylabel="cross-entropy")
    axes[1].set(title="loss scale", xlabel="step", yscale="log")
    axes[2].set(title="gradient elements exactly zero", xlabel="step")
    if zero_ylim is not None:
        axes[2].set_ylim(zero_ylim)
    if difference:
        axes[3].axhline(0, color=STYLES["f32"]["color"], lw=1)
        axes[3].set(
            title=f"training loss minus f32's, mean of {difference_window} "
            "steps",
            xlabel="step",
        )
    if not difference:
        for ax in axes[:-1]:  # the stack shares the bottom panel's axis
            ax.set_xlabel("")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
