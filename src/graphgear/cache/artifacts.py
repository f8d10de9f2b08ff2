"""What the compile cache keeps of one AOT graph so a later process rebuilds it without
tracing, passes, specialisation or Inductor compiles (:class:`ArtifactStore`).

An :class:`ArtifactStore` belongs to one graph that AOTAutograd handed to graphgear (an
inference, forward or backward graph). It holds:

* the graph after graphgear's passes, pickled with ``torch.fx``'s ``GraphPickler``
  (the placeholders' and outputs' fake tensors kept, symbolic sizes included; other
  node metadata dropped: unpickling fake tensors with symbolic sizes is slow), and what the pipeline knew about it (stage, input names, static and
  mutated inputs, each input's gears);
* per graph key (a gear, or ``()`` for a static graph), Inductor's compiled graph
  (``CompiledFxGraph``, its generated source and metadata, as AOTAutograd's bundled
  entries hold it): the code the CPU/CUDA graph captures in reduce-overhead (one per
  captured piece of a piecewise graph), or the code max-autotune runs. Graphs of ``frozen_parameter`` are not kept per key: their
  code holds the weights' values, which are not part of the cache key.

Keys are recorded as they are compiled (``version`` counts them), so an entry stored
after ``precompile_gears`` holds every gear; the cache stores again only when
``version`` moved (a new key), never per step. Loading a key that fails (the code
cache's file differs, Inductor cannot import it) returns ``None`` with a warning, and
the pipeline compiles that key as usual.

The store is shared, not copied, by ``copy``/``deepcopy`` (AOTAutograd deep-copies a
loaded entry to serialise it again; the copy must see keys compiled later).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .._torch.serialize import (
    graph_pickle_dumps,
    graph_pickle_loads,
    inductor_output_for_disk,
    inductor_output_load,
)
from ..gears import get_dim_gears, set_dim_gears

log = logging.getLogger(__name__)

__all__ = ["SUBSTITUTES", "ArtifactStore", "KeyArtifact", "allowed_global", "cache_tag", "pieces_signature",
           "strip_cache_tag"]

_TAG = re.compile(r"graphgear-cache:[0-9a-f]+;")


def cache_tag(key: str) -> str:
    """The ``cache_key_tag`` part that makes AOTAutograd's key of a cached compile unique
    to the graphgear cache entry ``key``."""
    return f"graphgear-cache:{key[:32]};"


def strip_cache_tag(tag: str) -> str:
    """``tag`` without :func:`cache_tag` parts: Inductor's FX graph cache keys of
    graphgear's compiles do not depend on the cache entry."""
    return _TAG.sub("", tag)


def pieces_signature(pieces: Sequence[tuple[Sequence[str], int]]) -> str:
    """The signature of a piecewise graph key's stored code: per captured piece its ops
    and its number of inputs. A later process uses the stored pieces only where its own
    cut of the graph has the same signature (else it compiles them)."""
    return repr([(list(ops), int(n)) for ops, n in pieces])


# --------------------------------------------------------------------------- the allow-list

