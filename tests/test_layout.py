"""The package's imports flow one way: backend → pipeline (stats, dumps, passes,
dispatch by shape) → one compiler per mode → the CPU passes → the post-grad passes →
graphgear's kernels → capture per device,
with shared leaves
(errors, the ``_torch`` package, config, context, stats, debug, shapes, gears) at the bottom. No cycle, no upward import,
no import deferred into a function body to hide one."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "graphgear"

#: Layers, bottom first. A module may import its own layer's modules and any layer
#: below; the layer of a module is that of its longest matching prefix.
LAYERS: list[set[str]] = [
    # the cache's folders and trust check import nothing of graphgear: capture uses them
    {"graphgear.errors", "graphgear._torch", "graphgear.cache.store",
     "graphgear.op_names",  # split_ops names checked against the registered ops
     "graphgear.option_tree"},  # Option and Section: the validated tree CompilerConfig is made of
    {"graphgear.config", "graphgear.stats", "graphgear.debug", "graphgear.context", "graphgear.datadump",
     "graphgear.dumpfiles", "graphgear.accuracy"},
    {"graphgear.option_checks"},  # options without effect in a mode, combinations that cannot work
    {"graphgear.shapes", "graphgear.inputs", "graphgear.gears",
     "graphgear.regions",  # a graph's repeated regions outlined into one shared subgraph
     "graphgear.cache.artifacts"},  # what a cache entry keeps of a graph: the compilers record into it
    {"graphgear.dispatch"},  # a graph's callables by key, the gear guard, precompile_gears
    {"graphgear.padding"},  # gear padding: its static hazard check and the padded call
    {"graphgear.capture"},
    {"graphgear.cpu.kernels"},  # graphgear's own C++ kernels: the passes put them in graphs
    {"graphgear.passes"},
    # the CPU passes of the static compile (they import the kernels and the pass manager;
    # the compilers run them), the copies of frozen weights they make
    {"graphgear.cpu"},
    {"graphgear.compilers"},
    {"graphgear.pipeline", "graphgear.cache.bundle"},  # graphgear's graph in AOTAutograd's bundled entry
    {"graphgear.backend"},
    # the rest of the cache (entry files, keys, precompile, cache_compile) and its __init__,
    # which runs before any of its submodules: graphgear/__init__ imports it first
    # (graphgear/cache/__init__.py says why)
    {"graphgear.cache"},
    {"graphgear.served"},  # a served model's calls (graphgear.inference.serve)
    {"graphgear.inference"},
    {"graphgear.bench"},  # an application of the library: the demo models and ``graphgear bench``
    {"graphgear", "graphgear.cli"},
]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in SRC.rglob("*.py"):
        parts = ["graphgear", *p.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _layer(mod: str) -> int:
    best, found = -1, -1
    for i, layer in enumerate(LAYERS):
        for name in layer:
            if (mod == name or mod.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    assert found >= 0, f"{mod} is in no layer of tests/test_layout.py: add it"
    return found


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported graphgear module, line, at module level) for every import in ``mod``,
    leaving out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for n in ast.walk(node)}
    top = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.Try | ast.If)
                                         for n in ast.walk(s)}
    out = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
            names = subs or ([target] if target in mods else [])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name in mods]
        for n in names:
            if n != mod:
                out.append((n, node.lineno, id(node) in top))
    return out


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_no_import_cycle() -> None:
    graph = {m: {n for n, _, _ in imps} for m, imps in _graph().items()}
    # a package's __init__ runs before its submodules: that edge is no cycle
    for m in graph:
        graph[m] = {n for n in graph[m] if not m.startswith(n + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_flow_downward_and_are_not_deferred() -> None:
    problems = []
    for mod, imps in sorted(_graph().items()):
        for target, line, at_top in imps:
            # the package a module lives in is no upward import, but a deferred import of
            # it hides a cycle all the same (its __init__ imports the module)
            if _layer(target) > _layer(mod) and not mod.startswith(target + "."):
                problems.append(f"{mod}:{line} imports {target} (upward)")
            elif not at_top:
                problems.append(f"{mod}:{line} imports {target} inside a function (deferred)")
    assert not problems, "\n".join(problems)


#: Private torch references: an underscored name anywhere under ``torch.`` (``torch._C``,
#: ``torch._inductor``, ``torch.utils._pytree``, ``torch.fx.experimental._config``; not
#: ``torch.ops.aten._foo``, which names an ATen op), an underscored name imported from a
#: torch module, and the private attributes graphgear reads through ``_torch`` (storage
#: ids, dynamo's placeholder metadata, the globals of Inductor's generated code).
_PRIVATE_TORCH = re.compile(
    r"\btorch(?:\.(?!ops\b)[A-Za-z]\w*)*\._[A-Za-z]"
    r"|\bfrom\s+torch[\w.]*\s+import\s+.*\b_[A-Za-z]"
    r"|\._cdata\b|\"grapharg\"|\bcurrent_callable\b|\b__globals__\b"
    # private attributes of public torch objects (ops, FX nodes, make_fx options)
    r"|\._schema\b|\._opname\b|\._overloadname\b|\._qualified_op_name\b|\._erased\b"
    r"|\b_allow_non_fake_inputs\b"
    r"|\b_boxed_call\b"
)

#: Patterns of private-looking torch names judged public, allowed anywhere. Empty on
#: purpose: ``torch._dynamo.mark_dynamic`` (documented, but under ``torch._dynamo``) goes
#: through ``_torch`` too, and dynamo's reset through the public ``torch.compiler.reset``.
_PUBLIC_ALLOWED: tuple[str, ...] = ()


def _code_lines(path: Path) -> list[str]:
    """The lines of ``path`` with strings, docstrings and comments blanked out."""
    src = path.read_text()
    lines = src.splitlines()
    blank = [list(line) for line in lines]
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        if tok.type == tokenize.STRING and tok.string.strip("rbuRBU").strip("'\"") == "grapharg":
            continue  # a dict key, not prose: keep it visible to the scan
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = blank[r - 1]
            lo = c0 if r == r0 else 0
            hi = c1 if r == r1 else len(row)
            row[lo:hi] = " " * (hi - lo)
    return ["".join(row) for row in blank]


def test_torch_package_reexports_nothing_and_imports_only_itself() -> None:
    """``graphgear/_torch/__init__.py`` is a docstring only (each name is imported from its
    submodule), and the submodules import no graphgear module outside the package."""
    init = ast.parse((SRC / "_torch" / "__init__.py").read_text())
    assert len(init.body) == 1 and isinstance(init.body[0], ast.Expr) \
        and isinstance(init.body[0].value, ast.Constant), "graphgear/_torch/__init__.py: a docstring only"
    outside = [f"{m} imports {n}" for m, imps in sorted(_graph().items()) if m.startswith("graphgear._torch.")
               for n, _, _ in imps if not n.startswith("graphgear._torch")]
    assert not outside, "\n".join(outside)


def test_private_torch_apis_only_in_torch_module() -> None:
    """Private torch APIs only under graphgear/_torch/: every private torch API is reached
    through the ``graphgear._torch`` package (issue 10), so a torch upgrade that moves one
    breaks in the module of its subsystem, with its version note."""
    torch_layer = SRC / "_torch"
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(torch_layer):
            continue
        rel = path.relative_to(SRC)
        for i, line in enumerate(_code_lines(path), 1):
            code = line
            for allowed in _PUBLIC_ALLOWED:
                code = re.sub(allowed, " ", code)
            if _PRIVATE_TORCH.search(code):
                found.append(f"src/graphgear/{rel}:{i}: {' '.join(line.split())}")
    assert not found, ("private torch APIs outside graphgear/_torch/ (add a wrapper there):\n"
                       + "\n".join(found))


#: Modules of the capture layer never reach back into what sits above it: the mode
#: compilers hand the engine its compiled code, dispatch calls ``precompile``.
_CAPTURE_NEVER_IMPORTS = ("graphgear.compilers", "graphgear.dispatch", "graphgear.pipeline",
                          "graphgear.backend", "graphgear.cache.function", "graphgear.cache.entry")


def test_capture_imports_no_compiler_and_no_dispatch() -> None:
    found = [f"{mod}:{line} imports {target}" for mod, imps in sorted(_graph().items())
             if mod.startswith("graphgear.capture")
             for target, line, _ in imps
             if any(target == n or target.startswith(n + ".") for n in _CAPTURE_NEVER_IMPORTS)]
    assert not found, "\n".join(found)


def test_no_module_over_500_lines() -> None:
    """One concept a module: a module past 500 lines holds several (split it)."""
    long = {f"src/graphgear/{p.relative_to(SRC)}": n for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
