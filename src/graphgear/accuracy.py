"""Finding the op that diverged: :func:`compare_dumps` and :func:`compare` (also
``graphgear.debug.compare`` and ``graphgear compare``).

:func:`compare_dumps` reads two data-dump folders (``debug.data_dump``; the first is the
reference) and compares every node output both hold, graph by graph in compile order,
call by call, node by node in graph order. A node diverges where
``|b - a| <= atol + rtol * |a|`` fails for some element (or its shape differs, or its
dtype where one of the two is not floating). The report names the first divergent node, with its op, its source line (the FX stack trace)
and its error, and the worst ones by relative error. The tolerances never go below a
tensor's own rounding: for a tensor of dtype ``d`` they are at least ``ROUNDING_ULPS *
eps(d)`` relative and that times the tensor's largest value absolute (bfloat16: 3.1 %,
float16: 0.39 %; float32: 4.8e-7, below the default ``rtol``), so two correct
low-precision runs that round in a different order do not diverge. Dumps of two dtypes (a
bfloat16 run against a float32 reference) compare by value, at the coarser dtype's floor.

:func:`compare` does the whole job for a model and its inputs: it runs the model eagerly
and compiled in the chosen mode (their outputs compared end to end), then twice more with
a data dump, at stage ``"original"`` (the graph as AOTAutograd gives it, before
graphgear's passes) and ``"optimized"`` (after them), and compares the two dumps. A user
pass, or one of graphgear's, that changes a value is found at the node it changed.
Inductor's generated kernels are not node by node: a difference inside them shows only
in the end-to-end comparison.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import reprlib
import tempfile
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .config import CompilerConfig, apply_options
from .datadump import INDEX
from .dumpfiles import text_table
from .errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["CompareReport", "NodeDiff", "compare", "compare_dumps"]

DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-4
#: the least tolerance, in units of the dtype's machine epsilon (see the module docstring):
#: a compiled bfloat16 Llama differs from eager by up to 0.7 eps of its logits' scale, with
#: kernels that round once where eager rounds after every op
ROUNDING_ULPS = 4


@dataclasses.dataclass
class NodeDiff:
    """How one node's output differs between two dumps."""

    graph: str
    call: int
    node: str
    op: str
    source: str
    max_abs: float  # the largest elementwise |b - a|
    rel: float  # max_abs over the largest |a|
    shape: list[int]
    diverged: bool


@dataclasses.dataclass
class CompareReport:
    """What :func:`compare_dumps` (or :func:`compare`) found; ``str()`` is the readable report."""

    atol: float
    rtol: float
    compared: int = 0
    first: NodeDiff | None = None
    worst: list[NodeDiff] = dataclasses.field(default_factory=list)
    unmatched: list[str] = dataclasses.field(default_factory=list)  # reference nodes the other lacks
    output_max_abs: float | None = None  # compare(): compiled model output vs eager
    output_rel: float | None = None
    output_diverged: bool = False

    @property
    def diverged(self) -> bool:
        return self.first is not None or self.output_diverged

    def __str__(self) -> str:
        verdict = "diverged" if self.diverged else "no divergence"
        lines = [f"graphgear compare: {self.compared} node outputs compared (atol {self.atol:g}, "
                 f"rtol {self.rtol:g}): {verdict}"]
        if self.first is not None:
            f = self.first
            lines += [f"first divergent node: {f.node} ({f.op}) in {f.graph}, call {f.call}",
                      f"  source: {f.source or '(no stack trace)'}",
                      f"  max abs error {f.max_abs:.3g}, relative {f.rel:.3g}, shape {f.shape}"]
        if self.worst:
            rows = [[d.node, d.op, f"{d.max_abs:.3g}", f"{d.rel:.3g}", "yes" if d.diverged else "no",
                     d.source[-60:]] for d in self.worst]
            lines += ["worst nodes:", text_table(["node", "op", "max abs", "relative", "diverged", "source"],
                                                 rows)]
        if self.output_max_abs is not None:
            lines.append(f"compiled outputs and written state vs eager: max abs error {self.output_max_abs:.3g}, relative "
                         f"{self.output_rel:.3g}{' (diverged)' if self.output_diverged else ''}")
        if self.unmatched:
            lines.append(f"{len(self.unmatched)} reference node outputs or graphs have no counterpart (passes "
                         f"removed or renamed them, or the runs made other graphs): {', '.join(self.unmatched[:8])}"
                         f"{' ...' if len(self.unmatched) > 8 else ''}")
        return "\n".join(lines)


