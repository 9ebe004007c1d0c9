"""lightq's benchmarks, in rooms by kind; their figures are in bench/RESULTS.md, which opens with the current ones.

- ``bench.serving``: the serving path, measured through ``lightq serve`` (producer, Redis, router, workers):
  throughput, latency, Redis cost, fairness, routing, chaos, the CPU default against transformers.
- ``bench.engine``: the engine and its kernels without the serving path, mostly on a GPU with dummy weights at a
  real model's shape (``bench.engine.shapes``): offline throughput, decode and prefill steps, FP8, the prefix cache.
- ``bench.sim``: simulators: the real router (or its admission check) against simulated workers, no model.
- ``bench.workloads``: the request workloads the others draw from (ShareGPT-like lengths, repeated prefixes).
- ``bench/device/`` (shell, not a package): the scripts behind RESULTS.md's H200 rows, as run on a device host.

Each module runs as ``python -m bench.ROOM.MODULE`` from the repository root (``--help`` prints its docstring).
"""
