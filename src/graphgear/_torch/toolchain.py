"""Inductor's C++ toolchain as this machine gives it (``torch._inductor.cpp_builder``,
``torch._inductor.cpu_vec_isa``, ``torch._inductor.runtime.cache_dir_utils``): the C++
compiler it would call, the CPU vector ISA it picks, and its default cache folder.

``graphgear env`` reports these; nothing on a compile path calls them. Each answers
None where this torch has no such name (another version) or the probe fails, so the
report never crashes on a missing piece.

Checked on 2.13 (CPU build); other versions not checked: the names are those
Inductor's own C++ builds use in 2.13 (``CppBuilder`` calls ``get_cpp_compiler``; its
kernels' ``VecISA`` comes from ``pick_vec_isa``).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

__all__ = ["inductor_cpp_compiler", "inductor_default_cache_dir", "inductor_pick_vec_isa"]


def inductor_cpp_compiler() -> str | None:
    """The C++ compiler Inductor would build its CPU kernels with (``config.cpp.cxx``,
    else ``$CXX``, else ``g++``: the first that answers ``--version``), or None when it
    finds none. Checked on 2.13 (``cpp_builder.get_cpp_compiler``)."""
    try:
        from torch._inductor import cpp_builder

        return str(cpp_builder.get_cpp_compiler())
    except Exception as e:  # InvalidCxxCompiler (none found), or another torch
        log.debug("graphgear: no C++ compiler for Inductor (%s: %s)", type(e).__name__, e)
        return None


def inductor_pick_vec_isa() -> str | None:
    """The CPU vector ISA Inductor compiles its kernels for on this machine (e.g.
    ``"avx512"``), ``""`` when it falls back to scalar code (no ISA passed its probe:
    no compiler, or a CPU without one), or None when it cannot be asked. Runs Inductor's
    probes when this process has not yet (a small C++ build per candidate ISA, about
    0.6 s each on 2 cores). Checked on 2.13 (``cpu_vec_isa.pick_vec_isa``; its
    ``invalid_vec_isa`` is falsy)."""
    try:
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
        return str(isa) if isa else ""
    except Exception as e:  # another torch, or a probe that raised
        log.debug("graphgear: cannot ask Inductor for its vector ISA (%s: %s)", type(e).__name__, e)
        return None


def inductor_default_cache_dir() -> str | None:
    """The folder Inductor caches into when ``$TORCHINDUCTOR_CACHE_DIR`` is unset (under
    the shared temporary directory), without creating it. Checked on 2.13
    (``cache_dir_utils.default_cache_dir``)."""
    try:
        from torch._inductor.runtime import cache_dir_utils

        return str(cache_dir_utils.default_cache_dir())
    except Exception as e:  # another torch
        log.debug("graphgear: cannot read Inductor's default cache folder (%s: %s)", type(e).__name__, e)
        return None