#: every global graphgear's part of an entry may name, per module: the types of
#: AOTAutograd's bundled entry (runtime metadata, its wrappers, the sanitised config,
#: dynamo sources), Inductor's ``CompiledFxGraph`` and its metadata, ``GraphPickler``'s
#: records (graphs, nodes, ops by name, fake tensors, the shape env), the sympy
#: classes of symbolic sizes, graphgear's own records, and plain containers. Names only:
#: no module is allowed whole (a ``sympify``, ``eval``, ``getattr`` or ``os`` global is
#: refused), and what is found is looked up by ``pickle`` as usual. Collected from the
#: entries of the embedded decoder and a transformers Llama in both modes (torch 2.13),
#: plus the other sympy classes Inductor's size expressions use.
_ALLOWED: dict[str, frozenset[str]] = {m: frozenset(n.split()) for m, n in {
    "builtins": "int float bool str bytes tuple list dict set frozenset slice range complex",
    "collections": "Counter OrderedDict defaultdict deque",
    "logging": "getLogger",
    "traceback": "FrameSummary StackSummary",
    "graphgear.cache.artifacts": "ArtifactStore KeyArtifact",
    "graphgear.cache.bundle": "GraphgearOutputCode",
    "sympy.core.add": "Add",
    "sympy.core.mul": "Mul",
    "sympy.core.power": "Pow",
    "sympy.core.mod": "Mod",
    "sympy.core.numbers": "Integer One Zero NegativeOne Rational Half Float Infinity NegativeInfinity",
    "sympy.core.relational": "Equality Unequality LessThan StrictLessThan GreaterThan StrictGreaterThan",
    "sympy.core.symbol": "Symbol",
    "sympy.logic.boolalg": "BooleanFalse BooleanTrue And Or Not",
    "torch": "Size device layout memory_format",
    "torch._dynamo.source": "AttrSource DictGetItemSource GetItemSource LocalSource TensorProperty "
                            "TensorPropertySource UnspecializedBuiltinNNModuleSource "
                            "UnspecializedNNModuleSource UnspecializedParamBufferSource "
                            "GlobalSource ConstantSource NNModuleSource ParamBufferSource "
                            "ChainedSource DefaultsSource GradSource",
    "torch._functorch._aot_autograd.aot_autograd_result": "BundledAOTAutogradResult BundledCompiledForward "
                                                          "BundledCompiledBackward",
    "torch._functorch._aot_autograd.runtime_wrappers": "AOTDedupeWrapper AOTSyntheticBaseWrapper "
                                                       "AOTDispatchSubclassWrapper EffectTokensWrapper "
                                                       "FakifiedOutWrapper FunctionalizedRngRuntimeWrapper",
    "torch._functorch._aot_autograd.schemas": "CacheableAOTConfig InputAliasInfo MutationType OutputAliasInfo "
                                              "OutputType PlainTensorMeta ViewAndMutationMeta SubclassCreationMeta "
                                              "MemoryFormatMeta",
    "torch._guards": "SLoc ShapeGuard",
    "torch._inductor.metrics": "CachedMetricsDeltas",
    "torch._inductor.output_code": "CompiledFxGraph",
    "torch._inductor.triton_bundler": "TritonBundle",
    "torch._inductor.utils": "BoxedBool",
    "torch._subclasses.functional_tensor": "FunctionalTensor",
    "torch._subclasses.meta_utils": "MetaStorageDesc MetaTensorDesc _FakeTensorViewFunc",
    "torch.fx._graph_pickler": "_GraphModulePickleData _GraphModulePickleData.unpickle _GraphPickleData "
                               "_NodePickleData _OpFunctionPickleData _OpOverloadPickleData _OpStrPickleData "
                               "_OpOverloadPacketPickleData _ShapeEnvPickleData _ShapeEnvPickleData.unpickle "
                               "_SymNodePickleData _SymNodePickleData.unpickle_sym_int "
                               "_SymNodePickleData.unpickle_sym_float _SymNodePickleData.unpickle_sym_bool "
                               "_TensorPickleData _TensorPickleData.unpickle _TorchNumpyPickleData",
    "torch.fx.experimental.proxy_tensor": "PythonKeyTracer",
    "torch.fx.experimental.symbolic_shapes": "ShapeEnvSettings ValueRangesSLoc",
    "torch.fx.graph": "CodeGen",
    "torch.fx.immutable_collections": "immutable_dict immutable_list",
    "torch.fx.passes.shape_prop": "TensorMetadata",
    "torch.serialization": "_get_layout",
    "torch._utils": "_rebuild_tensor_v2 torch.contiguous_format torch.channels_last torch.channels_last_3d torch.preserve_format",
    "torch.utils._ordered_set": "OrderedSet",
    # where a graph reads a host value (.item()): the shape env's record of where each
    # unbacked size was made; it pickles only a frame count (its traceback is dropped)
    "torch.utils._traceback": "CapturedTraceback",
    "torch.utils._sympy.functions": "FloorDiv ModularIndexing CleanDiv CeilDiv Max Min PythonMod Mod "
                                    "IntTrueDiv FloatTrueDiv Identity Where ToFloat TruncToInt",
    "torch.utils._sympy.numbers": "IntInfinity NegativeIntInfinity",
    "torch.utils._sympy.value_ranges": "ValueRanges",
}.items()}

_DTYPES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))


def _storage_from_bytes(data: bytes) -> Any:
    """A pickled tensor's storage (the payload of ``torch.storage._load_from_bytes``, a
    ``torch.save`` archive) loaded with ``weights_only=True``: tensors and plain data only,
    where torch's own function would unpickle anything."""
    return torch.load(io.BytesIO(data), weights_only=True)


# Globals an entry may name that resolve to graphgear's safe stand-in, not torch's own:
# a constant tensor in a graph (a closure over a model's buffer) pickles its storage this way.
SUBSTITUTES: dict[tuple[str, str], Any] = {("torch.storage", "_load_from_bytes"): _storage_from_bytes}


def allowed_global(module: str, name: str) -> bool:
    """Whether graphgear's part of a cache entry may name the global ``module.name``
    when unpickled (everything else is refused before it is looked up)."""
    if module == "torch" and name in _DTYPES:
        return True
    names = _ALLOWED.get(module)
    return names is not None and name in names


@dataclasses.dataclass
class KeyArtifact:
    """Inductor's compiled graph of one graph key: ``kind`` ``"static"`` (the code a
    device graph captures, reduce-overhead), ``"pieces"`` (reduce-overhead's piecewise
    capture: ``code`` a list, one compiled graph per captured piece, and ``spec`` the
    pieces' signature, :func:`pieces_signature`) or ``"inductor"`` (max-autotune, with the
    pytree ``spec`` of its outputs when they are nested)."""

    kind: str
    code: Any
    spec: str | None = None


