"""The documentation agrees with the code, and its snippets run as written.

* **Configuration reference**: docs/reference/configuration.md is what
  ``scripts/gen_config_docs.py`` renders from ``graphgear.config``.
* **API reference**: docs/reference/api.md has a section for every public name
  (``graphgear.__all__``, ``graphgear.inference.__all__``), naming each parameter, and
  mentions every CLI command and option.
* **Troubleshooting**: docs/troubleshooting.md shows every message graphgear raises or
  warns with, by a stable key (see :func:`source_messages`).
* **Snippets**: every ```python block of README.md and docs/**/*.md runs as written (the
  convention is in :func:`parse_blocks` and :func:`match_output`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import graphgear
from graphgear.cache.store import INDUCTOR_ENV_VAR

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "graphgear"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIG_PAGE = DOCS / "reference" / "configuration.md"
API_PAGE = DOCS / "reference" / "api.md"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
SNIPPET_TIMEOUT = 600


# --------------------------------------------------------------------------------------
# configuration reference


def _gen_config_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_generated_from_config() -> None:
    gen = _gen_config_docs()
    expected = gen.render()
    current = CONFIG_PAGE.read_text() if CONFIG_PAGE.exists() else ""
    if current != expected:
        diff = "".join(difflib.unified_diff(
            current.splitlines(keepends=True), expected.splitlines(keepends=True),
            "docs/reference/configuration.md (committed)", "generated from src/graphgear/config.py"))
        pytest.fail("docs/reference/configuration.md disagrees with src/graphgear/config.py; "
                    f"regenerate it: {gen.REGENERATE}\n{diff[:6000]}")


def test_configuration_page_lists_every_option() -> None:
    """The generator itself leaves no option out: each dotted path, its default and its
    description are on the page."""
    from graphgear.config import CompilerConfig

    text = _gen_config_docs().render()
    for path, opt in CompilerConfig.option_paths().items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"no row for option {path}"
        assert repr(opt.default) in row, (path, row)
        assert opt.doc.split()[1] in row, (path, row)


# --------------------------------------------------------------------------------------
# API reference


def _sections(text: str) -> dict[str, str]:
    """Each Markdown heading line -> the text under it (up to the next heading)."""
    out: dict[str, str] = {}
    heading, body = "", []
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,6} ", line):
            out[heading] = "\n".join(body)
            heading, body = line, []
        else:
            body.append(line)
    out[heading] = "\n".join(body)
    return out


def _public_names() -> list[tuple[str, object]]:
    names = [(f"graphgear.{n}", getattr(graphgear, n)) for n in graphgear.__all__]
    inference_all = getattr(graphgear.inference, "__all__", [])
    names += [(f"graphgear.inference.{n}", getattr(graphgear.inference, n)) for n in inference_all]
    return names


def test_api_page_covers_every_public_name() -> None:
    """Each name of ``graphgear.__all__`` and ``graphgear.inference.__all__`` has a heading
    of its own, and each parameter of a function or class is named in its section."""
    import inspect

    sections = _sections(API_PAGE.read_text())
    missing, params = [], []
    for full, obj in _public_names():
        heading = next((h for h in sections if re.search(rf"`{re.escape(full)}\b(?!\.)", h)), None)
        if heading is None:
            missing.append(full)
            continue
        if callable(obj) and not isinstance(obj, ModuleType):
            try:
                sig = inspect.signature(obj)
            except (TypeError, ValueError):
                continue
            body = heading + "\n" + sections[heading]
            params += [f"{full}: {p}" for p in sig.parameters
                       if p not in ("self", "args", "kwargs") and not p.startswith("_")
                       and not re.search(rf"\b{p}\b", body)]
    assert not missing, f"docs/reference/api.md has no heading for: {', '.join(missing)}"
    assert not params, f"docs/reference/api.md does not name these parameters: {', '.join(params)}"


def test_api_page_names_the_error_classes_and_version() -> None:
    text = API_PAGE.read_text()
    for name in ("graphgear.__version__", "graphgear.GraphgearError", "graphgear.ConfigError",
                 "graphgear.GearError", "graphgear.CaptureError", "graphgear.stats"):
        assert f"`{name}" in text, name


def _cli_commands() -> Iterator[tuple[str, list[str]]]:
    """``(command, its option strings)`` for ``graphgear`` and every sub-command."""
    import argparse

    from graphgear.cli import _parser

    def walk(parser: argparse.ArgumentParser, prefix: str) -> Iterator[tuple[str, list[str]]]:
        opts = [s for a in parser._actions if a.help is not argparse.SUPPRESS
                for s in a.option_strings if s.startswith("--") and s != "--help"]
        yield prefix, opts
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{prefix} {name}")

    yield from walk(_parser(), "graphgear")


def test_api_page_covers_every_cli_command_and_option() -> None:
    sections = _sections(API_PAGE.read_text())
    lacking = []
    for command, opts in _cli_commands():
        # the heading that names this command itself, not one of its sub-commands
        heading = next((h for h in sections if re.search(rf"`{re.escape(command)}(`| -| \[)", h)), None)
        if heading is None:
            lacking.append(f"no heading for `{command}`")
            continue
        body = sections[heading]
        lacking += [f"{command} {o}" for o in opts if not re.search(rf"{re.escape(o)}\b", heading + body)]
    assert not lacking, "docs/reference/api.md lacks: " + "; ".join(lacking)


# --------------------------------------------------------------------------------------
# troubleshooting: the messages in the source

#: a key's literal text: at least ``KEY_MIN`` characters where the message has them, at
#: most ``KEY_MAX`` (see :func:`stable_key`)
KEY_MIN, KEY_MAX = 20, 60
#: receivers of logging calls, and the logging methods that carry a message
_LOGGERS = {"log", "logger", "_log", "LOG", "logging"}
_LOG_METHODS = {"warning", "warn", "error", "critical", "exception"}
#: calls whose argument at this index is the text of an error raised elsewhere: the
#: message a poisoned output tensor raises when read (``capture.liveness``)
_MESSAGE_ARGS = {"poison_all": 1}
_PREFIX = re.compile(r"^graphgear[\w. ]*: ")
_ERROR_CLASS = re.compile(r"^[A-Z]\w*(Error|Exception|Warning)$")
_PERCENT = re.compile(r"%(\([^)]*\))?[-#0 +]*(\*|\d+)?(\.(\*|\d+))?[diouxXeEfFgGcrsa%]")

#: a message's text: literal strings, and None for each placeholder
Template = list[str | None]


@dataclasses.dataclass
class Message:
    """One place in the source that raises, warns or logs a message."""

    site: str  # "path:line", path relative to src/graphgear
    kind: str  # the exception class, "warnings.warn", "log.warning", ...
    template: Template
    key: tuple[str | None, ...] | None  # see stable_key; None: no literal text


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _receiver(node: ast.Call) -> str:
    f = node.func
    if isinstance(f, ast.Attribute):
        v = f.value
        return v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else ""
    return ""


def _merge(parts: Template) -> Template:
    out: Template = []
    for p in parts:
        if p is None and out and out[-1] is None:
            continue
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return out


def _split_format(text: str, pattern: re.Pattern[str]) -> Template:
    out: Template = []
    pos = 0
    for m in pattern.finditer(text):
        out.append(text[pos:m.start()])
        out.append("%" if m.group() == "%%" else "{" if m.group() == "{{" else "}" if m.group() == "}}" else None)
        pos = m.end()
    out.append(text[pos:])
    return _merge(out)


_BRACES = re.compile(r"\{\{|\}\}|\{[^{}]*\}")


class _Module:
    """One parsed source file, with what :func:`_template` needs to follow names."""

    def __init__(self, path: Path, tree: ast.Module, constants: dict[str, ast.expr]) -> None:
        self.path = path
        self.tree = tree
        self.constants = constants  # module-level NAME = <expr>, of every module
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        self.all_functions: dict[str, list[ast.FunctionDef]] = self.functions  # of every module
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.setdefault(node.name, []).append(node)  # type: ignore[arg-type]

    def enclosing(self, node: ast.AST, kind: type | tuple[type, ...]) -> ast.AST | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, kind):
                return node
        return None


def _assigned(scope: ast.AST, target: str, before: int) -> list[ast.expr]:
    """Values assigned to ``target`` (a name, or ``self.x``) in ``scope`` before line
    ``before``; the last one first."""
    found: list[tuple[int, ast.expr]] = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and node.lineno < before:
            for t in node.targets:
                if ast.unparse(t) == target:
                    found.append((node.lineno, node.value))
    return [v for _, v in sorted(found, key=lambda x: -x[0])]


def _template(node: ast.expr | None, mod: _Module, depth: int = 0, percent: bool = False) -> Template:
    """The literal text of a message expression, placeholders as ``None``: f-strings,
    ``+``, ``%`` and ``.format`` on literals, ``"sep".join(parts)`` of a list built by
    ``parts.append(...)``, and names followed to their one assignment (a local, ``self.x``
    in the class, a module constant) or to the one ``return`` of a function called."""
    if node is None or depth > 6:
        return [None]
    d = depth + 1
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _split_format(node.value, _PERCENT) if percent else [node.value]
    if isinstance(node, ast.JoinedStr):
        parts: Template = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(v.value)
            elif (isinstance(v, ast.FormattedValue) and v.conversion == -1 and v.format_spec is None
                  and isinstance(v.value, ast.Name) and v.value.id in mod.constants):
                parts += _template(mod.constants[v.value.id], mod, d)  # a module constant's text
            else:
                parts.append(None)
        return _merge(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _merge(_template(node.left, mod, d) + _template(node.right, mod, d))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
        return _template(node.left, mod, d, percent=True)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str):
        text = node.func.value.value
        if node.func.attr == "format":
            return _split_format(text, _BRACES)
        if node.func.attr == "join" and node.args and isinstance(node.args[0], ast.Name):
            fn = mod.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            appended = [c.args[0] for c in ast.walk(fn or mod.tree) if isinstance(c, ast.Call)
                        and isinstance(c.func, ast.Attribute) and c.func.attr == "append"
                        and ast.unparse(c.func.value) == node.args[0].id and c.args]
            if len(appended) == 1:
                return _merge(_template(appended[0], mod, d) + [None])
        return [None]
    if isinstance(node, ast.Name | ast.Attribute):
        name = ast.unparse(node)
        fn = mod.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        values = _assigned(fn, name, 1 << 30) if fn is not None and isinstance(node, ast.Name) else []
        if len(values) != 1:
            values = []  # none, or several (which one holds depends on the branch taken)
        if not values and name.startswith("self."):
            cls = mod.enclosing(node, ast.ClassDef)
            values = _assigned(cls, name, 1 << 30) if cls is not None else []
            if len(values) != 1:
                values = []
        if not values and isinstance(node, ast.Name) and node.id in mod.constants:
            values = [mod.constants[node.id]]
        return _template(values[0], mod, d) if values else [None]
    if isinstance(node, ast.Call):
        name = _callee(node)
        defs = mod.functions.get(name) or mod.all_functions.get(name, [])
        if len(defs) == 1:
            returns = [r.value for r in ast.walk(defs[0]) if isinstance(r, ast.Return)]
            if len(returns) == 1:
                return _template(returns[0], mod, d)
    return [None]


def stable_key(template: Template) -> tuple[str | None, ...] | None:
    """The stable start of a message: its leading literal text up to the first
    placeholder, at most ``KEY_MAX`` characters (cut at a word boundary). When fewer than
    ``KEY_MIN`` literal characters come before the first placeholder (a leading
    ``graphgear...: `` prefix counts in neither), the key goes on across placeholders
    (``None`` in the key: any text) until it holds ``KEY_MIN``, or the message ends.
    ``None`` when the message has no literal text at all."""
    key: list[str | None] = []
    first = next((p for p in template if p is not None), "")
    prefix = _PREFIX.match(first) if template and template[0] is not None else None
    total = -len(prefix.group().strip()) if prefix else 0
    for part in template:
        if part is None:
            if total >= KEY_MIN:
                break
            if key:
                key.append(None)
            continue
        if part.strip():  # runs of whitespace as one space, keeping a space at either end
            part = (" " if part[0].isspace() else "") + " ".join(part.split()) + (" " if part[-1].isspace() else "")
        else:
            part = " "
        room = KEY_MAX - total
        if len(part) > room:
            cut = part.rfind(" ", 0, room + 1)
            part = part[:cut if cut > 0 and total + cut >= KEY_MIN else room]
            key.append(part)
            total += len(part.strip())
            break
        key.append(part)
        total += len(part.strip())
    while key and key[-1] is None:
        key.pop()
    if not any(p and re.search(r"\w", p) for p in key):
        return None  # no literal text (punctuation alone keys nothing)
    return tuple(p.strip() if i in (0, len(key) - 1) and p else p for i, p in enumerate(key))


def key_text(key: tuple[str | None, ...]) -> str:
    return "".join("…" if p is None else p for p in key)


def _key_regex(key: tuple[str | None, ...]) -> re.Pattern[str]:
    parts = [r".{0,300}?" if p is None else r"\s*".join(re.escape(w) for w in p.split(" ")) for p in key]
    return re.compile("".join(parts), re.S)


def _is_sink(node: ast.Call, forwarders: dict[str, int]) -> int | None:
    """The index of the message argument when ``node`` raises, warns or logs one."""
    name, recv = _callee(node), _receiver(node)
    if _ERROR_CLASS.match(name):
        return 0
    if name == "warn" and recv == "warnings":
        return 0
    if name in _LOG_METHODS and recv in _LOGGERS:
        return 0
    if name == "error" and recv.endswith("parser"):
        return 0
    if name in _MESSAGE_ARGS:
        return _MESSAGE_ARGS[name]
    return forwarders.get(name)


def _params(fn: ast.FunctionDef) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _modules() -> list[_Module]:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(SRC.rglob("*.py"))}
    constants: dict[str, ast.expr] = {}
    clashes: set[str] = set()
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                if name in constants and ast.unparse(constants[name]) != ast.unparse(node.value):
                    clashes.add(name)
                constants[name] = node.value
    for name in clashes:
        del constants[name]
    modules = [_Module(p, t, constants) for p, t in trees.items()]
    every: dict[str, list[ast.FunctionDef]] = {}
    for mod in modules:
        for name, fns in mod.functions.items():
            every.setdefault(name, []).extend(fns)
    for mod in modules:
        mod.all_functions = every
    return modules


def mod_function(modules: list[_Module], call: ast.Call) -> str:
    """The name of the function ``call`` sits in."""
    for mod in modules:
        if call in mod.parents:
            fn = mod.enclosing(call, (ast.FunctionDef, ast.AsyncFunctionDef))
            return fn.name if fn is not None else ""  # type: ignore[attr-defined]
    return ""


def source_messages(modules: list[_Module] | None = None, root: Path = SRC) -> list[Message]:
    """Every message in src/graphgear: the message argument of

    * a call of a public exception class (``raise X(...)``, or built and returned);
    * ``warnings.warn``, a logger's ``warning``/``error``/``critical``/``exception``, an
      argparse parser's ``error``;
    * the text a poisoned output raises (``_MESSAGE_ARGS``);
    * a forwarder: a function that hands one of its parameters to one of the above (its
      own inner call is not a message; each call of it is).

    Private exception classes (a leading underscore) are control flow caught inside
    graphgear, never shown to a user, and are not collected.
    """
    modules = modules if modules is not None else _modules()
    forwarders: dict[str, int] = {}
    forwarding: set[ast.Call] = set()
    changed = True
    while changed:  # a forwarder of a forwarder too
        changed = False
        for mod in modules:
            for fns in mod.functions.values():
                for fn in fns:
                    params = _params(fn)  # type: ignore[arg-type]
                    for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
                        i = _is_sink(call, forwarders)
                        if i is None or i >= len(call.args) or not isinstance(call.args[i], ast.Name):
                            continue
                        arg = call.args[i].id
                        if arg in params and not _assigned(fn, arg, call.lineno):
                            forwarding.add(call)
                            if forwarders.get(fn.name) != params.index(arg):
                                forwarders[fn.name] = params.index(arg)
                                changed = True
    called = {_callee(c) for mod in modules for c in ast.walk(mod.tree) if isinstance(c, ast.Call)}
    # a forwarder nothing calls by name (``__getattr__``): its own call is the message
    forwarding = {c for c in forwarding if mod_function(modules, c) in called}
    out: list[Message] = []
    for mod in modules:
        rel = mod.path.relative_to(root).as_posix()
        for call in (c for c in ast.walk(mod.tree) if isinstance(c, ast.Call)):
            i = _is_sink(call, forwarders)
            if i is None or call in forwarding:
                continue
            if i >= len(call.args):
                if _ERROR_CLASS.match(_callee(call)) and not call.args and not call.keywords:
                    continue  # raised without a message
                arg = None
            else:
                arg = call.args[i]
            is_log = _callee(call) in _LOG_METHODS and _receiver(call) in _LOGGERS and len(call.args) > 1
            tpl = _template(arg, mod, percent=is_log) if not (is_log and isinstance(arg, ast.Constant)) \
                else _split_format(arg.value, _PERCENT)  # type: ignore[union-attr]
            kind = ast.unparse(call.func)
            out.append(Message(f"{rel}:{call.lineno}", kind, tpl, stable_key(tpl)))
    return sorted(out, key=lambda m: (m.site.split(":")[0], int(m.site.split(":")[1])))


def test_stable_key() -> None:
    assert stable_key(["graphgear: could not capture the graph ", None, " on ", None]) == (
        "graphgear: could not capture the graph",)
    # too little text before the first placeholder: the key goes on across it
    assert stable_key(["graphgear: option ", None, " got ", None, "; allowed values: ", None, "."]) == (
        "graphgear: option", None, " got ", None, "; allowed values:")
    # a long literal is cut at a word boundary
    long = "graphgear: the cache entry was refused because its checksum does not match what was stored"
    key = stable_key([long])
    assert key is not None and len(key[0]) <= KEY_MAX + len("graphgear:") < len(long)
    assert long.startswith(key[0]) and long[len(key[0])] == " "
    assert stable_key([None]) is None
    assert stable_key([None, ": ", None]) is None  # punctuation alone keys nothing
    assert stable_key([None, " failed to compile: ", None]) == ("failed to compile:",)


def test_source_messages_extraction(tmp_path: Path) -> None:
    """The extractor on a made-up module: each form of message it follows."""
    src = textwrap.dedent('''
        import logging, warnings
        log = logging.getLogger(__name__)
        HINT = "see the docs"

        def warn(msg):
            warnings.warn(msg, UserWarning)

        class Thing:
            def __init__(self):
                self._msg = stale("x")

            def check(self, name, parts):
                raise ValueError(f"graphgear: option {name!r} is not known here; {HINT}")

            def later(self):
                msg = f"graphgear: {self} was refused by the check below"
                log.warning(msg)
                log.warning("graphgear cache: could not store %s: %s", 1, 2)
                warn(f"graphgear: {self} cannot be captured at all")
                raise AttributeError(self)

            def many(self, items):
                parts = []
                for i in items:
                    parts.append(f"input {i!r} has a size outside its gears")
                return GearError("graphgear: " + "; ".join(parts) + ".")

        def stale(name):
            return f"graphgear: this tensor of {name} was overwritten"

        class _Private(Exception):
            pass

        def private():
            raise _Private("caught inside")
    ''')
    path = tmp_path / "m.py"
    path.write_text(src)
    tree = ast.parse(src)
    mod = _Module(path, tree, {"HINT": ast.parse('"see the docs"').body[0].value})  # type: ignore[attr-defined]
    msgs = source_messages([mod], root=tmp_path)
    keys = {m.kind: m.key for m in msgs}
    texts = sorted(key_text(m.key) for m in msgs if m.key)
    assert texts == sorted([
        "graphgear: option…is not known here; see the docs",
        "graphgear:…was refused by the check below",
        "graphgear cache: could not store…:",
        "graphgear:…cannot be captured at all",
        "graphgear: input…has a size outside its gears",
    ]), texts
    assert keys["AttributeError"] is None  # no literal text: not keyable
    assert not any("caught inside" in str(m.template) for m in msgs)  # private class
    assert all("warnings.warn" != m.kind for m in msgs)  # the forwarder's own call


def test_troubleshooting_covers_every_message() -> None:
    """Each message graphgear raises or warns with has its stable key
    (:func:`stable_key`) on docs/troubleshooting.md. A message with no literal text at
    all cannot be keyed and is left out: 5 such calls today, each passing on text made
    elsewhere: ``served.py``'s ``AttributeError(name)`` (the attribute's name),
    ``bench/names.py``'s ``ArgumentTypeError(str(e))`` (a ``ConfigError``'s message,
    keyed where it is raised), ``cache/entry.py``'s ``ValueError(reason)`` (a reason of
    ``cache.store.unsafe_reason``), and in ``capture/liveness.py`` a ``RuntimeError`` of
    the C++ compiler's stderr and a ``PermissionError`` of ``f"{file}: {reason}"``. The
    last three reach the user inside a warning that is keyed, and the page shows their
    reasons there."""
    messages = source_messages()
    assert len(messages) > 100, f"the extractor found only {len(messages)} messages in src/graphgear"
    page = " ".join(TROUBLESHOOTING.read_text().split())
    missing: dict[str, list[str]] = {}
    for m in messages:
        if m.key is not None and not _key_regex(m.key).search(page):
            missing.setdefault(key_text(m.key), []).append(m.site)
    assert not missing, "docs/troubleshooting.md lacks these messages (stable key: sites):\n" + "\n".join(
        f"  {k!r}: {', '.join(v)}" for k, v in sorted(missing.items()))
    unkeyed = [m.site for m in messages if m.key is None]
    assert len(unkeyed) <= 5, f"more messages without literal text than the docstring lists: {unkeyed}"


def test_troubleshooting_says_where_to_report_bugs() -> None:
    """The "this is a graphgear bug; report it" messages have a page that says where."""
    text = " ".join(TROUBLESHOOTING.read_text().split())
    assert "report it (with the output of `graphgear env`) on the project's issue tracker" in text
    assert "## Reporting a graphgear bug" in text


# --------------------------------------------------------------------------------------
# snippets


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block of a Markdown file."""

    file: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    code: str
    output: str | None  # the ```output block right after it, if any
    not_run: str | None  # the reason after "# not run:"; "" when the line gives none

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")


