"""The models ``graphgear bench --model NAME`` decodes with, each built from a small
config with random weights (nothing is downloaded):

* ``toy``: the embedded decoder (:mod:`graphgear.bench.toy_decoder`), the default: one
  model for every batch size, so that several batch sizes become gears of one graph;
* ``llama``, ``qwen2``, ``gpt2``: transformers ``LlamaForCausalLM``,
  ``Qwen2ForCausalLM``, ``GPT2LMHeadModel`` of the toy's sizes (hidden 128, 2 layers,
  4 heads, vocab 512, 64 positions), each step over a transformers ``StaticCache``
  (:class:`DecodeStep`). A static cache has one batch size, so each batch size gets
  its own model copy and compile.

Every model is called as ``model(tokens, positions)`` with ``tokens`` of shape
``[batch, 1]`` and ``positions`` a 1-element int64 tensor, returns logits, and has
``reset_cache()``. transformers is imported only for its models, with the Hub offline.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .names import DTYPES, MODELS, check_name
from .toy_decoder import DecoderConfig, ToyDecoder

__all__ = ["BenchModel", "DecodeStep", "build_model", "torch_dtype"]

#: the transformers models' sizes: those of the toy decoder
HF_SIZES: dict[str, int] = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                                num_kv_heads=2, vocab_size=512, max_seq_len=64)


@dataclasses.dataclass
class BenchModel:
    """A model the bench decodes with: ``make(max_batch)`` returns a fresh copy (the
    same weights, an empty cache for batches up to ``max_batch``); ``per_batch``: one
    copy per batch size (a transformers static cache) instead of one for all."""

    name: str
    vocab_size: int
    max_seq_len: int
    per_batch: bool
    make: Callable[[int], nn.Module]


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` as a torch dtype (a ConfigError for any other)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[check_name(name, DTYPES, "dtype")]


class DecodeStep(nn.Module):
    """One decode step of a transformers causal LM over the ``StaticCache`` it owns:
    ``forward(tokens, positions)`` returns the logits, as :class:`ToyDecoder` does. The
    cache keeps its own write position: :meth:`reset_cache` starts it over."""

    def __init__(self, lm: nn.Module, batch_size: int, max_cache_len: int) -> None:
        super().__init__()
        from transformers import StaticCache

        self.lm = lm
        self.cache = StaticCache(config=lm.config, max_cache_len=max_cache_len)
        param = next(lm.parameters())
        # one eager step sizes the cache's tensors (at their fixed addresses) before any
        # compile sees it; then start over
        with torch.no_grad():
            self(torch.zeros(batch_size, 1, dtype=torch.long, device=param.device),
                 torch.zeros(1, dtype=torch.long, device=param.device))
        self.reset_cache()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        position_ids = positions.view(1, 1).expand(tokens.shape[0], 1)
        return self.lm(input_ids=tokens, cache=self.cache, position_ids=position_ids, use_cache=True).logits

    def reset_cache(self) -> None:
        self.cache.reset()


def _transformers(model: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: nothing to download
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"graphgear bench --model {model} builds a transformers model, and transformers is not "
            f"installed: pip install transformers (or pip install 'graphgear[test]'); "
            f"--model toy needs nothing more") from e
    return transformers


def _hf_lm(model: str) -> nn.Module:
    tf = _transformers(model)
    s = HF_SIZES
    if model == "gpt2":
        cfg = tf.GPT2Config(n_embd=s["hidden_size"], n_layer=s["num_layers"], n_head=s["num_heads"],
                            n_inner=s["intermediate_size"], vocab_size=s["vocab_size"],
                            n_positions=s["max_seq_len"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    kw: dict[str, Any] = dict(hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                              num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                              num_key_value_heads=s["num_kv_heads"], vocab_size=s["vocab_size"],
                              max_position_embeddings=s["max_seq_len"], pad_token_id=0,
                              tie_word_embeddings=False)
    if model == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw))


def build_model(name: str, *, dtype: str = "float32", device: str = "cpu", max_batch_size: int = 8,
                seed: int = 0) -> BenchModel:
    """The bench model ``name`` (one of :data:`~graphgear.bench.names.MODELS`) with random
    weights from ``seed``, in ``dtype`` on ``device``. A transformers model without
    transformers installed raises ImportError naming the fix."""
    check_name(name, MODELS, "model")
    dt = torch_dtype(dtype)
    dev = torch.device(device)
    torch.manual_seed(seed)
    if name == "toy":
        cfg = DecoderConfig(max_batch_size=max_batch_size)
        base = ToyDecoder(cfg).eval().to(device=dev, dtype=dt)
        return BenchModel(name, cfg.vocab_size, cfg.max_seq_len, per_batch=False,
                          make=lambda _batch: copy.deepcopy(base))
    lm = _hf_lm(name).eval().to(device=dev, dtype=dt)
    max_len = HF_SIZES["max_seq_len"]
    return BenchModel(name, HF_SIZES["vocab_size"], max_len, per_batch=True,
                      make=lambda batch: DecodeStep(copy.deepcopy(lm), batch, max_len).eval())
