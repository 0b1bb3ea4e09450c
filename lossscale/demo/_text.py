"""Real text every machine has: the Python standard library's own source.

The character-level GPT of ``python -m lossscale.demo --model gpt`` trains
on ``.py`` files under ``sysconfig.get_paths()["stdlib"]``. The selection
is a seeded shuffle of the sorted file list, so it is the same on every run
with one Python version (other versions ship other files). Whole files are
held out, so the held-out loss measures how well the model reads modules
it has never seen, not windows next to ones it trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sysconfig

import numpy as np

# Printable ASCII and the newline; everything else (tabs, non-ASCII
# characters in docstrings and codec tables) shares one extra id. A fixed
# vocabulary keeps the ids independent of which files were drawn.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = len(CHARS) + 1
_OTHER = len(CHARS)
_LOOKUP = np.full(0x110000, _OTHER, dtype=np.uint8)
_LOOKUP[[ord(c) for c in CHARS]] = np.arange(len(CHARS), dtype=np.uint8)

# Directories whose content depends on the machine rather than on the
# Python version: installed packages, build configuration, and the test
# suite (which Debian and others ship as a separate package).
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Encoded training and held-out text (uint8 ids, one per character)."""

    train: np.ndarray
    heldout: np.ndarray
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]


def stdlib_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted by relative path."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if _SKIP_DIRS.isdisjoint(parts[:-1]) and not (
            parts[0].startswith(("_sysconfigdata", "config-"))
        ):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def encode(text: str) -> np.ndarray:
    """Character ids (uint8) of ``text``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return _LOOKUP[codes]


def decode(ids: np.ndarray) -> str:
    """The text of ``ids``; the shared id of other characters reads as '?'."""
    return "".join(CHARS[i] if i < len(CHARS) else "?" for i in ids)


@functools.cache
def load_corpus(train_chars: int, heldout_chars: int, seed: int = 0) -> Corpus:
    """Draw whole files until each split holds at least as many characters.

    Args:
        train_chars: the least number of training characters.
        heldout_chars: the least number of held-out characters, drawn first
            from the same shuffled list (so no file is in both splits).
        seed: the shuffle's seed.

    Returns:
        The encoded splits and the relative paths of the files in each.

    Raises:
        RuntimeError: if the standard library is too small (or missing, as
            in some frozen or embedded Pythons).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    order = np.random.default_rng(seed).permutation(len(files))
    wanted = {"heldout": heldout_chars, "train": train_chars}
    paths: dict[str, list[str]] = {"heldout": [], "train": []}
    ids: dict[str, list[np.ndarray]] = {"heldout": [], "train": []}
    sizes = dict.fromkeys(wanted, 0)
    for index in order:
        if sizes["train"] >= train_chars:
            break
        split = "heldout" if sizes["heldout"] < heldout_chars else "train"
        try:
            source = files[index].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable, or not UTF-8 like some test-suite files
        paths[split].append(files[index].relative_to(root).as_posix())
        ids[split].append(encode(source))
        sizes[split] += len(source)
    if any(sizes[split] < wanted[split] for split in wanted):
        raise RuntimeError(
            f"the standard library at {root} holds too little source: "
            f"{sizes} characters, wanted {wanted}"
        )
    return Corpus(
        train=np.concatenate(ids["train"]),
        heldout=np.concatenate(ids["heldout"]),
        train_files=tuple(paths["train"]),
        heldout_files=tuple(paths["heldout"]),
    )
