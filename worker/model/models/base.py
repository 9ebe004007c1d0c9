"""What every lightq decoder shares: the attributes the loader and runner read,
the attention-backend hook, the forward skeleton and checkpoint loading.

An architecture subclasses ``CausalLM`` and supplies its modules through
three hooks (``embed``, ``decoder_layers``, ``final_norm``) plus ``lm_head``;
its parameter names follow its transformers checkpoint, and where it fuses
projections into one matmul it maps checkpoint names onto row ranges
(shards) of the fused parameter with ``checkpoint_target`` / ``shard_sizes``.

Tensor parallel (``tp.size`` N > 1, one process per GPU, each running the
same forward on the same batch): attention heads and MLP columns are split
(column- then row-parallel linears, see ``worker.model.layers``), the vocabulary is
split for the embedding and the output layer, and ``num_kv_heads`` is this
rank's share, so each rank's KV pool holds its heads only. Each rank reads
the whole checkpoint and keeps its slice of every split parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn

from worker.model import fp8
from worker.model.attention import AttentionBackend
from worker.model.forward_batch import ForwardBatch
from worker.model.layers import SINGLE, SmallBatchGemm, TensorParallel, empty_param
from worker.model.quant import FP8


class VocabEmbedding(nn.Module):
    """Token embeddings [V, H]; tensor parallel, rank r holds rows [r V/N, (r+1) V/N).

    A rank looks up the ids it holds and gives zeros for the others; the
    all-reduce then adds the owner's row, so every rank ends with every row.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.rows = tp.part(vocab_size, "vocab_size")
        self.start = tp.rank * self.rows
        self.weight = empty_param(self.rows, hidden_size, dtype=dtype, device=device)
        self.weight.tp_dim = 0
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, H]."""
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)  # [T]
        h = nn.functional.embedding(local.clamp(0, self.rows - 1), self.weight)
        return self.tp.all_reduce(h.masked_fill_(~mine[:, None], 0))


class VocabHead(nn.Module):
    """The output layer, logits = h W^T [B, V] (no bias); tensor parallel, rank r
    computes its V/N vocabulary rows and an all-gather joins them. The split is
    the embedding's, so a tied head is the embedding's own shard."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.weight = empty_param(tp.part(vocab_size, "vocab_size"), hidden_size, dtype=dtype, device=device)
        self.weight.tp_dim = 0
        self.tp = tp
        self.bias = None
        self.small: SmallBatchGemm | None = None  # set by pack_for_small_batches (CPU)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.small is not None and h.shape[0] <= self.small.max_rows:
            return self.tp.all_gather(self.small(h))
        return self.tp.all_gather(nn.functional.linear(h, self.weight))  # [B, V/N] per rank -> [B, V]


class CausalLM(nn.Module):
    """forward(batch) -> fp32 logits [B, vocab] of each request's last new token.

    The attention backend is set after construction (``set_backend``)
    because the KV pool is sized from the memory the weights leave.
    """

    # Checkpoint tensors that carry no weights (recomputed from the config).
    ignored_suffixes: tuple[str, ...] = ()

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend | None,
        tp: TensorParallel,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        # What the loader sizes the KV pool with: this rank's KV heads.
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = tp.part(num_kv_heads, "key-value heads")
        self.head_dim = head_dim
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.backend = backend
        self.lora = None  # worker.lora.adapter_set.AdapterSet, once adapters are installed

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def tie_lm_head(self, embedding: VocabEmbedding) -> None:
        """One tensor, two names: named_parameters() lists it once, as the embedding."""
        if self.tied:
            self.lm_head.weight = embedding.weight

    # --- hooks -------------------------------------------------------------

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, object]:
        """(hidden states [T, H], what every layer takes besides, e.g. rotary cos/sin)."""
        raise NotImplementedError

    def decoder_layers(self) -> Iterable[nn.Module]:
        """Layers called as ``layer(h, pending, extra, batch, backend) -> (h, pending)``: h is the
        residual stream, pending a sublayer output not yet added to it (None: nothing), which
        the next layer may fuse into its first norm (one kernel for add + norm on CUDA)."""
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
        pending = None
        with self.lora.bind(batch) if self.lora is not None else nullcontext():  # LoraLinear reads its slots
            for layer in self.decoder_layers():
                h, pending = layer(h, pending, extra, batch, self.backend)
        # Only the last new token of each request is sampled from (unless the batch asks for more,
        # batch.logit_index); the final norm is per token, so selecting first saves the rest.
        last = batch.output_index.long()
        last = self.final_norm(h[last] if pending is None else h[last] + pending[last])  # [B or N, H]
        return self.lm_head(last).float()  # [B or N, V]

    # --- weights -----------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into the parameters.

        Consumes the iterable one tensor at a time, so the caller can stream
        from disk. Raises KeyError on an unknown name, ValueError on a shape
        mismatch or when a parameter (or a shard of a fused one) was never given.
        FP8 layers (``worker.model.fp8.prepare``) take FP8 weights as they are, their
        scales as ``fp8.fit_scale`` shapes them, and full-precision weights quantised.
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
            tensor = self._rank_slice(params[target], tensor, dst)
            scales = None
            if dst.dtype == FP8:
                tensor, scales = fp8.fit_weight(name, tensor, dst)
            elif target.endswith(".weight_scale"):
                tensor = fp8.fit_scale(tensor, dst)
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.setdefault(target, set()).add(shard)
            if scales is not None:  # a full-precision weight quantised here: its rows' scales too
                scale_name = target.removesuffix("weight") + "weight_scale"
                self._shard_view(params[scale_name], scale_name, shard).copy_(scales)
                filled.setdefault(scale_name, set()).add(shard)
        self._check_filled(params, filled)

    def _shard_view(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """The rows of ``param`` that shard ``shard`` of a fused projection owns."""
        sizes = self.shard_sizes(name, param)
        if sizes is None:
            return param.data
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _rank_slice(self, param: torch.Tensor, tensor: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole checkpoint tensor, along the parameter's tp_dim."""
        dim = getattr(param, "tp_dim", None)
        if dim is None or self.tp.size == 1 or tensor.dim() <= dim:  # a per-tensor scale: every rank's
            return tensor
        n = dst.shape[dim]
        if tensor.shape[dim] != n * self.tp.size:
            return tensor  # the shape check that follows names the mismatch
        return tensor.narrow(dim, self.tp.rank * n, n)

    def _check_filled(self, params: dict[str, torch.Tensor], filled: dict[str, set[int]]) -> None:
        missing = [
            name for name, p in params.items() if len(filled.get(name, ())) < len(self.shard_sizes(name, p) or [0])
        ]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:4]}")
