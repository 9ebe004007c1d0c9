"""Benchmarks of the serving path: ``lightq serve`` (producer, Redis, router, workers) driven as clients drive it.

``serve_bench`` (LightLLM's/vLLM's serving benchmark against a running lightq; its metrics in ``serve_metrics``),
``whole_path`` (the engine alone, then the same burst through ``lightq serve``), ``cpu_bench`` (the embedded
default on a CPU against transformers' ``generate``), ``path_bench`` (the whole path with no model cost: tokens a
worker delivers), ``redis_cost`` (Redis commands and CPU per token), ``cluster_scale`` (a Redis Cluster of 1 and 3
primaries), ``route_bench`` (cache-aware against least-loaded routing), ``fair_stack`` (priorities and fair shares
on the real stack), ``flush_latency`` (what ``--stream_flush_ms`` costs a stream), ``grammar_stall`` (what a slow
grammar compile costs the other requests), ``scrape_latency`` (``/metrics`` and ``/dashboard/data`` at a burst's
peak), ``load`` (N requests as fast as the producer takes them, none lost) and ``chaos`` (streams while a worker
and the router are killed).
"""
