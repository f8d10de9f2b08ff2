"""A fresh process for tests/test_cache_globals.py: serve one function of
tests/models/cache_globals.py (whose globals come from the environment at import)
through ``cache_compile``; print one JSON line: the output, eager's output and the
stats records' cache fields."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()

import torch  # noqa: E402

import graphgear  # noqa: E402
from tests.models import cache_globals  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("function", choices=cache_globals.FUNCTIONS)
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
    fn = getattr(cache_globals, a.function)
    x = torch.linspace(-0.5, 1.0, 4)  # as tests/test_cache_globals.py
    cached = graphgear.inference.cache_compile(fn, cache_dir=a.dir)
    with torch.no_grad():
        out, eager = cached(x), fn(x)
    print("RESULT " + json.dumps({"out": out.tolist(), "eager": eager.tolist(),
                                  "cache": [r.cache for r in graphgear.stats().graphs]}), flush=True)


if __name__ == "__main__":
    main()