def _eps(t: torch.Tensor) -> float:
    return torch.finfo(t.real.dtype if t.is_complex() else t.dtype).eps


def _diff(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool]:
    """How ``b`` differs from the reference ``a``: (max abs error, that over ``a``'s
    largest value, diverged). Floating tensors of two dtypes (a bfloat16 run against a
    float32 reference) compare by value, at the coarser dtype's rounding floor."""
    floating = (a.dtype.is_floating_point and b.dtype.is_floating_point) or (a.is_complex() and b.is_complex())
    if a.shape != b.shape or (a.dtype != b.dtype and not floating):
        return float("inf"), float("inf"), True
    if not floating:
        bad = bool((a != b).any())
        return (1.0, 1.0, True) if bad else (0.0, 0.0, False)
    if a.numel() == 0:
        return 0.0, 0.0, False
    floor = ROUNDING_ULPS * max(_eps(a), _eps(b))
    x, y = a.double(), b.double()
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))  # equal infinities and NaNs agree
    err = torch.where(same, torch.zeros_like(x), (y - x).abs())
    err = torch.nan_to_num(err, nan=float("inf"))
    max_abs = float(err.max())
    scale = float(torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).max())
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    atol, rtol = max(atol, floor * scale), max(rtol, floor)
    diverged = bool((err > atol + rtol * x.abs().nan_to_num(nan=0.0)).any())
    return max_abs, rel, diverged


def _graphs(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        raise ConfigError(f"graphgear compare: {folder!r} is not a folder; give two folders a data dump "
                          f"(debug.data_dump.path) wrote.")
    found = sorted(d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, INDEX)))
    if not found:
        raise ConfigError(f"graphgear compare: {folder!r} holds no data dump (no <graph>/{INDEX} in it); "
                          f"dump into it with debug.data_dump.enabled=True and debug.data_dump.path.")
    return found


def _index(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, INDEX)) as f:
        return json.load(f)  # type: ignore[no-any-return]


def _load(folder: str, name: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(folder, name), weights_only=True)  # type: ignore[no-any-return]


def compare_dumps(reference: str, other: str, *, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
                  top: int = 5) -> CompareReport:
    """Compare two data-dump folders (see the module docstring); graphs are paired in
    compile order, calls by number, nodes by name."""
    report = CompareReport(atol=atol, rtol=rtol)
    diffs: list[NodeDiff] = []
    graphs_a, graphs_b = _graphs(reference), _graphs(other)
    for extra in graphs_a[len(graphs_b):]:
        report.unmatched.append(f"{extra} (the other dump has {len(graphs_b)} graphs)")
    for ga, gb in zip(graphs_a, graphs_b):
        da, db = os.path.join(reference, ga), os.path.join(other, gb)
        ia, ib = _index(da), _index(db)
        nodes = {n["name"]: n for n in ia["nodes"]}
        ops_b = {n["name"]: n["op"] for n in ib["nodes"]}
        calls_b = {c["call"]: c["file"] for c in ib["calls"]}
        for call in sorted(ia["calls"], key=lambda c: c["call"]):
            if call["call"] not in calls_b:
                continue
            ta, tb = _load(da, call["file"]), _load(db, calls_b[call["call"]])
            for name in (n["name"] for n in ia["nodes"]):
                if name not in ta:
                    continue
                if name not in tb or ops_b.get(name) != nodes[name]["op"]:  # absent, or another op
                    if f"{ga}:{name}" not in report.unmatched:
                        report.unmatched.append(f"{ga}:{name}")
                    continue
                max_abs, rel, bad = _diff(ta[name], tb[name], atol, rtol)
                d = NodeDiff(ga, call["call"], name, nodes[name]["op"], nodes[name]["source"], max_abs, rel,
                             list(ta[name].shape), bad)
                report.compared += 1
                diffs.append(d)
                if bad and report.first is None:
                    report.first = d
    report.worst = sorted((d for d in diffs if d.max_abs > 0), key=lambda d: -d.rel)[:top]
    return report


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if hasattr(x, "to_tuple"):  # transformers' ModelOutput
        x = x.to_tuple()
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list | tuple):
        return [t for item in x for t in _flat(item)]
    return []


