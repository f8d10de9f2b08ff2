"""Inductor's CPU vector ISA (``torch._inductor.cpu_vec_isa``, ``torch._inductor.config.cpp``):
the ISA it picked in this process, and a recorded one handed back to it so it skips its
base probes on a compile-cache hit.

Checked on 2.13 (CPU build); other versions not checked. If the names moved, nothing is
recorded and Inductor probes as usual (about 0.6 s per probe on a 2-core machine before
the first C++ kernel of a process); each function has its note.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["adopt_vec_isa", "inductor_vec_isa_if_known"]


def inductor_vec_isa_if_known() -> str | None:
    """The CPU vector ISA Inductor picked in this process (``str(pick_vec_isa())``, e.g.
    ``"avx512"``), or None when it has not probed yet (``valid_vec_isa_list`` not cached)
    or this is not an x86 CPU. Checked on 2.13 (``torch._inductor.cpu_vec_isa``); other
    versions not checked: if the names moved, None."""
    try:
        from torch._inductor import cpu_vec_isa

        if not _x86() or not _isa_probed(cpu_vec_isa):
            return None
        return str(cpu_vec_isa.pick_vec_isa())
    except (ImportError, AttributeError) as e:  # another torch: record nothing
        log.debug("graphgear: cannot read Inductor's vector ISA (%s)", e)
        return None


def adopt_vec_isa(recorded: str | None) -> bool:
    """Let Inductor skip its base ISA probes when a trusted record says which ISA it
    picked on this machine before; True when it did.

    Inductor decides which vector ISA to compile for by building a probe library per
    ISA and ``dlopen``-ing each in a child Python (``VecISA.check_build``): on a 2-core
    machine each child loads libtorch, about 0.6 s, four of them before the first C++
    kernel of a process can be looked up, cached or not. A compile-cache hit has the
    storing process's answer (``recorded``): when this CPU's flags make the same ISA the
    best candidate, Inductor's list is computed once with ``cpp.vec_isa_ok=True`` (its own
    switch that trusts the base probe; the AVX-512 bf16/VNNI and AMX extra probes still
    run) and must come out as ``recorded``. Nothing changes when Inductor already probed,
    when ``ATEN_CPU_CAPABILITY``, ``cpp.simdlen`` or ``cpp.vec_isa_ok`` steer it, or on
    other CPUs. Checked on 2.13 (``x86_isa_checker``, ``supported_vec_isa_list``,
    ``valid_vec_isa_list``); other versions not checked: if the names moved, False
    (Inductor probes as usual)."""
    try:
        return _adopt_vec_isa(recorded)
    except (ImportError, AttributeError) as e:  # another torch: Inductor probes as usual
        log.debug("graphgear: cannot hand Inductor a recorded vector ISA (%s)", e)
        return False


def _x86() -> bool:
    import platform

    return platform.machine() in ("x86_64", "AMD64")


def _isa_probed(cpu_vec_isa: Any) -> bool:
    """Whether Inductor already computed its vector-ISA list in this process."""
    return bool(cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)


def _adopt_vec_isa(recorded: str | None) -> bool:
    import os

    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa

    if (not recorded or not _x86() or os.environ.get("ATEN_CPU_CAPABILITY")
            or inductor_config.cpp.simdlen is not None or inductor_config.cpp.vec_isa_ok is not None
            or _isa_probed(cpu_vec_isa)):
        return False
    flags = cpu_vec_isa.x86_isa_checker()
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    if not candidates or str(candidates[0]) != recorded:
        return False
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        picked = str(cpu_vec_isa.pick_vec_isa())
    if picked != recorded:  # an extra probe failed here: the kernels' keys differ, they compile
        log.info("graphgear: Inductor picked vector ISA %s, the cache entry recorded %s", picked, recorded)
    return picked == recorded
