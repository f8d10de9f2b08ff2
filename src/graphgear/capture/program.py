"""Inductor's generated Python ``call`` read as straight-line code: what a CPU graph needs
to replay it as a fixed list of kernel calls (``capture/cpu_graph``'s kernel-call
replay).

Plain ``ast`` reading of the source of the generated module's ``Runner.call``: the
source, the module's names, Inductor's wrapper names and what a generated C++ kernel
looks like come from :mod:`graphgear._torch.inductor`
(:func:`~graphgear._torch.inductor.inductor_generated_call`), where their version notes
are. A statement form this reader does not know makes it give None: the CPU graph then
runs the generated ``call`` itself on every replay (as fast as before, never wrong).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._torch.inductor import (
    INDUCTOR_ALLOC_NAMES,
    INDUCTOR_CHECK_NAMES,
    INDUCTOR_EXTERN_KERNELS,
    INDUCTOR_VIEW_NAME,
    inductor_generated_call,
    is_generated_kernel,
)

log = logging.getLogger(__name__)

__all__ = ["ArgSpec", "StraightLine", "inductor_straight_line"]


#: One argument of a call in a :class:`StraightLine`: ``("name", local)``, ``("value",
#: object)`` (a constant or a global of the generated module, resolved when read) or
#: ``("view", local, size, stride, offset)`` (an inline ``reinterpret_tensor``).
ArgSpec = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class StraightLine:
    """Inductor's generated Python ``call`` read as straight-line code: what a CPU graph
    needs to replay it as a fixed list of kernel calls (``capture/cpu_graph``).

    ``keep``: the indices of the caller's arguments passed on
    (``graphgear._torch.inductor.inductor_drop_args``), or None for all; ``params``: the
    local names the arguments are unpacked into;
    ``steps``: ``("alloc", name, size, stride, dtype)`` (one allocation, in order),
    ``("view", name, src, size, stride, offset)``, ``("alias", name, src)``,
    ``("del", names)``, ``("call", fn, args, kwargs)`` (a generated C++ kernel, or an
    ``extern_kernels`` function writing into ``out=``); ``outs``: the returned values as
    :data:`ArgSpec`; ``reinterpret``: the module's ``reinterpret_tensor``."""

    keep: tuple[int, ...] | None
    params: tuple[str, ...]
    steps: tuple[tuple[Any, ...], ...]
    outs: tuple[ArgSpec, ...]
    reinterpret: Callable[..., torch.Tensor]


