"""The command line of ``python -m lossscale.demo``."""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence

from lossscale.demo import _common as common
from lossscale.demo import _gpt, _mlp
from lossscale.demo._common import Result

# What the command line needs to know of each model.
MODELS = {
    "mlp": common.Model(
        modes=_mlp.MODES,
        steps=2000,
        train=_mlp.train,
        describe=f"the {_mlp.DEPTH}-layer sigmoid MLP",
        plot=functools.partial(
            common.plot,
            title=f"{_mlp.DEPTH}-layer sigmoid MLP, float16 compute with "
            "float32 weights",
        ),
        test_label="test loss",
        results="results.md",
        figure="lossscale_demo.png",
    ),
    "gpt": _gpt.MODEL,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lossscale.demo",
        description="Train one model in float32, float16, float16 with a "
        "static loss scale and float16 with a dynamic loss scale (and, for "
        "the GPT, bfloat16, and on request float8), and compare.",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="mlp",
        help="the deep sigmoid MLP (default) or a character-level GPT "
        "trained on the Python standard library's source",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="per mode (default: "
        + ", ".join(f"{m.steps} for {name}" for name, m in MODELS.items())
        + ")",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated modes (mlp: "
        + ",".join(_mlp.MODES)
        + "; gpt: "
        + ",".join(_gpt.MODES)
        + ", and the float8 modes "
        + ",".join(_gpt.FLOAT8_MODES)
        + ", run only when named here, since a CPU emulates float8); "
        "default all but the float8 ones",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"gpt only: the width of its layers (default "
        f"{_gpt.Config().width}; {_gpt.Config().heads} heads whatever the "
        "width)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("lossscale_demo"),
        help="folder for the results table and the figure",
    )
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway where stderr is not a "
        "terminal); each mode's line is printed either way",
    )
    args = parser.parse_args(argv)
    model = MODELS[args.model]
    if args.steps is None:
        args.steps = model.steps
    if args.steps < 10:
        parser.error(f"--steps must be at least 10, got {args.steps}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.width is not None:
        heads = _gpt.Config().heads
        if args.model != "gpt":
            parser.error(
                f"--width is for --model gpt, got --model {args.model}"
            )
        if args.width < heads or args.width % heads:
            parser.error(
                f"--width must be a positive multiple of {heads} (the "
                f"heads), got {args.width}"
            )
    if args.modes is None:
        args.modes = ",".join(model.default_modes or model.modes)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in model.modes]
    if unknown or not modes or len(set(modes)) != len(modes):
        parser.error(
            f"--modes must be distinct names from {','.join(model.modes)}, "
            f"got {args.modes!r}"
        )
    args.modes = modes
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out must be a folder, got the file {args.out}")
    return args


def prepare_out(out: pathlib.Path) -> None:
    """Creates the --out folder and checks that it takes files.

    Before any training, so that a folder that cannot hold the results
    fails at once with a message rather than after minutes of training with
    a traceback. Exits with status 2, as argparse does for a bad flag.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        print(
            f"python -m lossscale.demo: error: --out must be a folder that "
            f"can be created and written to, got {str(out)!r}: {reason}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    prepare_out(args.out)
    model = MODELS[args.model]
    if args.width is not None:
        model = _gpt.model(_gpt.Config(width=args.width))
    print(
        f"Training {model.describe} for {args.steps} steps in each mode "
        f"({', '.join(args.modes)}); seed {args.seed}.",
        flush=True,
    )
    results = []
    for mode in args.modes:
        start = time.perf_counter()
        result = model.train(
            mode, args.steps, args.seed, progress=not args.no_progress
        )
        # Flushed, so that a pipe or a log shows it before the next mode.
        summary = common.summary(
            result, time.perf_counter() - start, model.test_label
        )
        print(f"  {summary}", flush=True)
        results.append(result)
    report = common.table(results, model.test_label)
    print(report)
    (args.out / model.results).write_text(report + "\n")
    if not args.no_plot:
        path = args.out / model.figure
        model.plot(results, path)
        print(f"Figure: {path}")
    return results
