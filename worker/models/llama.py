"""Llama-architecture decoder (Llama 2/3, SmolLM, Mistral-like dense models).

Runs on one step's packed tokens (a ``ForwardBatch``), no padding: every
tensor is ``[T, ...]`` with T the new tokens of all requests together. K/V
go to and come from the TokenAttention pool through the attention backend,
which is set after construction (``set_backend``) because the pool is sized
from the memory left once the weights are in place.

Parameter names follow transformers' Llama, except that q/k/v are fused into
``qkv_proj`` (rows [q; k; v]) and gate/up into ``gate_up_proj`` (rows
[gate; up]) so each is one matmul; ``load_weights`` maps checkpoint names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from worker.attention import AttentionBackend
from worker.forward_batch import ForwardBatch
from worker.layers import Linear, RMSNorm, Rotary, SwiGLU, on_cuda, rotate_torch, rotate_triton

# checkpoint projection name -> (fused parameter's module name, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Checkpoint tensors that carry no weights (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.shard_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias, dtype, device)
        self.o_proj = Linear(q_size, config.hidden_size, bias, dtype, device)
        self.rotate = rotate_triton if on_cuda(device) else rotate_torch

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.shard_sizes, dim=-1)
        q, k = self.rotate(q.view(T, self.num_heads, self.head_dim),  # [T, Hq, D]
                           k.view(T, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        out = backend.forward(self.layer, q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, -1))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer, dtype, device)
        self.mlp = SwiGLU(hidden, config.intermediate_size, getattr(config, "mlp_bias", False), dtype, device)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        # Passing _weight skips nn.Embedding's random init (weights are loaded later).
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight, _freeze=True)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary = Rotary(config, head_dim_of(config), device)


class LlamaForCausalLM(nn.Module):
    """forward(batch) -> fp32 logits [B, vocab] of each request's last new token."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        if self.tied:
            # One tensor, two names: named_parameters() lists it once, as the embedding.
            self.lm_head.weight = self.model.embed_tokens.weight
        self.backend = backend

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError("no attention backend: call set_backend() once the KV cache exists")
        h = self.model.embed_tokens(batch.input_ids.long())  # [T, H]
        cos, sin = self.model.rotary(batch.positions, h.dtype)  # [T, 1, D] each
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, self.backend)
        # Only the last new token of each request is sampled from; the final
        # norm is per token, so selecting first saves the rest of the work.
        last = self.model.norm(h[batch.last_token_index.long()])  # [B, H]
        return self.lm_head(last).float()  # [B, V]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into the parameters.

        Consumes the iterable one tensor at a time, so the caller can stream
        from disk. Raises KeyError on an unknown name, ValueError on a shape
        mismatch or when a parameter (or a shard of a fused one) was never given.
        """
        params = dict(self.named_parameters())
        filled: dict[str, set[int]] = {}
        for name, tensor in named_tensors:
            if name.endswith(_IGNORED_SUFFIXES) or (self.tied and name == "lm_head.weight"):
                continue
            target, shard = self._target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name} matches no parameter of {type(self).__name__}")
            dst = self._shard_view(params[target], target, shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.setdefault(target, set()).add(shard)
        self._check_filled(params, filled)

    def _target(self, name: str) -> tuple[str, int]:
        """Checkpoint name -> (our parameter name, shard index; 0 when unfused)."""
        for proj, (fused, shard) in _FUSED.items():
            if f".{proj}." in name:
                return name.replace(f".{proj}.", f".{fused}."), shard
        return name, 0

    def _shard_view(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """The rows of ``param`` that shard ``shard`` of a fused projection owns."""
        if ".qkv_proj." in name:
            sizes = [self.config.num_attention_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        elif ".gate_up_proj." in name:
            sizes = [param.shape[0] // 2] * 2
        else:
            return param.data
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _check_filled(self, params: dict[str, torch.Tensor], filled: dict[str, set[int]]) -> None:
        missing = []
        for name in params:
            shards = 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
            if len(filled.get(name, ())) < shards:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:4]}")


def head_dim_of(config) -> int:
    """config.head_dim when given (it may differ from hidden/heads), else hidden/heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
