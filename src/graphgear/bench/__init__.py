"""An application of graphgear: the embedded demo models and ``graphgear bench``.

* :mod:`~graphgear.bench.toy_decoder`: a small Llama-style decoder with a static KV cache
  and random weights, the model ``graphgear bench`` runs by default (the tests, the
  benchmarks and the examples use it too);
* :mod:`~graphgear.bench.toy_decoder_tp`: that decoder split for tensor parallelism;
* :mod:`~graphgear.bench.run`: the bench itself (``graphgear bench`` in ``cli``).

The library never imports this package: it sits above ``graphgear.inference`` in the
layers of ``tests/test_layout.py``.
"""

from __future__ import annotations

from .run import CONTENDERS, BenchResult, format_table, plot, run_bench, write_json

__all__ = ["CONTENDERS", "BenchResult", "format_table", "plot", "run_bench", "write_json"]
