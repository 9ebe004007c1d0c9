"""The request workloads the benchmarks and simulators draw from, with synthetic token ids (no dataset download).

``sharegpt`` (ShareGPT-like input and output lengths, filtered as vLLM filters ShareGPT), ``prefix_workloads``
(prompts that repeat, for the prefix cache: SGLang's generated-shared-prefix and multi-turn chats) and ``admission``
(the admission simulator's request-length workloads; ``bench/workloads.py`` before bench/ had rooms).
"""
