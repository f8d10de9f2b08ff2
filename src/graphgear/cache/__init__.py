"""A compile cache: a restarted process serves without tracing or compiling.

:func:`~graphgear.cache.function.cache_compile` (``graphgear.inference.cache_compile``) wraps a function or an
``nn.Module``. On a call with an input spec it has no entry for, it builds the cache key,
and either loads a trusted entry (``stats()``: ``cache="hit"``) or compiles with torch
2.13's precompile (``torch.compile(fn, fullgraph=True).aot_compile(...)``) and stores the
result (``"stored"``).

**What is stored** (one file per key and module state: a state the first entry's guards
reject is a variant, ``<name>-<key>-v<n>.ggc``, up to four), all through torch's own formats:

* torch's ``save_compiled_function`` payload: dynamo's transformed bytecode and guards;
* as the backend's part of it, AOTAutograd's *bundled* entry of each graph (the runtime
  metadata and wrappers AOTAutograd puts around the compiled code; ``_torch.serialize.aot_bundling``),
  whose compiled graph is graphgear's :class:`~graphgear.cache.bundle.GraphgearOutputCode`;
* in it, the graph's :class:`~graphgear.cache.artifacts.ArtifactStore`: the graph after
  graphgear's passes (``GraphPickler``), and per graph key (each gear) Inductor's
  compiled graph (``CompiledFxGraph``: generated source and metadata; one per captured
  piece of a piecewise key), recorded as the keys are compiled. ``frozen_parameter`` keys
  are not stored (their code holds the
  weights' values, which the key does not cover).

**What a later process does**: no dynamo trace, no AOTAutograd trace, no passes, no
specialisation, no Inductor compile for a stored key: AOTAutograd's wrappers are rebuilt
from the entry, graphgear's dispatch from the store, each key's generated module is
imported from Inductor's code cache (its C++ kernels loaded from Inductor's on-disk
cache by the hash of their source, compiled when missing). Device graphs are captured
again (they cannot be saved).

**The modules**, bottom first (their layers are in ``tests/test_layout.py``):

* :mod:`~graphgear.cache.store`: the folders (the cache's, the private Inductor cache)
  and the one trust check of a folder or an entry file; it imports nothing of graphgear;
* :mod:`~graphgear.cache.artifacts`: what an entry keeps of one graph, and the
  allow-list of globals its unpickler accepts (the mode compilers record into it);
* :mod:`~graphgear.cache.bundle`: graphgear's compiled graph in AOTAutograd's bundled
  entry (the backend builds it, with the pipeline's ``rebuild_graph``);
* :mod:`~graphgear.cache.entry` (the file format, trusted reading, writing),
  :mod:`~graphgear.cache.key` (what a key is made of),
  :mod:`~graphgear.cache.precompile` (torch's precompile around the backend) and
  :mod:`~graphgear.cache.function` (:func:`cache_compile`), above the backend.

**Import order.** This package's ``__init__`` imports only the low submodules (store,
entry, artifacts), never :mod:`~graphgear.cache.function`, which sits above the backend:
the lower layers that import ``graphgear.cache.store`` or ``graphgear.cache.artifacts``
run this ``__init__`` first, and it must not reach back up to them. ``cache_compile`` is
``graphgear.inference.cache_compile`` (or ``graphgear.cache.function.cache_compile``).
"""

from __future__ import annotations

from .artifacts import allowed_global
from .entry import CacheEntry, clear_entries, list_entries
from .store import cache_folder

__all__ = ["CacheEntry", "allowed_global", "cache_folder", "clear_entries", "list_entries"]
