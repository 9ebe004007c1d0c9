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
Tensor parallel: the per-head layout makes rank r's heads one block of
query_key_value's rows, so the column split needs no reordering; each rank
keeps those heads' ALiBi slopes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.forward_batch import ForwardBatch
from worker.model.layers import SINGLE, LayerNorm, Linear, TensorParallel, alibi_slopes
from worker.model.models.base import CausalLM, VocabEmbedding, VocabHead


class BloomAttention(nn.Module):
    def __init__(self, config, layer: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel):
        super().__init__()
        hidden = config.hidden_size
        self.layer = layer
        self.num_heads = tp.part(config.num_attention_heads, "attention heads")  # this rank's
        self.head_dim = hidden // config.num_attention_heads
        self.query_key_value = Linear(hidden, 3 * hidden, True, dtype, device, tp, "column")  # rows [Hq, 3, D]
        self.dense = Linear(hidden, hidden, True, dtype, device, tp, "row")
        # fp32 whatever the model dtype: the kernels add slope * distance in fp32.
        slopes = alibi_slopes(config.num_attention_heads).view(tp.size, self.num_heads)[tp.rank]
        self.register_buffer("alibi_slopes", slopes.contiguous().to(device), persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.query_key_value(x).view(T, self.num_heads, 3, self.head_dim)  # [T, Hq, 3, D]
        q, k, v = qkv.unbind(2)  # [T, Hq, D] each, strided views (head dim contiguous)
        out = backend.forward(self.layer, q, k, v, batch, alibi_slopes=self.alibi_slopes)  # [T, Hq, D]
        return self.dense(out.reshape(T, -1))  # [T, H]


class BloomMLP(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel):
        super().__init__()
        self.dense_h_to_4h = Linear(hidden, 4 * hidden, True, dtype, device, tp, "column")
        self.dense_4h_to_h = Linear(4 * hidden, hidden, True, dtype, device, tp, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BLOOM's GELU is the tanh approximation (its constant 0.79788456 is sqrt(2/pi) to 8 digits).
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))  # [T, 4H] -> [T, H]


class BloomBlock(nn.Module):
    def __init__(self, config, layer: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.input_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.self_attention = BloomAttention(config, layer, dtype, device, tp)
        self.post_attention_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.mlp = BloomMLP(hidden, dtype, device, tp)
        self.residual_from_norm = bool(config.apply_residual_connection_post_layernorm)

    def forward(
        self, h: torch.Tensor, pending: None, extra: None, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, None]:
        """Leaves nothing pending: BLOOM's LayerNorm has no fused add (``CausalLM.decoder_layers``)."""
        x = self.input_layernorm(h)
        h = (x if self.residual_from_norm else h) + self.self_attention(x, batch, backend)
        x = self.post_attention_layernorm(h)
        return (x if self.residual_from_norm else h) + self.mlp(x), None


class BloomModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden, dtype, device, tp)
        self.word_embeddings_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.h = nn.ModuleList(BloomBlock(config, i, dtype, device, tp) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(hidden, eps, dtype, device)


class BloomForCausalLM(CausalLM):
    """forward(batch) -> fp32 logits [B, vocab] of each request's last new token."""

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: AttentionBackend | None = None,
        tp: TensorParallel = SINGLE,
    ):
        # Multi-head: the pool holds every (of this rank's) head's K/V.
        super().__init__(
            config, dtype, config.num_attention_heads, config.hidden_size // config.num_attention_heads, backend, tp
        )
        self.transformer = BloomModel(config, dtype, device, tp)
        self.lm_head = VocabHead(config.hidden_size, config.vocab_size, dtype, device, tp)
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
