"""What every lightq decoder shares: the attributes the loader and runner read,
the attention-backend hook, the forward skeleton and checkpoint loading.

An architecture subclasses ``CausalLM`` and supplies its modules through
three hooks (``embed``, ``decoder_layers``, ``final_norm``) plus ``lm_head``;
its parameter names follow its transformers checkpoint, and where it fuses
projections into one matmul it maps checkpoint names onto row ranges
(shards) of the fused parameter with ``checkpoint_target`` / ``shard_sizes``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from worker.attention import AttentionBackend
from worker.forward_batch import ForwardBatch


class CausalLM(nn.Module):
    """forward(batch) -> fp32 logits [B, vocab] of each request's last new token.

    The attention backend is set after construction (``set_backend``)
    because the KV pool is sized from the memory the weights leave.
    """

    # Checkpoint tensors that carry no weights (recomputed from the config).
    ignored_suffixes: tuple[str, ...] = ()

    def __init__(self, config, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend | None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        # What the loader sizes the KV pool with.
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.backend = backend

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def tie_lm_head(self, embedding: nn.Embedding) -> None:
        """One tensor, two names: named_parameters() lists it once, as the embedding."""
        if self.tied:
            self.lm_head.weight = embedding.weight

    # --- hooks -------------------------------------------------------------

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, object]:
        """(hidden states [T, H], what every layer takes besides, e.g. rotary cos/sin)."""
        raise NotImplementedError

    def decoder_layers(self) -> Iterable[nn.Module]:
        """Layers called as ``layer(h, extra, batch, backend) -> h``."""
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def checkpoint_target(self, name: str) -> tuple[str, int]:
        """Checkpoint name -> (our parameter name, shard index; 0 when unfused)."""
        return name, 0

    def shard_sizes(self, name: str, param: torch.Tensor) -> list[int] | None:
        """Rows of each shard of a fused parameter, in order; None when unfused."""
        return None

    # --- forward -----------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError("no attention backend: call set_backend() once the KV cache exists")
        h, extra = self.embed(batch)  # [T, H]
        for layer in self.decoder_layers():
            h = layer(h, extra, batch, self.backend)
        # Only the last new token of each request is sampled from; the final
        # norm is per token, so selecting first saves the rest of the work.
        last = self.final_norm(h[batch.last_token_index.long()])  # [B, H]
        return self.lm_head(last).float()  # [B, V]

    # --- weights -----------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into the parameters.

        Consumes the iterable one tensor at a time, so the caller can stream
        from disk. Raises KeyError on an unknown name, ValueError on a shape
        mismatch or when a parameter (or a shard of a fused one) was never given.
        """
        params = dict(self.named_parameters())
        filled: dict[str, set[int]] = {}
        for name, tensor in named_tensors:
            if name.endswith(self.ignored_suffixes):
                continue
            target, shard = self.checkpoint_target(name)
            if self.tied and target == "lm_head.weight":
                continue  # the embedding, already loaded under its own name
            if target not in params:
                raise KeyError(f"checkpoint tensor {name} matches no parameter of {type(self).__name__}")
            dst = self._shard_view(params[target], target, shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.setdefault(target, set()).add(shard)
        self._check_filled(params, filled)

    def _shard_view(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """The rows of ``param`` that shard ``shard`` of a fused projection owns."""
        sizes = self.shard_sizes(name, param)
        if sizes is None:
            return param.data
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _check_filled(self, params: dict[str, torch.Tensor], filled: dict[str, set[int]]) -> None:
        missing = [name for name, p in params.items()
                   if len(filled.get(name, ())) < len(self.shard_sizes(name, p) or [0])]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:4]}")