def _fences(text: str) -> list[tuple[int, str, str]]:
    """``(line of the opening fence, info word, content)`` of every fenced block."""
    lines = text.splitlines()
    out: list[tuple[int, str, str]] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        out.append((i + 1, info, "\n".join(body) + ("\n" if body else "")))
        i = j + 1
    return out


def _closing_line(text: str, start: int) -> int:
    """The line of the fence that closes the block opened on line ``start``."""
    lines = text.splitlines()
    fence = _FENCE.match(lines[start - 1]).group(2)  # type: ignore[union-attr]
    for j in range(start, len(lines)):
        if re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            return j + 1
    return len(lines)


def parse_blocks(text: str, file: str) -> list[Block]:
    """The ```python blocks of one Markdown text.

    A block whose first line starts with ``# not run`` is not run; the reason follows a
    colon (``# not run: needs 2 processes``). A fenced block with info string ``output``
    that follows a python block with only blank lines between is that block's expected
    stdout."""
    lines = text.splitlines()
    fences = _fences(text)
    out: list[Block] = []
    for k, (line, info, body) in enumerate(fences):
        if info != "python":
            continue
        output = None
        if k + 1 < len(fences) and fences[k + 1][1] == "output":
            end = _closing_line(text, line)
            between = lines[end:fences[k + 1][0] - 1]
            if all(not s.strip() for s in between):
                output = fences[k + 1][2]
        first = next((x.strip() for x in body.splitlines() if x.strip()), "")
        not_run = None
        m = re.match(r"#\s*not run\b(.*)", first)
        if m:
            rest = m.group(1).strip()
            not_run = rest[1:].strip() if rest.startswith(":") else ""
        out.append(Block(file, line, body, output, not_run))
    return out


