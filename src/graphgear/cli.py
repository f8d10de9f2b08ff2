"""The ``graphgear`` command: ``bench``, ``env``, ``cache``, ``compare`` and ``--version``.

Conventions shared with ``benchmarks/*.py`` (:mod:`graphgear.bench.names`): lists are
space-separated (``--batch-sizes 1 2 4``, ``--contenders eager graphgear-serve``),
contenders have one name everywhere, ratios are speedups labelled with their direction,
and ``--json FILE`` carries the versions, threads, CPU model and commit of the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from collections.abc import Sequence

import torch

from . import __version__
from .bench import CONTENDERS, DEFAULT_CONTENDERS, DTYPES, MODELS, format_table, plot, run_bench, write_json
from .bench.names import EAGER, name_type, positive_int
from .cache import cache_folder, clear_entries, list_entries
from .cache.store import use_private_inductor_cache
from .debug import compare_dumps, text_table
from .env import collect, cpu_model, format_report, run_metadata
from .errors import ConfigError

__all__ = ["main"]


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


def _env_command(as_json: bool, build: bool) -> int:
    info = collect(build_liveness=build)
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        print("graphgear env: paste this into bug reports")
        print(format_report(info))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphgear", description="graphgear: a graph-capture backend for torch.compile")
    parser.add_argument("--version", action="version",
                        version=f"graphgear {__version__} (torch {torch.__version__}, "
                                f"Python {platform.python_version()})")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="decode steps of a small model in eager, torch.compile and each graphgear mode",
        description="Runs decode steps of a small decoder (random weights, static KV cache) in "
        "eager, torch.compile default and each graphgear mode, side by side, and prints compile "
        "seconds, per-step times, speedups (higher is better) and the max abs difference from eager.",
    )
    b.add_argument("--model", default="toy", type=name_type(MODELS, "model"), metavar="NAME",
                   help="toy (the embedded decoder, the default) or a transformers architecture "
                        "built from a small config with random weights: llama, qwen2, gpt2 "
                        "(needs transformers)")
    b.add_argument("--dtype", default="float32", type=name_type(DTYPES, "dtype"), metavar="D",
                   help="parameter dtype: float32 (default) or bfloat16")
    b.add_argument("--device", default="cpu", help="cpu, cuda or npu (default cpu)")
    b.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1], metavar="N",
                   help="space-separated, e.g. --batch-sizes 1 2 4 (with the toy model several "
                        "sizes become gears of one graph)")
    b.add_argument("--steps", type=positive_int, default=200, help="timed decode steps per batch size (default 200)")
    b.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    b.add_argument("--rounds", type=positive_int, default=5,
                   help="the timed steps run in this many interleaved rounds (default 5)")
    b.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads for the run")
    b.add_argument("--contenders", type=name_type(CONTENDERS), nargs="+", default=list(DEFAULT_CONTENDERS),
                   metavar="NAME",
                   help=f"space-separated, out of: {', '.join(CONTENDERS)} (default: "
                        f"{' '.join(DEFAULT_CONTENDERS)}); eager always runs (the reference)")
    b.add_argument("--modes", default=None, help=argparse.SUPPRESS)  # renamed --contenders
    b.add_argument("--json", metavar="FILE", default=None,
                   help="also write the results as JSON, with the versions, threads, CPU model and commit")
    b.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw step time against batch size, one line per contender (needs "
                        "matplotlib: pip install 'graphgear[plot]')")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = sub.add_parser("env", help="versions, compiler, vector ISA, caches and devices: for bug reports",
                       description="Prints what a bug report needs: the graphgear, torch, transformers and "
                       "Python versions, the OS and CPU, the vector ISA Inductor picks, the C++ compiler, "
                       "whether the output-liveness extension builds, the cache folders and whether they "
                       "are trusted, and CUDA/NPU availability.")
    e.add_argument("--json", action="store_true", help="print it as JSON")
    e.add_argument("--no-build", action="store_true",
                   help="do not build the liveness extension when it is not built yet (about 30 s)")
    c = sub.add_parser("cache", help="list or clear graphgear's compile cache (graphgear.inference.cache_compile)")
    csub = c.add_subparsers(dest="cache_command", required=True)
    for name, text in (("ls", "list entries: name, key parts, size, age"), ("clear", "delete every entry")):
        cp = csub.add_parser(name, help=text)
        cp.add_argument("dir", nargs="?", default=None,
                        help="cache folder (default $GRAPHGEAR_CACHE_DIR or ~/.cache/graphgear)")
    k = sub.add_parser(
        "compare", help="compare two data dumps (debug.data_dump) node by node; exit 1 on a divergence",
        description="Compares the node outputs of two data-dump folders (debug.data_dump.path), graphs in "
        "compile order, calls by number, nodes by name, and prints the first node whose output diverges "
        "beyond the tolerance (its op, source line and error) and the worst ones. Exit status 1 when a "
        "node diverges, 0 when none does. From Python, graphgear.debug.compare(model, inputs) dumps and "
        "compares a model's graphs before and after graphgear's passes in one call.")
    k.add_argument("reference", help="the reference dump folder (e.g. stage 'original', or eager)")
    k.add_argument("other", help="the dump folder to check against it")
    k.add_argument("--atol", type=float, default=1e-5,
                   help="absolute tolerance (default 1e-5; never below 4 eps of the dtype times the largest value)")
    k.add_argument("--rtol", type=float, default=1e-4,
                   help="relative tolerance (default 1e-4; never below 4 eps of the dtype)")
    k.add_argument("--top", type=positive_int, default=5, help="how many of the worst nodes to list (default 5)")
    return parser


def _compare_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.atol < 0 or args.rtol < 0:
        parser.error(f"--atol and --rtol take values >= 0, got --atol {args.atol} --rtol {args.rtol}")
    try:
        report = compare_dumps(args.reference, args.other, atol=args.atol, rtol=args.rtol, top=args.top)
    except ConfigError as e:  # a folder that holds no dump: the message says which and why
        print(e, file=sys.stderr)
        return 2
    print(report)
    return 1 if report.diverged else 0


def _check_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.modes is not None:
        parser.error(f"--modes is now --contenders, space-separated, out of: {', '.join(CONTENDERS)} "
                     f"(got --modes {args.modes!r})")
    if args.warmup < 0:
        parser.error(f"--warmup takes 0 or more steps, got {args.warmup}")
    if args.device not in ("cpu", "cuda", "npu"):
        parser.error(f"--device must be cpu, cuda or npu; got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.device == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            parser.error("--device npu needs torch_npu installed")
    if args.model != "toy":
        try:
            import transformers  # noqa: F401
        except ImportError:
            parser.error(f"--model {args.model} builds a transformers model, and transformers is not "
                         f"installed: pip install transformers (or use --model toy)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, an optional extra: pip install 'graphgear[plot]' "
                         "(or pip install matplotlib)")


def _bench_command(args: argparse.Namespace) -> int:
    use_private_inductor_cache()  # as the tests and benchmarks do: a private, checked Inductor cache
    if args.threads:
        torch.set_num_threads(args.threads)
    contenders = list(dict.fromkeys([EAGER, *args.contenders]))  # eager: the reference
    results = run_bench(
        model=args.model, dtype=args.dtype, device=args.device, batch_sizes=args.batch_sizes,
        steps=args.steps, warmup=args.warmup, rounds=args.rounds, contenders=contenders,
        progress=not args.no_progress,
    )
    what = "the embedded toy decoder" if args.model == "toy" else f"transformers {args.model} (random weights)"
    print(f"graphgear bench: {what}, {args.dtype}, device {args.device}, {args.steps} steps; graphgear "
          f"{__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU {cpu_model() or 'not found'}")
    print(format_table(results))
    if args.json:
        meta = {**run_metadata(), "command": "bench", "model": args.model, "dtype": args.dtype,
                "device": args.device, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                "batch_sizes": args.batch_sizes, "contenders": contenders}
        write_json(results, args.json, meta)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, title=f"graphgear bench, {args.model} {args.dtype}, {args.device}, "
                                       f"{torch.get_num_threads()} threads")
        print(f"wrote {args.plot}")
    failed = [r for r in results if r.error]
    return 1 if failed and len(failed) == len(results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "cache":
        return _cache_command(args.cache_command, args.dir)
    if args.command == "env":
        return _env_command(args.json, not args.no_build)
    if args.command == "compare":
        return _compare_command(parser, args)
    _check_bench(parser, args)
    return _bench_command(args)


if __name__ == "__main__":
    sys.exit(main())
