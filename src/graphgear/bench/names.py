"""The names ``graphgear bench`` and ``benchmarks/*.py`` share: contenders, models and
dtypes, the one way lists of them are given on a command line (space-separated, as
``--batch-sizes 1 2 4``), and the one way ratios are labelled (speedups, with their
direction).

A contender is named the same in every table, JSON file and option:

* ``eager``: the model as written;
* ``torch.compile``: ``torch.compile``'s default (Inductor);
* ``graphgear-max-autotune``, ``graphgear-reduce-overhead``: graphgear's two modes;
* ``graphgear-serve``: ``graphgear.inference.serve`` (reduce-overhead, frozen weights,
  the serving guard filter).

A benchmark's own variants append to one of these (``graphgear-reduce-overhead-frozen``).
Names used before this convention are rejected with today's name (:data:`RENAMED`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from ..errors import ConfigError

__all__ = ["CONTENDERS", "DTYPES", "MODELS", "RENAMED", "check_name", "name_type",
           "positive_int", "speedup_label", "speedup_note"]

EAGER = "eager"
TORCH_COMPILE = "torch.compile"
MAX_AUTOTUNE = "graphgear-max-autotune"
REDUCE_OVERHEAD = "graphgear-reduce-overhead"
SERVE = "graphgear-serve"

#: every contender, in the order tables list them
CONTENDERS = (EAGER, TORCH_COMPILE, MAX_AUTOTUNE, REDUCE_OVERHEAD, SERVE)

#: the models ``graphgear bench --model`` builds (``graphgear.bench.models``)
MODELS = ("toy", "llama", "qwen2", "gpt2")

#: the parameter dtypes ``--dtype`` takes
DTYPES = ("float32", "bfloat16")

#: names of the contenders before one convention held (issue 35), and today's
RENAMED: dict[str, str] = {
    "max-autotune": MAX_AUTOTUNE, "graphgear max-autotune": MAX_AUTOTUNE, "gg max-autotune": MAX_AUTOTUNE,
    "gg-ma": MAX_AUTOTUNE, "graphgear_max_autotune": MAX_AUTOTUNE,
    "reduce-overhead": REDUCE_OVERHEAD, "graphgear reduce-overhead": REDUCE_OVERHEAD,
    "gg reduce-overhead": REDUCE_OVERHEAD, "gg-ro": REDUCE_OVERHEAD, "graphgear": REDUCE_OVERHEAD,
    "gg reduce-overhead frozen": "graphgear-reduce-overhead-frozen",
    "serve": SERVE, "gg serving": SERVE, "gg-serve": SERVE, "graphgear serving": SERVE,
    "inductor": TORCH_COMPILE, "inductor_default": TORCH_COMPILE, "torch.compile default": TORCH_COMPILE,
}

def speedup_label(reference: str, *, direction: bool = True) -> str:
    """The label of a ratio: ``"speedup vs eager (higher is better)"`` (a column header
    may leave the direction to :func:`speedup_note` under its table)."""
    return f"speedup vs {reference}" + (" (higher is better)" if direction else "")


def speedup_note(*references: str) -> str:
    """The line under a table of speedups that says what they are."""
    labels = ", ".join(speedup_label(r) for r in references)
    return (f"{labels}: the reference's time / the contender's; above 1.00x the contender "
            f"is faster")


def check_name(value: str, allowed: Sequence[str], what: str = "contender") -> str:
    """``value`` if it is one of ``allowed``; else :class:`~graphgear.ConfigError` naming
    it, today's name when it is an old one, and the allowed names."""
    if value in allowed:
        return value
    new = RENAMED.get(value)
    hint = f" (renamed {new!r})" if new in allowed else ""
    raise ConfigError(f"unknown {what} {value!r}{hint}; choose from: {', '.join(allowed)}")


def name_type(allowed: Sequence[str], what: str = "contender") -> Callable[[str], str]:
    """An argparse ``type`` for one name out of ``allowed`` (use with ``nargs="+"``): an
    unknown or old name is a usage error that names it and lists ``allowed``."""

    def parse(text: str) -> str:
        if "," in text and all(part in allowed for part in text.split(",") if part):
            raise argparse.ArgumentTypeError(
                f"lists are space-separated: {' '.join(p for p in text.split(',') if p)}, not {text!r}")
        try:
            return check_name(text, allowed, what)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def positive_int(text: str) -> int:
    """An argparse ``type``: one positive int. ``1,2,4`` is refused with the space-separated
    form (every list of sizes is ``--batch-sizes 1 2 4``)."""
    try:
        value = int(text)
    except ValueError:
        if "," in text:
            spaced = " ".join(p.strip() for p in text.split(",") if p.strip())
            raise argparse.ArgumentTypeError(
                f"lists of sizes are space-separated: {spaced}, not {text!r}") from None
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value