class ArtifactStore:
    """The cache's record of one AOT graph (see the module docstring)."""

    def __init__(self) -> None:
        self.graph: bytes | None = None
        self.meta: dict[str, Any] = {}
        self.keys: dict[tuple[int, ...], KeyArtifact] = {}
        self.version = 0
        self._lock = threading.Lock()

    # ---- first process ---------------------------------------------------------------
    def keep_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], meta: dict[str, Any]) -> None:
        """Pickle ``gm`` (after the passes, before any mode compiler changes it) with
        only its nodes' ``val`` metadata, and keep ``meta`` (builtin values only)."""
        # the dispatch by shape reads the placeholders' and the outputs' values (their
        # symbolic sizes); a key not stored re-traces the graph, which needs none
        out = next(iter(gm.graph.find_nodes(op="output")))
        keep = {*gm.graph.find_nodes(op="placeholder"), *out.all_input_nodes}
        saved = []
        for n in gm.graph.nodes:
            saved.append(n.meta)
            n.meta = {"val": n.meta["val"]} if n in keep and "val" in n.meta else {}
        gm_meta, gm.meta = gm.meta, {}
        try:
            self.graph = graph_pickle_dumps(gm)
        finally:
            gm.meta = gm_meta
            for n, m in zip(gm.graph.nodes, saved):
                n.meta = m
        gears = {}
        for i, a in enumerate(example_inputs):
            g = get_dim_gears(a) if isinstance(a, torch.Tensor) else {}
            if g:
                gears[i] = {int(d): [int(s) for s in sizes] for d, sizes in g.items()}
        self.meta = {**meta, "gears": gears}

    def record(self, key: tuple[int, ...], kind: str, compiled: Any, spec: str | None = None) -> None:
        """Keep Inductor's compiled graph of ``key`` (a copy ready to pickle); for kind
        ``"pieces"``, ``compiled`` is the list of the pieces' compiled graphs."""
        try:
            if kind == "pieces":
                disk: Any = [inductor_output_for_disk(c) for c in compiled]
            else:
                disk = inductor_output_for_disk(compiled)
        except Exception as e:  # not Inductor's CompiledFxGraph: this key is compiled on load
            log.info("graphgear cache: key %s of %s is not stored (%s)", key, self.meta.get("name"), e)
            return
        with self._lock:
            self.keys[tuple(key)] = KeyArtifact(kind, disk, spec)
            self.version += 1

    def recording(self, key: tuple[int, ...], compile_static: Callable[..., Any]) -> Callable[..., Any]:
        """``compile_static`` that also records its result for ``key``."""

        def compile_and_record(gm: fx.GraphModule, args: Sequence[Any], **kw: Any) -> Any:
            compiled = compile_static(gm, args, **kw)
            self.record(key, "static", compiled)
            return compiled

        return compile_and_record

    # ---- later process ---------------------------------------------------------------
    def load_graph(self) -> tuple[fx.GraphModule, list[Any]]:
        """The kept graph and its example inputs (its placeholders' fake tensors, in a
        fresh fake mode, with their gears marked again)."""
        if self.graph is None:
            raise ValueError("the entry holds no graph")
        gm, _ = graph_pickle_loads(self.graph, allowed_global, SUBSTITUTES)
        gm.recompile()
        example_inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
        for i, dims in self.meta.get("gears", {}).items():
            set_dim_gears(example_inputs[int(i)], {int(d): list(s) for d, s in dims.items()})
        return gm, example_inputs

    def load(self, key: tuple[int, ...], kinds: Sequence[str], stage: str) -> KeyArtifact | None:
        """``key``'s compiled graph made runnable (if it is of one of ``kinds``), or None
        (not stored, or it could not be loaded: then it is compiled as usual)."""
        art = self.keys.get(tuple(key))
        if art is None or art.kind not in kinds:
            return None

        def runnable(disk: Any) -> Any:
            return inductor_output_load(copy.copy(disk), is_inference=stage == "inference",
                                        is_backward=stage == "backward")

        try:
            code = [runnable(c) for c in art.code] if art.kind == "pieces" else runnable(art.code)
        except Exception as e:
            log.warning("graphgear cache: could not load the stored code of key %s of %s (%s: %s); "
                        "compiling it instead", key, self.meta.get("name"), type(e).__name__, e)
            return None
        return KeyArtifact(art.kind, code, art.spec)

    # ---- pickling and copies ---------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            return {"graph": self.graph, "meta": self.meta, "keys": dict(self.keys)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.graph, self.meta, self.keys = state["graph"], state["meta"], dict(state["keys"])

    def __copy__(self) -> ArtifactStore:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ArtifactStore:
        return self