def _options(config: CompilerConfig) -> dict[str, Any]:
    return dict(iter(config))


#: how deep :func:`_held_tensors` follows attributes, lists, tuples and dicts
_MAX_STATE_DEPTH = 8
#: values that hold no tensor (not followed)
_NO_TENSORS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size,
               type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _held_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through its attributes (``__dict__`` and
    ``__slots__``), lists, tuples and dicts, each once, in a fixed order (attributes and
    dict entries in insertion order, items in sequence order, depth first): a
    transformers ``Cache``'s layers' keys, values and position counters
    (``StaticLayer.cumulative_length``), found without importing transformers."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(x: Any, depth: int) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
            return
        if depth > _MAX_STATE_DEPTH or isinstance(x, _NO_TENSORS):
            return
        if isinstance(x, Mapping):
            items: list[Any] = list(x.values())
        elif isinstance(x, list | tuple):
            items = list(x)
        else:
            attrs = getattr(x, "__dict__", None)
            items = list(attrs.values()) if isinstance(attrs, dict) else []
            for klass in type(x).__mro__:
                slots = klass.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                        items.append(getattr(x, name))
        for item in items:
            walk(item, depth + 1)

    walk(obj, 0)
    return out


def _state_tensors(model: Any, inputs: Sequence[Any], state: Any) -> list[torch.Tensor]:
    """The tensors a run may write in place, restored before each of :func:`compare`'s
    runs: ``state`` when given (a tensor, a list or tuple of tensors, or an object that
    holds them, such as a transformers ``Cache``: :func:`_held_tensors`), else the tensors
    in ``inputs`` and, for a module, its buffers (a KV cache kept in buffers)."""
    if state is None:
        out = _flat(list(inputs))
        if isinstance(model, torch.nn.Module):
            out += list(model.buffers())
        return out
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, list | tuple):
        bad = [type(t).__name__ for t in state if not isinstance(t, torch.Tensor)]
        if bad:
            raise ConfigError(f"graphgear: compare(state=...) takes tensors, or one object that holds them; got "
                              f"a {type(state).__name__} holding {', '.join(bad)}. Pass the tensors the model "
                              "writes in place, or the object itself (state=cache for a transformers Cache).")
        return list(state)
    tensors = _held_tensors(state)
    if not tensors:
        raise ConfigError(f"graphgear: compare(state=...) got {type(state).__name__} {reprlib.repr(state)}, "
                          "which holds no tensor; state takes the tensors the model writes in place, as a "
                          "list (state=[cache_tensor]), or an object that holds them (state=cache for a "
                          "transformers Cache after its first call, when it holds its tensors).")
    return tensors


def _check_inputs(inputs: Any) -> None:
    """``inputs`` is a list or tuple of ``model``'s positional arguments."""
    if not isinstance(inputs, list | tuple):
        what = (f"a Tensor of shape {list(inputs.shape)}" if isinstance(inputs, torch.Tensor)
                else f"{type(inputs).__name__} {reprlib.repr(inputs)}")
        raise TypeError(f"graphgear: compare(model, inputs) takes the model's positional arguments as a "
                        f"list or tuple, got {what}. Pass compare(model, [x]) for one input, "
                        "compare(model, [x, y]) for two.")


