"""Llama-architecture decoder (Llama 2/3, SmolLM), and the base of the Llama-like
families (Qwen2, Mistral), which differ only in the switches at the end of
``LlamaForCausalLM``: projection biases and a per-layer sliding window.

Runs on one step's packed tokens (a ``ForwardBatch``), no padding: every
tensor is ``[T, ...]`` with T the new tokens of all requests together. K/V
go to and come from the TokenAttention pool through the attention backend
(see ``worker.model.models.base``).

Parameter names follow transformers' Llama, except that q/k/v are fused into
``qkv_proj`` (rows [q; k; v]) and gate/up into ``gate_up_proj`` (rows
[gate; up]) so each is one matmul; ``checkpoint_target`` maps checkpoint names.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.forward_batch import ForwardBatch
from worker.model.layers import SINGLE, Linear, RMSNorm, Rotary, SwiGLU, TensorParallel
from worker.model.models.base import CausalLM, VocabEmbedding, VocabHead
from worker.model.ops import ops_for

# checkpoint projection name -> (fused parameter's module name, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, D] of this step's positions


class LlamaAttention(nn.Module):
    """Tensor parallel: this rank's Hq/N query and Hkv/N KV heads (column), o_proj row-parallel."""

    def __init__(
        self,
        config,
        layer: int,
        arch: type[LlamaForCausalLM],
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel,
    ):
        super().__init__()
        self.layer = layer
        self.num_heads = tp.part(config.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.part(config.num_key_value_heads, "key-value heads")
        self.head_dim = head_dim_of(config)
        self.window = arch.sliding_window(config, layer)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim  # this rank's
        self.shard_sizes = [q_size, kv_size, kv_size]
        hidden, n = config.hidden_size, tp.size
        self.qkv_proj = Linear(hidden, n * (q_size + 2 * kv_size), arch.qkv_bias(config), dtype, device, tp, "column")
        self.o_proj = Linear(n * q_size, hidden, arch.o_bias(config), dtype, device, tp, "row")
        self.ops = ops_for(device)

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.shard_sizes, dim=-1)
        q, k = self.ops.rotate(
            q.view(T, self.num_heads, self.head_dim),  # [T, Hq, D]
            k.view(T, self.num_kv_heads, self.head_dim),
            *rope,
        )  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        out = backend.forward(self.layer, q, k, v, batch, window=self.window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, -1))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer: int,
        arch: type[LlamaForCausalLM],
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel,
    ):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer, arch, dtype, device, tp)
        self.mlp = SwiGLU(hidden, config.intermediate_size, arch.mlp_bias(config), dtype, device, tp)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)

    def forward(
        self, h: torch.Tensor, pending: torch.Tensor | None, rope: Rope, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, pending) -> (h, this layer's MLP output): each residual add is fused into the norm
        after it, the MLP's into the next layer's (``CausalLM.decoder_layers``)."""
        norm, fp8 = self.input_layernorm, self.self_attn.qkv_proj.takes_quantized_rows  # the norm quantises
        x, h = (norm(h, fp8), h) if pending is None else norm.add_norm(pending, h, fp8)
        fp8 = self.mlp.gate_up_proj.takes_quantized_rows
        x, h = self.post_attention_layernorm.add_norm(self.self_attn(x, rope, batch, backend), h, fp8)
        return h, self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(
        self, config, arch: type[LlamaForCausalLM], dtype: torch.dtype, device: torch.device | str, tp: TensorParallel
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, arch, dtype, device, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary = Rotary(config, head_dim_of(config), device)


class LlamaForCausalLM(CausalLM):
    """forward(batch) -> fp32 logits [B, vocab] of each request's last new token."""

    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: AttentionBackend | None = None,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__(config, dtype, config.num_key_value_heads, head_dim_of(config), backend, tp)
        self.model = LlamaModel(config, type(self), dtype, device, tp)
        self.lm_head = VocabHead(config.hidden_size, config.vocab_size, dtype, device, tp)
        self.tie_lm_head(self.model.embed_tokens)

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, Rope]:
        h = self.model.embed_tokens(batch.input_ids.long())  # [T, H]
        return h, self.model.rotary(batch.positions, h.dtype)  # cos, sin [T, 1, D]

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def checkpoint_target(self, name: str) -> tuple[str, int]:
        for proj, (fused, shard) in _FUSED.items():
            if f".{proj}." in name:
                return name.replace(f".{proj}.", f".{fused}."), shard
        return name, 0

    def shard_sizes(self, name: str, param: torch.Tensor) -> list[int] | None:
        if ".qkv_proj." in name:
            kv_size = self.num_kv_heads * self.head_dim
            return [self.tp.part(self.config.num_attention_heads, "attention heads") * self.head_dim, kv_size, kv_size]
        if ".gate_up_proj." in name:
            return [param.shape[0] // 2] * 2
        return None

    # --- what the Llama-like families change (classmethods: read while building the layers) ---

    @classmethod
    def qkv_bias(cls, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @classmethod
    def o_bias(cls, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @classmethod
    def mlp_bias(cls, config) -> bool:
        return bool(getattr(config, "mlp_bias", False))

    @classmethod
    def sliding_window(cls, config, layer: int) -> int | None:
        """Layer ``layer``'s attention window (keys within the last W positions), None for full."""
        return None


def head_dim_of(config) -> int:
    """config.head_dim when given (it may differ from hidden/heads), else hidden/heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
