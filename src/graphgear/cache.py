"""A compile cache: a restarted process serves without tracing or compiling.

:func:`cache_compile` (also ``graphgear.inference.cache_compile``) wraps a function or an
``nn.Module``. On a call with an input spec it has no entry for, it builds the cache key,
and either loads a trusted entry (``stats()``: ``cache="hit"``) or compiles with torch
2.13's precompile (``torch.compile(fn, fullgraph=True).aot_compile(...)``) and stores the
result (``"stored"``).

**What is stored** (one file per key), all through torch's own formats:

* torch's ``save_compiled_function`` payload: dynamo's transformed bytecode and guards;
* as the backend's part of it, AOTAutograd's *bundled* entry of each graph (the runtime
  metadata and wrappers AOTAutograd puts around the compiled code; ``_torch.aot_bundling``),
  whose compiled graph is graphgear's :class:`~graphgear.bundle.GraphgearOutputCode`;
* in it, the graph's :class:`~graphgear.artifacts.ArtifactStore`: the graph after
  graphgear's passes (``GraphPickler``), and per graph key (each gear) Inductor's
  compiled graph (``CompiledFxGraph``: generated source and metadata), recorded as the
  keys are compiled. ``frozen_parameter`` keys are not stored (their code holds the
  weights' values, which the key does not cover).

**What a later process does**: no dynamo trace, no AOTAutograd trace, no passes, no
specialisation, no Inductor compile for a stored key: AOTAutograd's wrappers are rebuilt
from the entry, graphgear's dispatch from the store, each key's generated module is
imported from Inductor's code cache (its C++ kernels loaded from Inductor's on-disk
cache by the hash of their source, compiled when missing). Device graphs are captured
again (they cannot be saved). A key compiled at run time (a gear the entry did not
hold) compiles as usual, and the entry is stored again after that call: once per new
key, never per step.

**Trust.** The file format is ``MAGIC``, one JSON header line (key parts, payload sha256)
and the payload. Before anything is unpickled, the loader refuses, with a warning naming
the file and the reason, and then recompiles: a cache folder not owned by the user or
writable by group/others (a symlinked folder is judged by what it resolves to); a symlink
inside it (entry or sub-folder); an entry file not owned by the user or with a mode other
than 0600; a payload whose sha256 differs from the header's; a header whose key parts
(torch/graphgear versions, code hash, ...) differ from this process's.

**Who unpickles what**, after those checks:

* torch's ``load_compiled_function`` unpickles its own payload (dynamo's bytecode, code
  objects and guards: it builds code objects by design, so the checks above are what
  make it safe), and hands graphgear its part as bytes;
* graphgear's part (AOTAutograd's entry, the stores, Inductor's compiled graphs) goes
  through :class:`_RestrictedUnpickler`, and the graph inside a store through
  ``GraphPickler``'s unpickler, both limited to the globals
  :func:`graphgear.artifacts.allowed_global` lists (TorchAir's ``_StrictModelUnpickler``
  idea): AOTAutograd's and Inductor's record types, sympy size classes, plain
  containers; no ``eval``, ``getattr``, ``os``, ``sympify``;
* Inductor's generated module (the text in the checksummed entry) is written to
  Inductor's code cache and imported; a file already there with different text is
  overwritten with the verified text first (``_torch.inductor_output_load``). Its C++ kernels come from Inductor's
  private on-disk cache, trusted as ``torch.compile`` trusts it.

**Writes** happen only after a compile, under an exclusive ``fcntl.flock`` on
``<folder>/.lock``, to a private temporary file that ``os.replace`` renames: a reader
never sees a half-written entry, and two writers both succeed (the last rename wins).
AOTAutograd also writes its own copy of each entry into Inductor's cache folder
(``aotautograd/``), under a key tagged with the cache entry (``artifacts.cache_tag``),
so no other compile of the same graph is served it.

**Guards.** Every call of a stored or loaded function checks dynamo's guards first
(``guard_check``, the same check ``torch.compile`` makes). Where they reject the call (a
module attribute or global changed, grad mode on for an inference entry), the function
runs through plain ``torch.compile`` with graphgear instead, with one warning: correct,
without the cache's start-up gain. Tensors marked by ``set_dim_gears`` are passed to the
entry without dynamo's dim markings (``_torch.without_dim_markings``: torch 2.13's
serialised guards reject marked tensors); the entry's dims are already symbolic and
graphgear checks the gears itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import inspect
import io
import json
import logging
import os
import pickle
import re
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import torch
from torch import nn

from ._torch.dynamo import without_dim_markings
from ._torch.fx import pytree
from ._torch.isa import adopt_vec_isa, inductor_vec_isa_if_known
from ._torch.serialize import (
    SerializableCallable,
    aot_compiled_backend_result,
    bundled_entry_outputs,
    changed_traced_sources,
    inductor_config_digest,
    load_bundled_entry,
    serializable_guard_filter,
)
from .artifacts import SUBSTITUTES, allowed_global, cache_tag
from .backend import get_backend
from .bundle import GraphgearOutputCode
from .cachedir import default_cache_root, unsafe_reason
from .config import CompilerConfig
from .gears import get_dim_gears
from .passes import PASSES_VERSION
from .stats import record_count, records_since

log = logging.getLogger(__name__)

__all__ = ["CacheEntry", "allowed_global", "cache_compile", "cache_folder", "clear_entries", "list_entries"]

MAGIC = b"GRAPHGEAR-CACHE-1\n"
SUFFIX = ".ggc"
ENV_VAR = "GRAPHGEAR_CACHE_DIR"


def _graphgear_version() -> str:
    try:
        return metadata.version("graphgear")
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_folder(cache_dir: str | None = None) -> str:
    """The cache folder: ``cache_dir``, else ``$GRAPHGEAR_CACHE_DIR``, else
    ``~/.cache/graphgear`` (``$XDG_CACHE_HOME/graphgear``)."""
    if cache_dir:
        return cache_dir
    return os.environ.get(ENV_VAR) or os.path.join(default_cache_root(), "graphgear")


# --------------------------------------------------------------------------- trust checks


def file_unsafe_reason(path: str) -> str | None:
    """Why the entry file ``path`` may not be loaded (symlink, owner, mode), or ``None``."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink inside the cache folder"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by the current user (uid {os.getuid()})"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600"
    return None


