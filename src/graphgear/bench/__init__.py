"""An application of graphgear: the embedded demo models and ``graphgear bench``.

* :mod:`~graphgear.bench.toy_decoder`: a small Llama-style decoder with a static KV cache
  and random weights, the model ``graphgear bench`` runs by default (the tests, the
  benchmarks and the examples use it too);
* :mod:`~graphgear.bench.toy_decoder_tp`: that decoder split for tensor parallelism;
* :mod:`~graphgear.bench.models`: the models ``graphgear bench --model`` builds (the toy,
  transformers Llama, Qwen2 and GPT-2 from small configs);
* :mod:`~graphgear.bench.names`: the contender, model and dtype names, and the
  command-line conventions, shared with ``benchmarks/*.py``;
* :mod:`~graphgear.bench.run`: the bench itself (``graphgear bench`` in ``cli``), and
  :mod:`~graphgear.bench.report` its table, JSON and plot.

The library never imports this package: it sits above ``graphgear.inference`` in the
layers of ``tests/test_layout.py``.
"""

from __future__ import annotations

from .models import build_model
from .names import CONTENDERS, DTYPES, MODELS
from .report import format_table, plot, write_json
from .run import DEFAULT_CONTENDERS, BenchResult, run_bench

__all__ = ["CONTENDERS", "DEFAULT_CONTENDERS", "DTYPES", "MODELS", "BenchResult", "build_model",
           "format_table", "plot", "run_bench", "write_json"]
