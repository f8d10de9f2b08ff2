"""Models the tests compile: small ones written here, and real third-party models
(Hugging Face ``transformers``) built from small configs with random weights."""

from __future__ import annotations

import torch
from torch import nn

from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder


class Net(nn.Module):
    """One linear layer and a little pointwise work: a graph that compiles fast."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 2 + 1


class CacheWriter(nn.Module):
    """Writes a projection of its input into a cache passed as an input (a KV cache a
    caller owns) and returns the cache's sum: the cache can move between calls."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, self.lin(x))
        return cache.sum(0, keepdim=True)


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class GraphBreakMLP(nn.Module):
    """Two graphs: a print-free but dynamo-unsupported call splits the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(x) * 2


def small_decoder(max_batch_size: int = 8) -> ToyDecoder:
    return ToyDecoder(DecoderConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                    intermediate_size=128, max_seq_len=32,
                                    max_batch_size=max_batch_size))


def hf_llama(**overrides: object) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def hf_qwen2_pair(**overrides: object) -> tuple[object, nn.Module, nn.Module]:
    """A small transformers Qwen2 (grouped-query attention, biased q/k/v) and a second
    instance with the same weights, for eager references: ``(config, model, ref)``;
    ``overrides``: config fields."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields: dict[str, object] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                     max_position_embeddings=64)
    fields.update(overrides)
    cfg = Qwen2Config(**fields)
    torch.manual_seed(0)
    model, ref = Qwen2ForCausalLM(cfg).eval(), Qwen2ForCausalLM(cfg).eval()
    ref.load_state_dict(model.state_dict())
    return cfg, model, ref


def hf_gpt2(**overrides: object) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**cfg)).eval()