def _entry_folder(root: str, rank: int | None) -> tuple[str, str | None]:
    """``root`` (or its ``rank<N>`` sub-folder), created 0700; and why it is unsafe."""
    try:
        os.makedirs(root, 0o700, exist_ok=True)
    except OSError as e:
        return root, f"cannot create it ({e.strerror})"
    reason = unsafe_reason(root, follow_symlinks=True)
    if reason is not None or rank is None:
        return root, reason
    sub = os.path.join(root, f"rank{int(rank)}")
    if os.path.islink(sub):
        return sub, "it is a symlink inside the cache folder"
    try:
        os.mkdir(sub, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return sub, f"cannot create it ({e.strerror})"
    return sub, unsafe_reason(sub, follow_symlinks=True)


# --------------------------------------------------------------------------- key


def _source_of(fn: Any) -> str:
    """The source the code hash covers: a module's class (its ``forward`` included) or a
    function; the code object's bytes when no source is available."""
    targets: list[Any] = []
    if isinstance(fn, nn.Module):
        targets = [type(fn)]
    elif inspect.ismethod(fn):
        targets = [type(fn.__self__), fn.__func__]
    else:
        targets = [fn]
    parts = []
    for t in targets:
        try:
            parts.append(inspect.getsource(t))
        except (OSError, TypeError):
            code = getattr(t, "__code__", None)
            parts.append(repr(code.co_code) if code is not None else repr(t))
    return "\n".join(parts)


GearsOf = Callable[[torch.Tensor], dict[int, list[int]]]


def _spec(x: Any, gears_of: GearsOf = get_dim_gears) -> Any:
    if isinstance(x, torch.Tensor):
        gears = {str(d): list(s) for d, s in sorted(gears_of(x).items())}
        return {"dtype": str(x.dtype), "device": str(x.device), "shape": list(x.shape),
                "requires_grad": x.requires_grad, "gears": gears}
    if isinstance(x, (list, tuple)):
        return [_spec(v, gears_of) for v in x]
    if isinstance(x, dict):
        return {str(k): _spec(v, gears_of) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (int, float, bool, str)) or x is None:
        return {"type": type(x).__name__, "value": x}
    return {"type": type(x).__qualname__}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _signature(x: Any, gears_of: GearsOf = get_dim_gears) -> Any:
    """A cheap hashable summary of a call's inputs (what :func:`_spec` digests)."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device, x.requires_grad,
                tuple(sorted((d, tuple(g)) for d, g in gears_of(x).items())))
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v, gears_of) for v in x)
    if isinstance(x, dict):
        return tuple(sorted(((str(k), _signature(v, gears_of)) for k, v in x.items()), key=lambda kv: kv[0]))
    if isinstance(x, (int, float, bool, str)) or x is None:
        return (type(x), x)
    return type(x)


def key_parts(fn: Any, config: CompilerConfig, args: tuple[Any, ...], kwargs: dict[str, Any],
              dynamic: bool, rank: int | None, gears_of: GearsOf = get_dim_gears) -> dict[str, str]:
    """Every part of the cache key, each a short string (versions) or a sha256."""
    specs = {"args": _spec(list(args), gears_of), "kwargs": _spec(kwargs, gears_of)}
    gears = [s.get("gears") for s in _walk_specs(specs) if s.get("gears")]
    shapes_without_gears = _digest(_strip_geared(specs))
    return {
        "torch": torch.__version__,
        "graphgear": _graphgear_version(),
        "config": _digest(config.as_dict()),
        "code": hashlib.sha256(_source_of(fn).encode()).hexdigest(),
        "passes": str(PASSES_VERSION),
        "inductor": inductor_config_digest(),
        "gears": _digest(gears),
        "inputs": shapes_without_gears,
        "dynamic": str(bool(dynamic)),
        "rank": str(rank),
        "module": _module_digest(fn),
    }


def _module_digest(fn: Any) -> str:
    """The structure of a module (``fn`` or a bound method's owner): every parameter's and
    buffer's name, dtype, shape and device, and every module's class; its values are not
    part of the key (they are inputs at run time)."""
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, nn.Module):
        return "-"
    state = [(n, str(t.dtype), list(t.shape), str(t.device))
             for n, t in [*module.named_parameters(), *module.named_buffers()]]
    classes = [(n, type(m).__qualname__) for n, m in module.named_modules()]
    return _digest([state, classes])


def _walk_specs(obj: Any) -> Iterator[dict[str, Any]]:
    if isinstance(obj, dict):
        if "dtype" in obj:
            yield obj
            return
        for v in obj.values():
            yield from _walk_specs(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk_specs(v)


def _strip_geared(obj: Any) -> Any:
    """The specs with geared dims' sizes left out: any size in the gears hits one entry."""
    if isinstance(obj, dict):
        if "dtype" in obj:
            shape = [None if str(d) in obj["gears"] else s for d, s in enumerate(obj["shape"])]
            return {**obj, "shape": shape}
        return {k: _strip_geared(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip_geared(v) for v in obj]
    return obj


def _by_name(obj: Any) -> bool:
    """Whether pickle can store ``obj`` by reference (its module and qualified name lead
    back to it)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    target: Any = module
    for part in (getattr(obj, "__qualname__", "") or "<none>").split("."):
        target = getattr(target, part, None)
    return target is obj


def _closure_cells(func: Any) -> Iterator[tuple[int, str, Any]]:
    """``(cell index, free variable name, value)`` for each closure cell of ``func``
    (empty cells skipped)."""
    names = getattr(getattr(func, "__code__", None), "co_freevars", ())
    for i, cell in enumerate(getattr(func, "__closure__", None) or ()):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield i, names[i] if i < len(names) else "", v


def _closure_functions(func: Any) -> Iterator[tuple[int, str, Any]]:
    """The closure cells of ``func`` that hold a function."""
    return ((i, name, v) for i, name, v in _closure_cells(func) if inspect.isfunction(v))


def _unpicklable_free(func: Any) -> list[str]:
    """The free variables of ``func`` holding functions pickle cannot store by name."""
    return [name for _, name, v in _closure_functions(func) if not _by_name(v)]


def _closure_objects(func: Any) -> dict[str, Any]:
    """The functions in ``func``'s closure (and theirs, four deep) that pickle cannot
    store by reference (a decorated method's inner function: transformers' forwards), and
    the modules in those closures (a closure over a model).
    torch's precompile keeps the traced function's closure; these travel as its
    ``external_data`` instead, taken from the same places in a later process's function."""
    out: dict[str, Any] = {}

    def walk(f: Any, path: str, depth: int) -> None:
        for i, _, v in _closure_cells(f):
            if isinstance(v, nn.Module):  # a closure over a model: its weights are not stored
                out[f"{path}.{i}"] = v
            elif inspect.isfunction(v):
                if not _by_name(v):
                    out[f"{path}.{i}"] = v
                if depth < 4:
                    walk(v, f"{path}.{i}", depth + 1)

    walk(func, "closure", 0)
    return out


_MODULE_GLOBAL = re.compile(rb"___module_([A-Za-z_][A-Za-z0-9_]*?)_[0-9]+_c[0-9]+")


def _module_globals(payload: bytes) -> dict[str, Any]:
    """The modules dynamo's bytecode in ``payload`` loads as globals it installed by id
    (``___module_<name>_<id>_c<n>``, ``codegen.create_load_python_module``: transformers'
    outputs reconstruct through ``collections``): torch's precompile does not store them,
    so they are passed back to ``load_compiled_function`` (``f_globals``). ``<name>`` is
    the module's last name part; one that names no loaded module, or several, is left
    out (torch then refuses the entry for the missing global, and it is recompiled)."""
    out: dict[str, Any] = {}
    for m in set(_MODULE_GLOBAL.finditer(payload)):
        name = m.group(1).decode()
        mod = sys.modules.get(name)
        if mod is None:
            found = [v for k, v in list(sys.modules.items()) if k.rsplit(".", 1)[-1] == name]
            mod = found[0] if len(found) == 1 else None
        if mod is not None:
            out[m.group(0).decode()] = mod
    return out


def _name_of(fn: Any) -> str:
    target = type(fn) if isinstance(fn, nn.Module) else fn
    name = getattr(target, "__qualname__", None) or type(target).__name__
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:60]


# --------------------------------------------------------------------------- graphgear's serialisable result


_Base: Any = SerializableCallable if SerializableCallable is not None else object


class _CachedGraph(_Base):  # type: ignore[misc,valid-type]
    """The result of graphgear's backend under ``aot_compile``: AOTAutograd's compiled
    function with its bundled entry (``compiled.serialize()``), whose graphs are
    graphgear's :class:`~graphgear.bundle.GraphgearOutputCode` (``outputs``)."""

    def __init__(self, compiled: Callable[..., Any], outputs: list[GraphgearOutputCode]) -> None:
        self.compiled, self.outputs = compiled, outputs

    def version(self) -> int:
        """Moves when a graph compiles a key it did not hold (see ``artifacts``)."""
        return sum(o.store.version for o in self.outputs if o.store is not None)

    @classmethod
    def serialize_compile_artifacts(cls, fn: _CachedGraph) -> bytes:
        entry = fn.compiled.serialize()  # AOTAutograd's bundled entry, ready to pickle
        if entry is None:
            raise RuntimeError("AOTAutograd kept no bundled entry of this graph")
        return pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> _CachedGraph:
        entry = _RestrictedUnpickler(io.BytesIO(data)).load()
        outputs = [o for o in bundled_entry_outputs(entry) if isinstance(o, GraphgearOutputCode)]
        if not outputs:
            raise ValueError("the entry holds no graphgear graph")
        return cls(load_bundled_entry(entry), outputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


class _RestrictedUnpickler(pickle.Unpickler):
    """graphgear's part of an entry: only the types :func:`allowed_global` names."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SUBSTITUTES:
            return SUBSTITUTES[module, name]
        if not allowed_global(module, name):
            raise pickle.UnpicklingError(f"graphgear cache: global {module}.{name} is not allowed here")
        return super().find_class(module, name)


def _caching_backend(config: CompilerConfig, key: str) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> _CachedGraph:
        compiled, outputs = get_backend(config).compile_bundled(gm, example_inputs, cache_tag(key))
        return _CachedGraph(compiled, outputs)

    backend.__name__ = "graphgear_cache"
    return backend


# --------------------------------------------------------------------------- entry files


@dataclasses.dataclass
class _Stored:
    """What a key's entry file holds of the compiled function: its path (None: not
    written), the backend's graph, and that graph's ``version()`` when last written."""

    path: str | None
    graph: _CachedGraph
    version: int


@dataclasses.dataclass
class CacheEntry:
    """One entry file, as ``graphgear cache ls`` shows it."""

    path: str
    name: str
    key: str
    parts: dict[str, str]
    size: int
    age_seconds: float


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write_entry(path: str, name: str, key: str, parts: dict[str, str], payload: bytes) -> None:
    # "vec_isa": the CPU vector ISA Inductor probed for here (not a key part: a later
    # process on a CPU whose flags lead to the same ISA skips Inductor's base probes)
    header = {"name": name, "key": key, "parts": parts, "sha256": hashlib.sha256(payload).hexdigest(),
              "size": len(payload), "created": time.time(), "vec_isa": inductor_vec_isa_if_known()}
    folder = os.path.dirname(path)
    with _locked(folder):
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _read_header(f: Any) -> dict[str, Any]:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("it is not a graphgear cache entry (bad magic)")
    line = f.readline(1 << 20)
    if not line.endswith(b"\n"):
        raise ValueError("its header is truncated")
    header = json.loads(line)
    if not isinstance(header, dict) or not isinstance(header.get("parts"), dict):
        raise ValueError("its header is malformed")
    return header


def _read_trusted(path: str) -> tuple[dict[str, Any], bytes]:
    """Header and payload of ``path`` after the file checks and the checksum; raises
    ``ValueError`` with the reason to refuse it."""
    reason = file_unsafe_reason(path)
    if reason is not None:
        raise ValueError(reason)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # the file opened is the file checked
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
            raise ValueError("it changed owner or mode while being opened")
        header = _read_header(f)
        payload = f.read()
    if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("its checksum does not match (truncated or corrupted)")
    return header, payload


def _differing(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    return [k for k in current if stored.get(k) != current[k]] + [k for k in stored if k not in current]


def list_entries(cache_dir: str | None = None) -> list[CacheEntry]:
    """Every entry under the cache folder (rank sub-folders included); unreadable files
    are listed with an empty key."""
    root = cache_folder(cache_dir)
    out: list[CacheEntry] = []
    now = time.time()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for fname in sorted(files):
            if not fname.endswith(SUFFIX):
                continue
            path = os.path.join(folder, fname)
            st = os.lstat(path)
            try:
                with open(path, "rb") as f:
                    header = _read_header(f)
            except (OSError, ValueError):
                header = {"name": fname, "key": "", "parts": {}}
            out.append(CacheEntry(path=path, name=str(header.get("name")), key=str(header.get("key")),
                                  parts=dict(header.get("parts") or {}), size=st.st_size,
                                  age_seconds=now - st.st_mtime))
    return out


def clear_entries(cache_dir: str | None = None) -> int:
    """Delete every entry file (and temporary file) under the cache folder; the count."""
    root = cache_folder(cache_dir)
    n = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for fname in files:
            if fname.endswith(SUFFIX) or fname.startswith(".tmp-"):
                os.unlink(os.path.join(folder, fname))
                n += int(fname.endswith(SUFFIX))
    return n


# --------------------------------------------------------------------------- the cached callable


class CachedFunction:
    """What :func:`cache_compile` returns: call it as the function (or module) itself."""

    def __init__(self, fn: Any, config: CompilerConfig, cache_dir: str | None, dynamic: bool,
                 rank: int | None) -> None:
        if SerializableCallable is None:
            raise RuntimeError("graphgear.cache_compile needs torch's precompile (torch >= 2.10).")
        self.fn = fn
        self.module: nn.Module | None = fn if isinstance(fn, nn.Module) else None
        self._func: Callable[..., Any] = type(fn).forward if isinstance(fn, nn.Module) else fn
        if self.module is None and inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module):
            self.module = fn.__self__
            self._func = fn.__func__
        self.config = config.copy()
        self.cache_dir = cache_folder(cache_dir)
        self.dynamic = dynamic
        self.rank = rank
        self._loaded: dict[str, Any] = {}  # key -> AOTCompiledFunction, or the fallback
        self._keys: dict[Any, tuple[str, dict[str, str]]] = {}  # call signature -> key
        self._stored: dict[str, _Stored] = {}
        self.stores = 0  # entry files written by this object (tests: not one per step)
        self._fallback: Any = None
        self._warned = False
        self._warned_unsupported = False
        self._leaf_gears: dict[Any, dict[int, dict[int, list[int]]]] = {}  # input TreeSpec -> leaf -> gears

    def _call(self, compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.module is not None:
            return compiled(self.module, *args, **kwargs)
        return compiled(*args, **kwargs)

    def _gears_of(self, leaves: list[Any], spec: Any) -> GearsOf:
        """Gears per input tensor (``leaves``, ``spec``: the call's flattened inputs): its
        own (``set_dim_gears``), else those the tensor at the same place in an earlier call
        had (TorchAir's usage: gears are set on the first call's input, later sizes arrive
        as plain tensors and hit the same entry)."""
        remembered = self._leaf_gears.setdefault(spec, {})
        inherited: dict[int, dict[int, list[int]]] = {}
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            own = get_dim_gears(leaf)
            if own:
                remembered[i] = own
            elif i in remembered and all(d < leaf.dim() for d in remembered[i]):
                inherited[id(leaf)] = remembered[i]
        if not inherited:
            return get_dim_gears
        return lambda t: inherited.get(id(t)) or get_dim_gears(t)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # inference: entries are compiled under no_grad, and their guards check grad mode. A
        # call with an input that requires grad keeps grad mode (the guards then send it
        # through torch.compile, with autograd); the module's own parameters do not count.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        wants_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in leaves if isinstance(t, torch.Tensor))
        if wants_grad:
            return self._serve(args, kwargs, self._gears_of(leaves, spec))
        with torch.no_grad():
            return self._serve(args, kwargs, self._gears_of(leaves, spec))

    def _serve(self, args: tuple[Any, ...], kwargs: dict[str, Any], gears_of: GearsOf) -> Any:
        sig = _signature((args, kwargs), gears_of)
        known = self._keys.get(sig)
        if known is None:  # the full key (source, config, module...) once per signature
            parts = key_parts(self.fn, self.config, args, kwargs, self.dynamic, self.rank, gears_of)
            known = self._keys[sig] = (_digest(parts), parts)
        key, parts = known
        compiled = self._loaded.get(key)
        if compiled is None:
            compiled = self._load_or_compile(key, parts, args, kwargs)
            self._loaded[key] = compiled
        if compiled is self._fallback or isinstance(compiled, _Unsupported):
            return compiled(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(torch.Tensor, without_dim_markings, (args, kwargs))
        call_args = (self.module, *args) if self.module is not None else args
        if not compiled.guard_check(*call_args, **kwargs):
            return self._run_uncached(key, args, kwargs)
        out = self._call(compiled, args, kwargs)
        stored = self._stored.get(key)
        if stored is not None and stored.path is not None and stored.graph.version() != stored.version:
            self._store(compiled, key, parts, stored)  # it compiled a key it did not hold
        return out

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled (dynamo's guard state of a module that holds this wrapper, as TorchAir's
        pattern has it; ``torch.save`` of such a module) as a stateless placeholder: the
        wrapper's compiled entries, guard managers and locks cannot be pickled and must not
        travel. ``copy.deepcopy`` builds a fresh wrapper instead (``__deepcopy__``)."""
        return _UnpickledCachedFunction, (_name_of(self.fn),)

    def __deepcopy__(self, memo: dict[int, Any]) -> CachedFunction:
        fn = self.fn
        if inspect.ismethod(fn):  # the copy of the module, if it is being copied
            fn = getattr(copy.deepcopy(fn.__self__, memo), fn.__func__.__name__)
        else:
            fn = copy.deepcopy(fn, memo)
        return CachedFunction(fn, self.config, self.cache_dir, self.dynamic, self.rank)

    def _uncached(self) -> Any:
        """``fn`` through plain ``torch.compile`` with graphgear (no cache). A bound method
        is compiled as the method: the module's own ``forward`` may call this wrapper."""
        if self._fallback is None:
            self._fallback = torch.compile(self.fn, backend=get_backend(self.config),
                                           dynamic=None if self.dynamic else False)
        return self._fallback

    def _run_uncached(self, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The entry's guards reject this call: run it through plain torch.compile."""
        if not self._warned:
            self._warned = True
            log.warning("graphgear cache: the guards of the compiled entry of %s reject this call "
                        "(module state or globals that changed since it was compiled); it runs "
                        "through torch.compile with graphgear instead, without the cache.",
                        _name_of(self.fn))
        self._loaded[key] = fallback = self._uncached()
        return fallback(*args, **kwargs)

    def _entry_path(self, folder: str, key: str) -> str:
        return os.path.join(folder, f"{_name_of(self.fn)}-{key[:24]}{SUFFIX}")

    def _load_or_compile(self, key: str, parts: dict[str, str], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        folder, reason = _entry_folder(self.cache_dir, self.rank)
        if reason is not None:
            log.warning("graphgear cache: not using folder %s: %s; compiling without the cache", folder, reason)
            return self._compile(args, kwargs, None, key, parts)
        path = self._entry_path(folder, key)
        n0 = record_count()
        t0 = time.perf_counter()
        if os.path.lexists(path):
            try:
                header, payload = _read_trusted(path)
                diff = _differing(header["parts"], parts)
                if header.get("key") != key or diff:
                    raise ValueError(f"its key parts differ ({', '.join(diff) or 'key'})")
                isa = header.get("vec_isa")
                adopt_vec_isa(isa if isinstance(isa, str) else None)
                compiled = torch.compiler.load_compiled_function(
                    io.BytesIO(payload), f_globals=_module_globals(payload),
                    external_data=_closure_objects(self._func))
                changed = changed_traced_sources(compiled)
                if changed:
                    raise ValueError(f"the source of traced code changed since it was stored: "
                                     f"{', '.join(changed[:5])}")
                compiled.disable_guard_check()  # __call__ checks them first, once
                graph = aot_compiled_backend_result(compiled)
            except Exception as e:  # refuse, never run it: recompile
                log.warning("graphgear cache: refusing %s: %s; compiling instead", path, e)
                for rec in records_since(n0):  # graphs rebuilt before the refusal
                    rec.cache = "refused"
            else:
                seconds = time.perf_counter() - t0
                for rec in records_since(n0):
                    rec.cache, rec.cache_load_seconds = "hit", seconds
                log.info("graphgear cache: loaded %s in %.2f s", path, seconds)
                self._stored[key] = _Stored(path, graph, graph.version())
                return compiled
        else:
            self._log_miss(folder, parts)
        return self._compile(args, kwargs, path, key, parts)

    def _log_miss(self, folder: str, parts: dict[str, str]) -> None:
        """One log line naming the key part that differs from the nearest entry of this function."""
        prefix = _name_of(self.fn) + "-"
        best: list[str] | None = None
        for fname in os.listdir(folder):
            if not (fname.startswith(prefix) and fname.endswith(SUFFIX)):
                continue
            try:
                with open(os.path.join(folder, fname), "rb") as f:
                    stored = _read_header(f)["parts"]
            except (OSError, ValueError):
                continue
            diff = _differing(stored, parts)
            if best is None or len(diff) < len(best):
                best = diff
        if best is None:
            log.info("graphgear cache: miss for %s (no entry for it in %s)", _name_of(self.fn), folder)
        else:
            log.info("graphgear cache: miss for %s: key part(s) differ from the nearest entry: %s",
                     _name_of(self.fn), ", ".join(best))

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any], path: str | None, key: str,
                 parts: dict[str, str]) -> Any:
        n0 = record_count()
        dynamic = None if self.dynamic else False  # True: dims marked (set_dim_gears) are dynamic
        call_args = (self.module, *args) if self.module is not None else args
        try:
            with torch.no_grad():
                compiled = torch.compile(self._func, fullgraph=True, dynamic=dynamic,
                                         backend=_caching_backend(self.config, key),
                                         options={"guard_filter_fn": serializable_guard_filter(_unpicklable_free(self._func))},
                                         ).aot_compile((call_args, kwargs))
        except Exception as e:  # what torch's precompile cannot save is served uncached
            return self._unsupported(e, n0)
        compiled.disable_guard_check()  # __call__ checks them first, once
        stored = self._stored[key] = _Stored(path, aot_compiled_backend_result(compiled), -1)
        status = "stored" if path is not None and self._store(compiled, key, parts, stored) else "miss"
        for rec in records_since(n0):
            rec.cache = status
        return compiled

    def _unsupported(self, error: Exception, n0: int) -> Any:
        """torch's precompile failed on ``fn`` (a class defined in local scope, an object in
        its guards or closure that cannot be pickled, a graph break under ``fullgraph``):
        the call is served through plain ``torch.compile`` with graphgear, uncached; one
        warning per wrapper, and ``stats()`` records ``cache="unsupported"``."""
        reason = _unsupported_reason(error)
        if not self._warned_unsupported:
            self._warned_unsupported = True
            log.warning("graphgear cache: %s cannot be stored in the compile cache: %s. It runs "
                        "through torch.compile with graphgear, without the cache. Fix: %s",
                        _name_of(self.fn), reason, _unsupported_fix(reason))
        for rec in records_since(n0):  # records of the precompile that failed
            rec.cache, rec.cache_reason = "unsupported", reason
        return _Unsupported(self._uncached(), reason)

    def _store(self, compiled: Any, key: str, parts: dict[str, str], stored: _Stored) -> bool:
        """Write the entry (after a compile, and again after a call that compiled a graph
        key the entry did not hold: at most once per new key, never per step)."""
        path = stored.path
        assert path is not None
        version = stored.version = stored.graph.version()
        try:
            payload = type(compiled).serialize(compiled, _closure_objects(self._func)).serialized_data
            _write_entry(path, _name_of(self.fn), key, parts, payload)
        except Exception as e:  # a cache that cannot be written must not break serving
            log.warning("graphgear cache: could not store %s: %s", path, e)
            return False
        self.stores += 1
        log.info("graphgear cache: stored %s (%d compiled graph keys)", path, version)
        return True


class _Unsupported:
    """A key whose function torch's precompile could not save: the uncached
    ``torch.compile`` of it; graphs it compiles are recorded ``cache="unsupported"``."""

    def __init__(self, fallback: Callable[..., Any], reason: str) -> None:
        self.fallback, self.reason = fallback, reason

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n0 = record_count()
        out = self.fallback(*args, **kwargs)
        for rec in records_since(n0):
            rec.cache, rec.cache_reason = "unsupported", self.reason
        return out


class _UnpickledCachedFunction:
    """What a pickled :class:`CachedFunction` becomes: it holds no compiled state, and
    calling it says how to get a working wrapper back."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"graphgear cache: this cache_compile wrapper of {self.name} was unpickled "
                           "(pickle or torch.save of the object that held it) and holds no compiled "
                           "code. Fix: call graphgear.inference.cache_compile(...) again on the "
                           "loaded object (TorchAir's pattern: in its __init__ or after loading).")


def _unsupported_reason(error: BaseException) -> str:
    """The first line of the innermost error of a failed precompile (torch wraps them)."""
    while error.__cause__ is not None and not isinstance(error, (TypeError, pickle.PicklingError)):
        error = error.__cause__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _unsupported_fix(reason: str) -> str:
    if "local scope" in reason or "<locals>" in reason:
        return ("define the class or function at module level (not inside a function), so a "
                "later process can import it by name")
    if "pickle" in reason.lower():
        return ("keep objects that cannot be pickled (locks, open files, compiled wrappers) out of "
                "what the function reads: pass them as arguments or hold them outside the module")
    return "make the function compile with torch.compile(fullgraph=True), or call it uncached"


def cache_compile(fn: Any, *, config: CompilerConfig | None = None, cache_dir: str | None = None,
                  dynamic: bool = True, rank: int | None = None) -> CachedFunction:
    """Compile ``fn`` (a function, an ``nn.Module`` or a module's bound method) with
    graphgear through a compile cache; see the module docstring.

    ``dynamic=True`` keeps the dims marked by ``set_dim_gears`` dynamic (torch's
    ``dynamic=None``); ``False`` compiles every dim static. ``rank`` stores entries in a
    ``rank<N>`` sub-folder. Calls run under ``torch.no_grad()`` (the cache serves
    inference: outputs carry no autograd history) unless an input tensor requires grad in
    grad mode: that call runs through plain ``torch.compile``, with autograd.

    Gears set (``set_dim_gears``) on a tensor of the first call hold for the tensor at the
    same place in later calls, so later sizes can arrive as plain tensors. What torch's
    precompile cannot save (a class defined in local scope, an unpicklable object in the
    guards) is served uncached, with one warning and ``stats()``'s ``cache="unsupported"``."""
    return CachedFunction(fn, config if config is not None else CompilerConfig(), cache_dir, dynamic, rank)