def match_output(expected: str, actual: str) -> str | None:
    """``None`` when ``actual`` matches ``expected`` line by line, else what differs.

    Trailing whitespace, and blank lines at the end, are ignored. ``...`` inside a line
    matches any text; a line that is only ``...`` matches any number of lines (none
    too)."""

    def lines(s: str) -> list[str]:
        out = [x.rstrip() for x in s.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    want, got = lines(expected), lines(actual)
    pats = [None if w.strip() == "..." else re.compile(".*".join(re.escape(p) for p in w.split("..."))) for w in want]
    # ok[i][j]: pattern lines i.. match output lines j..
    ok = [[False] * (len(got) + 1) for _ in range(len(pats) + 1)]
    ok[len(pats)][len(got)] = True
    for i in range(len(pats) - 1, -1, -1):
        pat = pats[i]
        for j in range(len(got), -1, -1):
            if pat is None:
                ok[i][j] = ok[i + 1][j] or (j < len(got) and ok[i][j + 1])
            else:
                ok[i][j] = j < len(got) and pat.fullmatch(got[j]) is not None and ok[i + 1][j + 1]
    if ok[0][0]:
        return None
    diff = "\n".join(difflib.unified_diff(want, got, "expected (the output block)", "stdout", lineterm=""))
    return diff or "the output differs"


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/ (none when docs/ is missing)."""
    files = [README] if README.exists() else []
    if DOCS.is_dir():
        files += sorted(DOCS.rglob("*.md"))
    return files


def doc_blocks() -> list[Block]:
    return [b for f in doc_files() for b in parse_blocks(f.read_text(), f.relative_to(ROOT).as_posix())]


#: a block that compiles (marked slow and inductor), and one that builds a transformers
#: model (marked slow)
_COMPILES = re.compile(r"torch\.compile|\bserve\(|cache_compile|get_compiler|precompile_gears|CompileConfig|"
                       r"compile_config|backend=")
_TRANSFORMERS = re.compile(r"^\s*(from|import) transformers\b", re.M)


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    if _COMPILES.search(block.code):
        return [pytest.mark.slow, pytest.mark.inductor]
    return [pytest.mark.slow] if _TRANSFORMERS.search(block.code) else []


def _params_of(blocks: list[Block]) -> list[object]:
    return [pytest.param(b, id=b.id, marks=_marks(b)) for b in blocks]


def snippet_env() -> dict[str, str]:
    """This test's environment (with the suite's Inductor cache, set by tests/conftest.py)
    and this checkout's ``src`` first on ``PYTHONPATH``."""
    assert os.environ.get(INDUCTOR_ENV_VAR), f"tests/conftest.py should have set {INDUCTOR_ENV_VAR}"
    path = [str(ROOT / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def run_snippet(code: str, timeout: float = SNIPPET_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter, in a temporary working directory."""
    with tempfile.TemporaryDirectory(prefix="graphgear-doc-") as cwd:
        script = Path(cwd) / "snippet.py"
        script.write_text(code)
        return subprocess.run([sys.executable, str(script)], cwd=cwd, env=snippet_env(),
                              capture_output=True, text=True, timeout=timeout)


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


@pytest.mark.parametrize("block", _params_of(doc_blocks()))
def test_doc_snippet(block: Block) -> None:
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: '# not run' needs a reason after a colon: '# not run: <why>'"
        compile(block.code, block.id, "exec")  # still valid Python
        pytest.skip(f"not run: {block.not_run}")
    p = run_snippet(block.code)
    if p.returncode != 0:
        pytest.fail(f"{block.id} exited {p.returncode}\n--- stdout\n{_tail(p.stdout, 2000)}"
                    f"\n--- stderr\n{_tail(p.stderr)}", pytrace=False)
    if block.output is not None:
        diff = match_output(block.output, p.stdout)
        if diff is not None:
            pytest.fail(f"{block.id}: stdout differs from its output block\n{diff}\n--- stderr\n"
                        f"{_tail(p.stderr)}", pytrace=False)


def test_readme_has_python_blocks() -> None:
    """The snippet collection finds something: a README without a python block (or a
    parser that misses them) fails here."""
    assert parse_blocks(README.read_text(), "README.md"), "README.md has no ```python block"


def test_snippets_use_the_suites_inductor_cache() -> None:
    code = ("import os, torch._dynamo\nfrom graphgear.cache.store import use_private_inductor_cache\n"
            f"print(os.environ[{INDUCTOR_ENV_VAR!r}])\nprint(use_private_inductor_cache())\n")
    p = run_snippet(code, timeout=300)
    assert p.returncode == 0, _tail(p.stderr)
    assert p.stdout.split() == [os.environ[INDUCTOR_ENV_VAR]] * 2, (p.stdout, _tail(p.stderr))


def test_doc_files_without_docs_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path / "docs")
    assert doc_files() == [README]


_SAMPLE = """\
Text.

```python
print("hi")
```

```output
hi
```

```bash
echo no
```

```python
# not run: needs 2 processes (torchrun)
import torch.distributed
```

```python
# not run
x = 1
```

```python
print(1)
```
Some text in between.
```output
1
```

  ```python
  print("indented")
  ```
"""


def test_parse_blocks() -> None:
    blocks = parse_blocks(_SAMPLE, "x.md")
    assert [(b.line, b.output, b.not_run) for b in blocks] == [
        (3, "hi\n", None),
        (15, None, "needs 2 processes (torchrun)"),
        (20, None, ""),
        (25, None, None),  # the output block is not right after it
        (33, None, None),
    ]
    assert blocks[0].code == 'print("hi")\n'
    assert blocks[-1].code == 'print("indented")\n'
    assert blocks[0].id == "x.md:3"


def test_parse_blocks_of_no_text() -> None:
    assert parse_blocks("", "empty.md") == []
    assert parse_blocks("# Title\n\nno code\n", "t.md") == []


def test_match_output() -> None:
    assert match_output("a\nb\n", "a\nb\n") is None
    assert match_output("a  \nb", "a\nb   \n\n") is None  # trailing whitespace and blank lines
    assert match_output("a\nb\n", "a\nc\n") is not None
    assert match_output("a\n", "a\nb\n") is not None  # extra lines fail
    assert match_output("a\nb\n", "a\n") is not None  # missing lines fail
    # "..." inside a line: any text
    assert match_output("took ... s\n", "took 1.25 s\n") is None
    assert match_output("took ...s\n", "took 1.25 ms\n") is None
    assert match_output("took ... s\n", "took 1.25 s extra\n") is not None
    assert match_output("x [...]\n", "x [1, 2, 3]\n") is None
    # a line of only "...": any number of lines, none included
    assert match_output("start\n...\nend\n", "start\n1\n2\n3\nend\n") is None
    assert match_output("start\n...\nend\n", "start\nend\n") is None
    assert match_output("start\n...\nend\n", "start\n1\n") is not None
    assert match_output("...\nlast\n", "a\nb\nlast\n") is None
    assert match_output("  ...  \nlast\n", "last\n") is None
    # regex characters in the expected text are literal
    assert match_output("a.b (c)\n", "aXb (c)\n") is not None
    assert match_output("a.b (c)\n", "a.b (c)\n") is None


def test_a_failing_snippet_fails() -> None:
    """The runner reports a failing block: exit status and output both count."""
    p = run_snippet("import sys\nprint('out')\nsys.exit(3)\n", timeout=120)
    assert p.returncode == 3 and p.stdout == "out\n"
    assert match_output("other\n", p.stdout) is not None
