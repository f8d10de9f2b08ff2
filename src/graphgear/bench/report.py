"""``graphgear bench``'s output: the text table, the JSON file and the plot."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from ..debug import text_table
from .names import EAGER, TORCH_COMPILE, speedup_label, speedup_note
from .run import BenchResult

__all__ = ["format_table", "plot", "write_json"]


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x"


def format_table(results: Sequence[BenchResult]) -> str:
    """The results as an aligned text table, with a line saying what the speedups mean."""
    cols = ["contender", "batch", "compile s", "median us", "p90 us", speedup_label(EAGER, direction=False),
            speedup_label(TORCH_COMPILE, direction=False), "max abs diff"]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.contender, str(r.batch_size), "-", "-", "-", "-", "-", f"failed: {r.error}"])
            continue
        rows.append([
            r.contender, str(r.batch_size), f"{r.compile_seconds:.1f}", f"{r.median_us:.0f}",
            f"{r.p90_us:.0f}", _ratio(r.speedup_vs_eager), _ratio(r.speedup_vs_torch_compile),
            "-" if math.isnan(r.max_abs_diff) else f"{r.max_abs_diff:.2e}",
        ])
    return text_table(cols, rows) + "\n" + speedup_note(EAGER, TORCH_COMPILE)


def _finite(value: Any) -> Any:
    """NaN as None: JSON has no NaN (``json.dump`` writes a bare ``NaN`` that strict
    readers refuse)."""
    return None if isinstance(value, float) and math.isnan(value) else value


def write_json(results: Sequence[BenchResult], path: str, meta: dict[str, Any]) -> None:
    """``{"meta": meta, "results": [...]}``: one record per result, speedups as
    ``speedup_vs_eager`` / ``speedup_vs_torch_compile`` (higher is better; null where
    the reference did not run)."""
    records = [{k: _finite(v) for k, v in dataclasses.asdict(r).items()} for r in results]
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": records}, f, indent=2)
        f.write("\n")


def plot(results: Sequence[BenchResult], path: str, *, title: str = "graphgear bench") -> None:
    """Step time against batch size, one line per contender, written to ``path`` (PNG).
    Needs matplotlib (``pip install 'graphgear[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r.contender for r in results):
        pts = sorted((r.batch_size, r.median_us) for r in results if r.contender == name and not r.error)
        if pts:
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=name)
    ax.set_xlabel("batch size")
    ax.set_ylabel("µs per decode step (median; lower is better)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
