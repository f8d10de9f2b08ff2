"""``mode="reduce-overhead"``'s capture layer: capture each static graph's compiled code
once per graph key into a device graph, then replay it.

Modules: :mod:`.engine` (the device-neutral engine: one per static graph), :mod:`.entry`
(one capture), :mod:`.executor` (the compiled code an engine runs, made by the mode
compiler before the engine exists), :mod:`.devices` (the device graphs by device type:
``cpu_graph``, graphgear's own; ``cuda_graph``, ``torch.cuda.CUDAGraph``; ``npu_graph``,
``torch.npu.NPUGraph``), :mod:`.group` (what the engines of one FX graph share: pool,
capture count), :mod:`.pool`, :mod:`.liveness` and :mod:`.steps` (memory, stale outputs, steps),
:mod:`.rules` (what cannot be captured), :mod:`.failures` (what happens then),
:mod:`.program` (Inductor's generated code read as a list of kernel calls). This layer
imports no compiler: the mode compiler that uses it is
``graphgear.compilers.reduce_overhead``.

The rules every capture follows (DESIGN.md):

* **key**: the graph key (fixed per engine) plus the addresses of the static inputs: a
  parameter that moved gets a capture of its own. With ``frozen_parameter`` addresses
  are promised fixed and left out; the key holds which tensors the static inputs are
  instead (two instances of one model class share dynamo's graph: each gets captures,
  and where the code holds the weights' values, compiled code of its own).
* **static inputs** (parameters, buffers, ``mark_static_address``) are bound at capture
  and never copied. **Mutated inputs** (KV caches) are used in place, never copied. When
  one moves (a new cache), the CPU graph rebinds it (no new record, no compile); a CUDA
  or NPU graph, whose addresses are baked in, gets a capture of its own for that address
  (the compiled code is reused: no re-trace, no recompile), and a capture whose bound
  inputs have died is released with its memory. **Other inputs** are copied into the
  capture's static buffers before each replay (``clone_input``; with
  ``clone_input=False`` they are bound in place like mutated inputs). An input that is a
  live output of this pool (an output fed back in) is copied first.
* **threads**: each thread has its own captures and its own memory (an arena of the
  pool), so a replay in one thread never overwrites another thread's outputs.
* **warm-up**: ``warmup_iters`` uncaptured runs per capture before it is captured.
* **capture_limit**: at most that many live captures per FX graph (all keys and threads
  together), checked when a capture is about to be made; past it, new keys run
  uncaptured, with one warning and a ``stats()`` fallback entry.
* **outputs** live in the pool and are overwritten by the next replay in that pool;
  each is handed out through an alias whose storage the next replay in that memory
  poisons, so reading a stale output, or any view of it, raises ``RuntimeError`` naming
  the fix (``liveness``); a replay in the same top-level call (``steps``: a block called
  twice in one forward) while that call's outputs are alive runs in a second capture
  with memory of its own (a lane of the pool) instead. ``clone_output`` returns fresh tensors (always done for
  training graphs, whose outputs are saved for backward or become gradients, and
  outlive the next replay, and where this process cannot poison storages).
* **what cannot be captured** (``rules.UNCAPTURABLE``: ``.item()``, data-dependent
  shapes, random numbers outside CUDA; CPU work inside a device graph; a capture that
  fails) follows ``fallback``: ``"eager"`` runs the graph uncaptured with one warning,
  ``"raise"`` raises :class:`graphgear.CaptureError`; ``stats()`` names op and reason.
  A capture that fails while running the graph first restores the inputs it mutated,
  so mutations happen exactly once; an error the graph raises by itself (it raises
  again when run uncaptured) reaches the caller unchanged.

The engine compiles nothing. The mode compiler hands it the compiled code
(:class:`~graphgear.capture.executor.Executor`) and the device graph's kind
(:class:`~graphgear.capture.devices.DeviceKind`: CPU, CUDA, NPU); each capture is a
device graph of that kind on that code. Where the code holds the static inputs' values
(``frozen`` code: the parameters' values), the executor makes one per set of static
inputs, and again when those parameters were written in place since
(``load_state_dict``, an in-place update: their version counters moved): the engine then
drops their captures and the key warms up and captures again, so every gear sees the new
weights, as the uncaptured graph would. Static buffers stay inputs of frozen code, so
writing one between calls (a position counter) recompiles nothing.

**reset from another thread** (``graphgear.reset()`` while a thread is inside a call):
the call completes correctly. A replay whose graph was released before it ran runs the
graph uncaptured (``replay()`` returns None); one already running completes on what it
read; a capture completes in its thread's old arena; an output handed out into a
released arena keeps its memory until it dies (the arena hands it to
``liveness.KEEPER``), and nothing writes that memory again.
"""

from __future__ import annotations

from .devices import DEVICE_KINDS, DeviceGraph, DeviceKind, device_kind
from .engine import CaptureEngine
from .executor import Executor
from .failures import UncapturedGraph
from .group import CaptureGroup
from .pool import MemoryPool
from .rules import find_uncapturable, graph_device

__all__ = ["DEVICE_KINDS", "CaptureEngine", "CaptureGroup", "DeviceGraph", "DeviceKind", "Executor",
           "MemoryPool", "UncapturedGraph", "device_kind", "find_uncapturable", "graph_device"]
