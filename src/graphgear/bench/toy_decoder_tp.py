"""The embedded decoder (:mod:`graphgear.bench.toy_decoder`) split for tensor parallelism, two ways.

* :func:`megatron` writes the split by hand, Megatron-style: each rank keeps its share
  of the heads (column-parallel q/k/v, a slice of the KV cache) and of the MLP's
  intermediate features (column-parallel gate/up), and the row-parallel out and down
  projections end in an all-reduce (the functional ``all_reduce`` after attention, the
  in-place ``dist.all_reduce`` that dynamo traces after the MLP).
* :func:`dtensor` applies ``torch.distributed.tensor.parallel`` on a device mesh:
  ``ColwiseParallel`` for q/k/v/gate/up, ``RowwiseParallel`` for out/down (DTensor
  inserts the all-reduce), a vocabulary-parallel embedding (``RowwiseParallel`` with
  replicated token ids) and a column-parallel LM head whose output stays a DTensor
  sharded on the vocabulary (``use_local_output=False``).

Both need an initialised process group and give every rank a model whose logits equal
the 1-rank model's (for :func:`dtensor`: ``logits.full_tensor()``). Every rank must build
them from the same full model (the same seed), as a checkpoint loader would.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from .._torch.distributed import functional_all_reduce
from .toy_decoder import Attention, ToyDecoder

__all__ = ["MegatronAttention", "MegatronMLP", "dtensor", "megatron"]


def _check_split(model: ToyDecoder, world: int) -> None:
    cfg = model.cfg
    for what, n in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                    ("vocab_size", cfg.vocab_size)):
        if n % world:
            raise ValueError(f"graphgear.bench.toy_decoder_tp: {what}={n} does not split over {world} ranks; "
                             f"pick a {what} divisible by the world size.")


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


class MegatronAttention(Attention):
    """The toy decoder's attention over this rank's heads (column-parallel q/k/v, a slice
    of the KV cache), a row-parallel out projection, then the functional all-reduce."""

    def __init__(self, full: Attention, rank: int, world: int) -> None:
        nn.Module.__init__(self)
        self.num_heads = full.num_heads // world
        self.head_dim = full.head_dim
        width = self.num_heads * self.head_dim
        cols = slice(rank * width, (rank + 1) * width)
        heads = slice(rank * self.num_heads, (rank + 1) * self.num_heads)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, _linear(getattr(full, name).weight[cols]))
        self.o_proj = _linear(full.o_proj.weight[:, cols])
        self.register_buffer("k_cache", full.k_cache[:, heads].clone(), persistent=False)
        self.register_buffer("v_cache", full.v_cache[:, heads].clone(), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        return functional_all_reduce(super().forward(x, cos, sin, positions, mask), "sum", dist.group.WORLD)


class MegatronMLP(nn.Module):
    """Column-parallel gate/up, row-parallel down, then the in-place ``dist.all_reduce``
    (dynamo traces it into the functional one)."""

    def __init__(self, full: nn.Module, rank: int, world: int) -> None:
        super().__init__()
        n = full.up_proj.weight.shape[0] // world
        cols = slice(rank * n, (rank + 1) * n)
        self.gate_proj = _linear(full.gate_proj.weight[cols])
        self.up_proj = _linear(full.up_proj.weight[cols])
        self.down_proj = _linear(full.down_proj.weight[:, cols])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        dist.all_reduce(out)
        return out


def megatron(model: ToyDecoder, rank: int, world: int) -> ToyDecoder:
    """A copy of ``model`` with each layer's attention and MLP split by hand over
    ``world`` ranks of the default process group; embeddings, norms and the LM head stay
    whole (replicated)."""
    _check_split(model, world)
    tp = copy.deepcopy(model)
    for layer, full in zip(tp.layers, model.layers):
        layer.attn = MegatronAttention(full.attn, rank, world)
        layer.mlp = MegatronMLP(full.mlp, rank, world)
    return tp


def dtensor(model: ToyDecoder, mesh: DeviceMesh) -> ToyDecoder:
    """A copy of ``model`` parallelised with ``torch.distributed.tensor.parallel`` on the
    1-D ``mesh`` (module docstring). Its parameters are DTensors; its forward returns
    the logits as a DTensor sharded on the last dim (``.full_tensor()`` gathers them).

    The attention keeps plain local activations (``use_local_output=True``, the
    default), so it runs over this rank's heads: ``num_heads`` and the KV cache are cut to
    this rank's share, as for :func:`megatron`."""
    if mesh.ndim != 1:
        raise ValueError(f"graphgear.bench.toy_decoder_tp.dtensor: expected a 1-D device mesh, got {mesh.ndim} dims; "
                         f"pass mesh[\"tp\"] of a larger mesh.")
    world, rank = mesh.size(), mesh.get_local_rank()
    _check_split(model, world)
    tp = copy.deepcopy(model)
    parallelize_module(tp, mesh, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                  "lm_head": ColwiseParallel(use_local_output=False)})
    plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in tp.layers:
        parallelize_module(layer, mesh, plan)
        attn = layer.attn
        heads = attn.num_heads // world
        attn.num_heads = heads
        mine = slice(rank * heads, (rank + 1) * heads)
        attn.k_cache = attn.k_cache[:, mine].clone()  # registered buffers: replaced in place
        attn.v_cache = attn.v_cache[:, mine].clone()
    return tp