def compare(model: Callable[..., Any], inputs: Sequence[Any], *, config: CompilerConfig | None = None,
            mode: str | None = None, options: dict[str, Any] | None = None, atol: float = DEFAULT_ATOL,
            rtol: float = DEFAULT_RTOL, top: int = 5, workdir: str | None = None,
            state: Any = None) -> CompareReport:
    """Run ``model(*inputs)`` eagerly and through graphgear in ``config``'s mode (``mode``
    and ``options`` change it; in reduce-overhead until the captured graph has replayed:
    ``warmup_iters + 2`` calls), compare the outputs of every call, then dump and compare
    every node of the graphs before and after graphgear's passes (see the module
    docstring); returns the report (``report.diverged``). ``inputs`` is a list or tuple
    of the model's positional arguments. Each run starts from the same state: the tensors
    of ``state`` (default: the tensors among ``inputs`` and, for a module, its buffers,
    where a KV cache lives) are copied before the first run, put back before each later
    one, and left as the eager run wrote them. State kept elsewhere (a transformers
    ``StaticCache`` object, a closure) needs ``state=``: a list or tuple of tensors, or an
    object that holds them (``state=cache``: every tensor reachable through its
    attributes, lists, tuples and dicts, so a ``StaticCache``'s keys, values and
    ``cumulative_length`` all). The dumps go to
    ``workdir`` (kept) or a temporary folder (removed). Calls ``torch.compiler.reset()``
    before each compile."""
    config = (config or CompilerConfig()).copy()
    if mode is not None:
        config.mode = mode
    apply_options(config, options)
    _check_inputs(inputs)
    inputs = list(inputs)
    tensors = _state_tensors(model, inputs, state)
    with torch.no_grad():
        start = [t.clone() for t in tensors]

        def restore() -> None:
            for t, v in zip(tensors, start):
                t.copy_(v)

        expected = [t.clone() for t in _flat(model(*inputs))]
        after_eager = [t.clone() for t in tensors]
        restore()
        torch.compiler.reset()
        compiled = torch.compile(model, backend="graphgear", options=_options(config))
        # reduce-overhead runs a graph uncaptured for its warm-up, then captures it: the
        # calls go on until one has replayed, and each is compared with eager
        calls = config.capture_config.warmup_iters + 2 if config.mode == "reduce-overhead" else 1
        runs: list[list[torch.Tensor]] = []
        state_diff: list[tuple[float, float, bool]] = []
        for _ in range(calls):
            restore()
            runs.append([t.clone() for t in _flat(compiled(*inputs))])
            state_diff += [_diff(e, t, atol, rtol) for e, t in zip(after_eager, tensors)]
        with tempfile.TemporaryDirectory(prefix="graphgear-compare-") as tmp:
            root = workdir or tmp
            folders = {}
            for stage in ("original", "optimized"):
                dumped = config.copy()
                for path, value in CompilerConfig().capture_config:  # a dump captures nothing
                    apply_options(dumped, {path: value})
                folders[stage] = os.path.join(root, stage)
                apply_options(dumped, {"debug.data_dump.enabled": True, "debug.data_dump.stage": stage,
                                       "debug.data_dump.path": folders[stage]})
                restore()
                torch.compiler.reset()
                torch.compile(model, backend="graphgear", options=_options(dumped))(*inputs)
            torch.compiler.reset()
            for t, v in zip(tensors, after_eager):
                t.copy_(v)
            report = compare_dumps(folders["original"], folders["optimized"], atol=atol, rtol=rtol, top=top)
    worst = (0.0, 0.0, False)
    for got in runs:
        for e, g in zip(expected, got):
            d = _diff(e.detach().cpu(), g.detach().cpu(), atol, rtol)
            worst = (max(worst[0], d[0]), max(worst[1], d[1]), worst[2] or d[2])
    for d in state_diff:  # what the compiled run wrote into the state vs the eager run
        worst = (max(worst[0], d[0]), max(worst[1], d[1]), worst[2] or d[2])
    report.output_max_abs, report.output_rel, report.output_diverged = worst
    if any(len(expected) != len(got) for got in runs):
        report.output_diverged = True
    return report
