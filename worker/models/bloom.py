"""BLOOM (``BloomForCausalLM``): ALiBi attention, LayerNorms, a GELU MLP.

What differs from Llama, each as transformers' modeling_bloom does it:
- no rotary embedding: ALiBi adds ``slope[h] * (key_pos - query_pos)`` to
  the attention scores, done inside the attention backend (PyTorch reference
  or Triton kernels) from the slopes each attention layer holds;
- LayerNorm (with bias) everywhere, including one right after the embedding;
- one fused ``query_key_value`` projection whose rows are laid out per head,
  ``[num_heads, 3, head_dim]`` (q, k, v interleaved per head, not [q; k; v]),
  used as the checkpoint has it: q, k, v are strided views of its output;
- the MLP is ``dense_4h_to_h(gelu_tanh(dense_h_to_4h(x)))``, all with bias;
- the output layer is the embedding (tied); ``apply_residual_connection_post_layernorm``
  makes the residual branch start from the normed states.
Parameter names are the checkpoint's; bigscience's own files drop the
``transformer.`` prefix (saved from BloomModel), transformers' saves keep it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionBackend
from worker.forward_batch import ForwardBatch
from worker.layers import LayerNorm, Linear, alibi_slopes
from worker.models.base import CausalLM


class BloomAttention(nn.Module):
    def __init__(self, config, layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden = config.hidden_size
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.query_key_value = Linear(hidden, 3 * hidden, True, dtype, device)  # rows [Hq, 3, D]
        self.dense = Linear(hidden, hidden, True, dtype, device)
        # fp32 whatever the model dtype: the kernels add slope * distance in fp32.
        self.register_buffer("alibi_slopes", alibi_slopes(self.num_heads).to(device), persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.query_key_value(x).view(T, self.num_heads, 3, self.head_dim)  # [T, Hq, 3, D]
        q, k, v = qkv.unbind(2)  # [T, Hq, D] each, strided views (head dim contiguous)
        out = backend.forward(self.layer, q, k, v, batch, alibi_slopes=self.alibi_slopes)  # [T, Hq, D]
        return self.dense(out.reshape(T, -1))  # [T, H]


class BloomMLP(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.dense_h_to_4h = Linear(hidden, 4 * hidden, True, dtype, device)
        self.dense_4h_to_h = Linear(4 * hidden, hidden, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BLOOM's GELU is the tanh approximation (its constant 0.79788456 is sqrt(2/pi) to 8 digits).
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))  # [T, 4H] -> [T, H]


class BloomBlock(nn.Module):
    def __init__(self, config, layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.input_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.self_attention = BloomAttention(config, layer, dtype, device)
        self.post_attention_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.mlp = BloomMLP(hidden, dtype, device)
        self.residual_from_norm = bool(config.apply_residual_connection_post_layernorm)

    def forward(self, h: torch.Tensor, extra: None, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        x = self.input_layernorm(h)
        h = (x if self.residual_from_norm else h) + self.self_attention(x, batch, backend)
        x = self.post_attention_layernorm(h)
        return (x if self.residual_from_norm else h) + self.mlp(x)


class BloomModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        # Passing _weight skips nn.Embedding's random init (weights are loaded later).
        weight = torch.empty(config.vocab_size, hidden, dtype=dtype, device=device)
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, _weight=weight, _freeze=True)
        self.word_embeddings_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.h = nn.ModuleList(BloomBlock(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(hidden, eps, dtype, device)


class BloomForCausalLM(CausalLM):
    """forward(batch) -> fp32 logits [B, vocab] of each request's last new token."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend | None = None):
        # Multi-head: the pool holds every head's K/V.
        super().__init__(config, dtype, config.num_attention_heads,
                         config.hidden_size // config.num_attention_heads, backend)
        self.transformer = BloomModel(config, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self.tie_lm_head(self.transformer.word_embeddings)

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, None]:
        h = self.transformer.word_embeddings(batch.input_ids.long())  # [T, H]
        return self.transformer.word_embeddings_layernorm(h), None  # positions enter through ALiBi

    def decoder_layers(self) -> nn.ModuleList:
        return self.transformer.h

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(h)

    def checkpoint_target(self, name: str) -> tuple[str, int]:
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"  # bigscience's files, saved from BloomModel
        return name, 0
