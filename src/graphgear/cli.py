"""The ``graphgear`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from .bench import CONTENDERS, format_table, plot, run_bench, write_json
from .cache import cache_folder, clear_entries, list_entries
from .debug import text_table


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--batch-sizes takes comma-separated positive ints like 1,2,4; got {text!r}"
        ) from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"--batch-sizes needs positive ints, got {text!r}")
    return sorted(set(sizes))


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def _cache_command(command: str, folder: str | None) -> int:
    root = cache_folder(folder)
    if command == "clear":
        print(f"removed {clear_entries(root)} entries from {root}")
        return 0
    entries = list_entries(root)
    rows = [[e.name, e.key[:12] or "(unreadable)",
             " ".join(f"{k}={e.parts[k][:8]}" for k in ("torch", "graphgear", "config", "code", "rank") if k in e.parts),
             f"{e.size / 1024:.0f} KiB", f"{e.age_seconds / 3600:.1f} h", e.path]
            for e in entries]
    print(text_table(["name", "key", "parts", "size", "age", "path"], rows, rule=False))
    print(f"{len(entries)} entries in {root}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphgear", description="graphgear: a graph-capture backend for torch.compile")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="decode steps of the embedded Llama-style decoder in eager, torch.compile and each graphgear mode",
        description="Runs decode steps of a small Llama-style decoder (static KV cache, random "
        "weights) in eager, torch.compile default and each graphgear mode, side by side, and "
        "prints compile seconds, per-step times, speedup over eager and max abs difference.",
    )
    b.add_argument("--device", default="cpu", help="cpu, cuda or npu (default cpu)")
    b.add_argument("--batch-sizes", type=_sizes, default=[1], help="comma-separated, e.g. 1,2,4 (gears when several)")
    b.add_argument("--steps", type=_positive, default=200, help="timed decode steps per batch size (default 200)")
    b.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    b.add_argument("--rounds", type=_positive, default=5,
                   help="the timed steps run in this many interleaved rounds (default 5)")
    b.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    b.add_argument("--modes", default=None,
                   help="comma-separated subset of: eager, torch.compile, max-autotune, reduce-overhead")
    b.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    b.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw step time against batch size, one line per contender (needs "
                        "matplotlib: pip install 'graphgear[plot]')")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = sub.add_parser("cache", help="list or clear graphgear's compile cache (graphgear.inference.cache_compile)")
    csub = c.add_subparsers(dest="cache_command", required=True)
    for name, text in (("ls", "list entries: name, key parts, size, age"), ("clear", "delete every entry")):
        cp = csub.add_parser(name, help=text)
        cp.add_argument("dir", nargs="?", default=None,
                        help="cache folder (default $GRAPHGEAR_CACHE_DIR or ~/.cache/graphgear)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "cache":
        return _cache_command(args.cache_command, args.dir)

    if args.device not in ("cpu", "cuda", "npu"):
        parser.error(f"--device must be cpu, cuda or npu; got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.device == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            parser.error("--device npu needs torch_npu installed")
    contenders = list(CONTENDERS)
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
        alias = {c.split()[-1]: c for c in CONTENDERS}
        bad = [m for m in wanted if m not in alias]
        if bad:
            parser.error(f"--modes: unknown {bad}; choose from {sorted(alias)}")
        contenders = [c for c in CONTENDERS if c.split()[-1] in wanted or c == "eager"]
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, an optional extra: pip install 'graphgear[plot]' "
                         "(or pip install matplotlib)")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run_bench(
        device=args.device, batch_sizes=args.batch_sizes, steps=args.steps, warmup=args.warmup,
        rounds=args.rounds,
        contenders=contenders, progress=not args.no_progress,
    )
    print(f"graphgear bench: embedded decoder, device {args.device}, {args.steps} steps, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(format_table(results))
    if args.json:
        write_json(results, args.json, {"device": args.device, "steps": args.steps,
                                        "batch_sizes": args.batch_sizes, "torch": torch.__version__})
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, title=f"graphgear bench, {args.device}, {torch.get_num_threads()} threads")
        print(f"wrote {args.plot}")
    failed = [r for r in results if r.error]
    return 1 if failed and len(failed) == len(results) else 0


if __name__ == "__main__":
    sys.exit(main())

