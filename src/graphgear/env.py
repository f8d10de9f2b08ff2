"""``graphgear env``: what a bug report needs to know about this machine.

graphgear's behaviour depends on more than its own version: the torch build, the C++
compiler Inductor finds, the vector ISA it compiles for, whether the output-liveness
extension builds (``graphgear.capture.liveness``; without it reduce-overhead clones its
outputs), and which cache folders it reads code from and whether they are private to
the user (``graphgear.cache.store``). :func:`collect` gathers all of it as plain data;
:func:`format_report` lays it out as text. No missing piece (transformers, a compiler,
git, ``/proc/cpuinfo``) makes either raise: the value is then None, shown as
"not found".

:func:`run_metadata` is the part every benchmark result carries (versions, threads, CPU
model, git commit), so that a figure can be traced to the machine and code that made it.
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from . import __version__
from ._torch.inductor import has_triton
from ._torch.storage import storage_poisoner_builtin
from ._torch.toolchain import inductor_cpp_compiler, inductor_default_cache_dir, inductor_pick_vec_isa
from .cache.store import CACHE_ENV_VAR, INDUCTOR_ENV_VAR, cache_folder, default_cache_root, unsafe_reason
from .capture.liveness import build_extension, extension_dir

log = logging.getLogger(__name__)

__all__ = ["NOT_FOUND", "collect", "cpu_model", "format_report", "git_commit", "run_metadata"]

#: how the text report shows a value that could not be found
NOT_FOUND = "not found"

#: environment variables that change what graphgear, Inductor or the bench do
VARIABLES = (CACHE_ENV_VAR, INDUCTOR_ENV_VAR, "GRAPHGEAR_EXTENSIONS_DIR", "GRAPHGEAR_BUILD_TIMEOUT",
             "XDG_CACHE_HOME", "CXX", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
             "HF_HUB_OFFLINE")


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    """``cmd``'s stripped stdout, or None when it cannot run, fails or takes too long."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``, else ``sysctl`` on macOS, else
    ``platform.processor()``), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        name = _run(["sysctl", "-n", "machdep.cpu.brand_string"], timeout=5.0)
        if name:
            return name
    return platform.processor() or None