class _NotStraight(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError as e:
        raise _NotStraight(ast.unparse(node)) from e


def _read_call_body(body: list[ast.stmt], g: Mapping[str, Any]) -> tuple[tuple[str, ...], list[Any], list[ArgSpec]]:
    params: tuple[str, ...] | None = None
    steps: list[Any] = []
    local: set[str] = set()
    outs: list[ArgSpec] | None = None

    def arg(node: ast.expr) -> ArgSpec:
        if isinstance(node, ast.Name):
            if node.id in local:
                return ("name", node.id)
            if node.id in g:
                return ("value", g[node.id])
            raise _NotStraight(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == INDUCTOR_VIEW_NAME:
            src, size, stride, offset = node.args
            if not isinstance(src, ast.Name) or src.id not in local or node.keywords:
                raise _NotStraight(ast.unparse(node))
            return ("view", src.id, _literal(size), _literal(stride), _literal(offset))
        return ("value", _literal(node))

    for st in body:
        if outs is not None:
            raise _NotStraight("code after return")
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            t, v = st.targets[0], st.value
            if isinstance(t, ast.Tuple) and isinstance(v, ast.Name) and v.id == "args" and params is None:
                if not all(isinstance(e, ast.Name) for e in t.elts):
                    raise _NotStraight(ast.unparse(st))
                params = tuple(e.id for e in t.elts)  # type: ignore[attr-defined]
                local.update(params)
                continue
            if not isinstance(t, ast.Name):
                raise _NotStraight(ast.unparse(st))
            if isinstance(v, ast.Name) and v.id in local:
                steps.append(("alias", t.id, v.id))
            elif isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in INDUCTOR_ALLOC_NAMES:
                size, stride, dtype = v.args
                if not (isinstance(dtype, ast.Attribute) and isinstance(dtype.value, ast.Name)
                        and dtype.value.id == "torch" and isinstance(getattr(torch, dtype.attr, None), torch.dtype)):
                    raise _NotStraight(ast.unparse(st))
                steps.append(("alloc", t.id, _literal(size), _literal(stride), getattr(torch, dtype.attr)))
            else:
                spec = arg(v)
                if spec[0] != "view":
                    raise _NotStraight(ast.unparse(st))
                steps.append(("view", t.id, *spec[1:]))
            local.add(t.id)
        elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            c = st.value
            f = c.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "args" \
                    and f.attr == "clear" and not c.args:
                continue
            if isinstance(f, ast.Name) and f.id in INDUCTOR_CHECK_NAMES:
                continue  # checks of the arguments: the CPU graph checks a rebound one itself
            if isinstance(f, ast.Name) and is_generated_kernel(g.get(f.id)) and not c.keywords:
                steps.append(("call", g[f.id], tuple(arg(a) for a in c.args), {}))
            elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                  and f.value.id == INDUCTOR_EXTERN_KERNELS and INDUCTOR_EXTERN_KERNELS in g
                  and any(k.arg == "out" and isinstance(k.value, ast.Name) for k in c.keywords)
                  and all(k.arg is not None for k in c.keywords)):
                fn = getattr(g[INDUCTOR_EXTERN_KERNELS], f.attr)
                steps.append(("call", fn, tuple(arg(a) for a in c.args),
                              {k.arg: arg(k.value) for k in c.keywords}))
            else:
                raise _NotStraight(ast.unparse(st))
        elif isinstance(st, ast.Delete):
            if not all(isinstance(e, ast.Name) and e.id in local for e in st.targets):
                raise _NotStraight(ast.unparse(st))
            names = tuple(e.id for e in st.targets)  # type: ignore[attr-defined]
            local.difference_update(names)
            steps.append(("del", names))
        elif isinstance(st, ast.Return) and isinstance(st.value, ast.Tuple):
            outs = [arg(e) for e in st.value.elts]
            if any(o[0] == "value" for o in outs):
                raise _NotStraight("returns a global or constant")
        else:
            raise _NotStraight(ast.unparse(st)[:80])
    if params is None or outs is None:
        raise _NotStraight("no argument unpacking or no return")
    return params, steps, outs


def inductor_straight_line(compiled: Any) -> StraightLine | None:
    """Inductor's generated Python ``call`` as a :class:`StraightLine`, or None where it
    is anything else (a C++ wrapper, a partitioned graph, an ATen call that returns new
    tensors, a collective, a profiler hook...): the CPU graph then runs the generated
    ``call`` itself on every replay.

    Reads the source of the generated module's ``Runner.call``
    (:func:`~graphgear._torch.inductor.inductor_generated_call`) and accepts only these
    statement forms, all checked on 2.13: ``a, b = args``; ``args.clear()``; ``buf =
    empty_strided_cpu(size, stride, torch.dtype)``; ``buf = reinterpret_tensor(src, size,
    stride, offset)``; ``buf = other``; ``del ...``; a call of a generated C++ kernel
    (positional arguments); ``extern_kernels.f(..., out=buf)``; ``assert_size_stride`` /
    ``assert_alignment``; ``return (...)`` of locals and their ``reinterpret_tensor``
    views. If Inductor's wrapper changes shape, this returns None (the CPU graph is then
    as fast as before, never wrong)."""
    gen = inductor_generated_call(compiled)
    if gen is None:
        return None
    g = gen.names
    try:
        tree = ast.parse(gen.source)
        body = tree.body[0]
        if not isinstance(body, ast.FunctionDef) or [a.arg for a in body.args.args] != ["self", "args"]:
            raise _NotStraight("not call(self, args)")
        params, steps, outs = _read_call_body(body.body, g)  # type: ignore[arg-type]
    except (_NotStraight, TypeError, SyntaxError, ValueError, AttributeError) as e:
        log.debug("graphgear: Inductor's wrapper is not straight-line code (%s: %s)", type(e).__name__, e)
        return None
    return StraightLine(keep=gen.keep, params=params, steps=tuple(steps), outs=tuple(outs),
                        reinterpret=g[INDUCTOR_VIEW_NAME])
