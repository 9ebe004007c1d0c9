"""Benchmarks of the engine and its kernels, without the serving path; mostly on a GPU, with dummy weights at a
real model's shape (``shapes``: ``--model-shape llama3-8b`` and others).

``offline`` (1,000 ShareGPT-like requests at once to one engine, and transformers as a peer; ``offline_schema.json``
its ``--json-schema`` run), ``floor`` (that workload's roofline bound), ``step_profile`` (where a decode step's time
goes), ``decode_step`` (a decode step against its bandwidth floor), ``prefill_profile`` (a prefill step against its
compute floor), ``gemv`` (small-batch matmuls against the weight-read floor), ``kernels`` (worker/kernels against
their PyTorch references), ``decode_attention_tune`` (decode attention's tiles), ``nano_overlap`` (attention under
the matmuls), ``fp8_accuracy``, ``fp8_breakdown`` and ``fp8_error`` (what FP8 costs in accuracy, and where from: in the
model, and on a GPU between cuBLASLt, the quantisers and bf16), ``host_step``
(the host-side cost of a decode step, on a CPU) and ``radix_bench`` (the prefix cache's bookkeeping on a full pool,
on a CPU).
"""