def git_commit() -> str | None:
    """The commit of the graphgear checkout this package runs from, or None when it is
    not in one (an installed wheel). A git repository that merely contains the install
    (a virtual environment inside some project) does not count: its top level must hold
    this very package at ``src/graphgear``."""
    pkg = Path(__file__).resolve().parent
    out = _run(["git", "-C", str(pkg), "rev-parse", "--show-toplevel", "HEAD"], timeout=5.0)
    if not out or len(out.splitlines()) != 2:
        return None
    top, commit = out.splitlines()
    try:
        if (Path(top) / "src" / "graphgear").resolve() != pkg:
            return None
    except OSError:
        return None
    return commit


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run_metadata() -> dict[str, Any]:
    """Where a benchmark figure comes from: versions, threads, CPU model, commit, time."""
    return {
        "graphgear": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _folder(path: str, source: str, *, follow_symlinks: bool = False) -> dict[str, Any]:
    """A folder graphgear or Inductor loads code from: does it exist, and does it pass
    graphgear's trust check (a directory of the current user's, closed to others)."""
    exists = os.path.isdir(path)
    reason = unsafe_reason(path, follow_symlinks=follow_symlinks) if exists else None
    return {"path": path, "source": source, "exists": exists,
            "trusted": (reason is None) if exists else None, "reason": reason}


def _inductor_choice() -> str | None:
    """``$TORCHINDUCTOR_CACHE_DIR`` when someone chose it: importing ``torch._dynamo``
    writes torch's default folder there, which is no choice."""
    current = os.environ.get(INDUCTOR_ENV_VAR)
    default = inductor_default_cache_dir()
    if current and default and os.path.abspath(current) == os.path.abspath(default):
        return None
    return current or None


def _caches() -> dict[str, dict[str, Any]]:
    default = inductor_default_cache_dir()
    current = _inductor_choice()
    inductor = (_folder(os.path.abspath(current), f"${INDUCTOR_ENV_VAR}") if current
                else _folder(default, "torch's default, in the shared temporary folder") if default
                else {"path": None, "source": "not found", "exists": False, "trusted": None, "reason": None})
    root = cache_folder()
    ext = extension_dir().parent
    return {
        "inductor": inductor,
        # what graphgear bench, the tests and the benchmarks set TORCHINDUCTOR_CACHE_DIR to
        # (graphgear.cache.store.use_private_inductor_cache)
        "graphgear_inductor": _folder(os.path.join(default_cache_root(), "graphgear", "inductor"),
                                      "use_private_inductor_cache"),
        "compile_cache": _folder(root, f"${CACHE_ENV_VAR}" if os.environ.get(CACHE_ENV_VAR) else "default",
                                 follow_symlinks=True),
        "extensions": _folder(str(ext), "$GRAPHGEAR_EXTENSIONS_DIR" if os.environ.get("GRAPHGEAR_EXTENSIONS_DIR")
                              else "default"),
    }


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _liveness(build: bool) -> dict[str, Any]:
    """Whether reduce-overhead can poison stale outputs: torch's own poison (CUDA
    builds), else graphgear's extension, built here when it is not yet (about 30 s)."""
    if storage_poisoner_builtin() is not None:
        return {"status": "built into torch", "ok": True, "detail": None}
    folder = extension_dir()
    if not build and not (folder.is_dir() and any(folder.glob("*.so"))):  # built before: load it
        return {"status": "not checked", "ok": None, "detail": f"--no-build; it would build in {folder}"}
    existed = folder.is_dir()
    target = logging.getLogger("graphgear.capture.liveness")
    handler, propagate = _Collect(), target.propagate
    target.addHandler(handler)
    target.propagate = False  # the reason goes into the report, not onto stderr as well
    try:
        mod = build_extension(folder)
    except Exception as e:  # build_extension reports its failures itself; anything else here
        mod, handler.messages = None, [f"{type(e).__name__}: {e}"]
    finally:
        target.removeHandler(handler)
        target.propagate = propagate
    if mod is not None:
        return {"status": "builds", "ok": True,
                "detail": f"{'loaded from' if existed else 'built in'} {folder}"}
    return {"status": "does not build", "ok": False,
            "detail": " ".join(handler.messages) or f"no module in {folder}"}


def _compiler() -> dict[str, Any]:
    name = inductor_cpp_compiler()
    version = _run([name, "--version"]) if name else None
    return {"name": name, "path": shutil.which(name) if name else None,
            "version": version.splitlines()[0] if version else None}


def _cuda() -> dict[str, Any]:
    try:
        available = torch.cuda.is_available()
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    except Exception as e:  # a broken driver: say so, do not crash the report
        return {"available": False, "version": torch.version.cuda, "devices": [],
                "detail": f"{type(e).__name__}: {e}"}
    detail = None if available else ("this torch is built without CUDA" if torch.version.cuda is None
                                      else "no CUDA device visible")
    return {"available": available, "version": torch.version.cuda, "devices": devices, "detail": detail}


def _npu() -> dict[str, Any]:
    if importlib.util.find_spec("torch_npu") is None:
        return {"available": False, "devices": 0, "detail": "torch_npu not installed"}
    try:
        import torch_npu  # noqa: F401

        npu = getattr(torch, "npu")  # noqa: B009 - torch_npu adds it
        available = bool(npu.is_available())
        return {"available": available, "devices": int(npu.device_count()) if available else 0,
                "detail": None if available else "torch_npu sees no NPU"}
    except Exception as e:
        return {"available": False, "devices": 0, "detail": f"torch_npu fails to load: {type(e).__name__}: {e}"}


def collect(*, build_liveness: bool = True) -> dict[str, Any]:
    """Everything ``graphgear env`` reports, as JSON-ready data (None: not found).
    ``build_liveness=False`` skips building the liveness extension when it is not built
    yet (reported as "not checked")."""
    try:
        triton = has_triton()
    except Exception:
        triton = False
    return {
        "graphgear": {"version": __version__, "path": str(Path(__file__).resolve().parent),
                      "git_commit": git_commit()},
        "torch": {"version": torch.__version__, "git": getattr(torch.version, "git_version", None),
                  "debug": bool(getattr(torch.version, "debug", False)), "path": os.path.dirname(torch.__file__),
                  "triton": triton},
        "transformers": _dist_version("transformers"),
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "os": platform.platform(),
        "cpu": {"model": cpu_model(), "machine": platform.machine(), "cores": os.cpu_count(),
                "threads": torch.get_num_threads()},
        "vector_isa": inductor_pick_vec_isa(),
        "cxx_compiler": _compiler(),
        "liveness_extension": _liveness(build_liveness),
        "caches": _caches(),
        "cuda": _cuda(),
        "npu": _npu(),
        "variables": {k: os.environ[k] for k in VARIABLES
                      if k in os.environ and (k != INDUCTOR_ENV_VAR or _inductor_choice())},
    }


def _or(value: Any) -> str:
    return NOT_FOUND if value is None or value == "" else str(value)


def _folder_line(f: dict[str, Any]) -> str:
    if f["path"] is None:
        return NOT_FOUND
    if not f["exists"]:
        state = "does not exist yet (created private on first use)"
    else:
        state = "trusted" if f["trusted"] else f"NOT TRUSTED: {f['reason']}"
    return f"{f['path']} ({f['source']}; {state})"


def format_report(info: dict[str, Any]) -> str:
    """``collect()``'s data as the aligned text ``graphgear env`` prints."""
    gg, tc, py, cpu, cxx, live = (info[k] for k in ("graphgear", "torch", "python", "cpu", "cxx_compiler",
                                                     "liveness_extension"))
    isa = info["vector_isa"]
    cuda, npu, caches = info["cuda"], info["npu"], info["caches"]
    rows = [
        ("graphgear", f"{gg['version']} ({gg['path']}" + (f", git {gg['git_commit']})" if gg["git_commit"]
                                                            else ", not a git checkout)")),
        ("torch", f"{tc['version']} (git {_or(tc['git'])}{', debug build' if tc['debug'] else ''}; "
                  f"triton {'yes' if tc['triton'] else 'no'})"),
        ("transformers", _or(info["transformers"])),
        ("python", f"{py['version']} ({py['implementation']}, {py['executable']})"),
        ("os", info["os"]),
        ("cpu", f"{_or(cpu['model'])} ({cpu['machine']}, {_or(cpu['cores'])} logical cores, "
                f"torch threads {cpu['threads']})"),
        ("vector ISA (Inductor)", NOT_FOUND if isa is None else isa or "none: scalar code (no ISA passed "
                                                                       "Inductor's probe)"),
        ("C++ compiler", NOT_FOUND if cxx["name"] is None
         else f"{cxx['name']}{'' if cxx['path'] in (None, cxx['name']) else ' = ' + cxx['path']} "
              f"({_or(cxx['version'])})"),
        ("liveness extension", live["status"] + (f" ({live['detail']})" if live["detail"] else "")),
        ("Inductor cache", _folder_line(caches["inductor"])),
        ("  graphgear's private one", _folder_line(caches["graphgear_inductor"])),
        ("compile cache", _folder_line(caches["compile_cache"])),
        ("extensions folder", _folder_line(caches["extensions"])),
        ("CUDA", (f"available, CUDA {cuda['version']}: " + ", ".join(cuda["devices"])) if cuda["available"]
                 else f"not available ({cuda['detail']})"),
        ("NPU", f"available, {npu['devices']} devices" if npu["available"] else f"not available ({npu['detail']})"),
    ]
    rows += [(f"${k}", v) for k, v in info["variables"].items()]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k + ':':<{width}}{v}" for k, v in rows)
