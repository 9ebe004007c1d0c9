"""GPU micro-benchmark of worker/kernels at Llama-3-8B shapes (Hq=32, Hkv=8, D=128, bf16).

Each case first checks the kernel against its PyTorch reference on fresh
random inputs (output NaN-poisoned first), then times it with
triton.testing.do_bench (median; do_bench flushes L2 between runs, so small
cases are not served from cache). GB/s counts the fewest bytes the kernel
must move: each input read once, each output written once. Attention rows
also print TFLOP/s (prefill) over the causal pairs actually computed.

    python bench/engine/kernels.py            # on a CUDA machine; prints one table
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
BYTES = 2  # bf16
EPS = 1e-5
L2_ROTATION_BYTES = 512 << 20  # several times the H200's 60 MB L2


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _time(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _graph_ms(fns) -> float:
    """Median ms per call of fns, all captured in one CUDA graph (as decode runs in
    the worker): no launch overhead, and rotating over several input sets
    keeps each call's K/V out of L2."""
    for fn in fns:
        fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(23):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    return sorted(times[3:])[len(times[3:]) // 2]


def _row(kernel: str, shape: str, err: float, ms: float, nbytes: float, flops: float = 0.0, note: str = "") -> dict:
    return dict(
        kernel=kernel,
        shape=shape,
        err=err,
        ms=ms,
        gbps=nbytes / ms / 1e6,
        tflops=flops / ms / 1e9 if flops else None,
        note=note,
    )


def _paged_batch(seq_lens: list[int], cached_lens: list[int]):
    """Pool and table for requests whose slots are a random permutation of the pool."""
    total = sum(seq_lens)
    pool = torch.randn(total + 1, 2 * HKV, D, device="cuda", dtype=DTYPE)  # [S+1, 2Hkv, D]
    perm = torch.randperm(total, device="cuda", dtype=torch.int32)
    batch = len(seq_lens)
    table = torch.full((batch + 1, max(seq_lens)), total, device="cuda", dtype=torch.int32)
    rows = torch.randperm(batch, device="cuda", dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        table[rows[b], :n] = perm[used : used + n]
        used += n
    to_dev = lambda xs: torch.tensor(xs, device="cuda", dtype=torch.int32)  # noqa: E731
    return pool, table, rows, to_dev(seq_lens), to_dev(cached_lens)


def bench_decode(batch: int, ctx: int) -> dict:
    from worker.model.kernels.attention_reference import decode_attention_ref
    from worker.model.kernels.decode_attention import decode_attention

    kv_bytes = batch * ctx * 2 * HKV * D * BYTES
    copies = max(1, -(-L2_ROTATION_BYTES // kv_bytes))  # input sets the graph rotates over
    pool, table, rows, seq_lens, _ = _paged_batch([ctx] * batch * copies, [ctx - 1] * batch * copies)
    k_cache, v_cache = pool[:, :HKV], pool[:, HKV:]
    q = torch.randn(copies, batch, HQ, D, device="cuda", dtype=DTYPE)  # [copies, B, Hq, D]
    o = torch.full_like(q, float("nan"))
    sets = [
        (q[c], o[c], rows[c * batch : (c + 1) * batch], seq_lens[c * batch : (c + 1) * batch]) for c in range(copies)
    ]

    def step(c: int) -> None:
        qc, oc, rc, sc = sets[c]
        decode_attention(qc, k_cache, v_cache, oc, rc, sc, table, ctx)

    step(0)
    err = _rel_err(o[0], decode_attention_ref(q[0], k_cache, v_cache, rows[:batch], seq_lens[:batch], table))
    eager_ms = _time(lambda: step(0))
    ms = _graph_ms([lambda c=c: step(c) for c in range(copies)])
    err = err if not o.isnan().any() else math.inf
    nbytes = kv_bytes + batch * ctx * 4 + 2 * q[0].numel() * BYTES  # K, V, table; q, o
    return _row("decode_attention", f"B={batch} ctx={ctx}", err, ms, nbytes, note=f"graph; eager {eager_ms:.3f} ms")


def bench_prefill(q_lens: list[int], cached_lens: list[int]) -> dict:
    from worker.model.kernels.attention_reference import context_attention_ref
    from worker.model.kernels.context_attention import context_attention

    seqs = [q + c for q, c in zip(q_lens, cached_lens)]
    pool, table, rows, seq_lens, cached = _paged_batch(seqs, cached_lens)
    k_cache, v_cache = pool[:, :HKV], pool[:, HKV:]
    q_lens_t = torch.tensor(q_lens, device="cuda", dtype=torch.int32)
    q_starts = (torch.cumsum(q_lens_t, 0) - q_lens_t).to(torch.int32)
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=DTYPE)  # [T, Hq, D]
    o = torch.full_like(q, float("nan"))
    index = (q_starts, q_lens_t, cached, seq_lens, rows, table)
    run = lambda: context_attention(q, k_cache, v_cache, o, *index, max(q_lens))  # noqa: E731
    run()
    err = _rel_err(o, context_attention_ref(q, k_cache, v_cache, *index))
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(q_lens, cached_lens))
    nbytes = 2 * q.numel() * BYTES + sum(seqs) * 2 * HKV * D * BYTES
    shape = f"{len(q_lens)}x{q_lens[0]} new" + (f" +{cached_lens[0]} cached" if cached_lens[0] else "")
    return _row("context_attention", shape, err, _time(run), nbytes, flops=4 * HQ * D * pairs)


def bench_copy_kv(num_tokens: int) -> dict:
    from worker.model.kernels.copy_kv import copy_kv, copy_kv_ref

    pool = torch.full((4 * num_tokens + 1, 2 * HKV, D), float("nan"), device="cuda", dtype=DTYPE)
    k = torch.randn(num_tokens, HKV, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(4 * num_tokens, device="cuda")[:num_tokens].to(torch.int32)
    expected = pool.clone()
    copy_kv(k, v, slots, pool)
    copy_kv_ref(k, v, slots, expected)
    err = 0.0 if torch.equal(pool[slots.long()], expected[slots.long()]) else math.inf
    nbytes = 2 * 2 * k.numel() * BYTES + slots.numel() * 4
    return _row("copy_kv", f"T={num_tokens}", err, _time(lambda: copy_kv(k, v, slots, pool)), nbytes)


def bench_rmsnorm(num_tokens: int, hidden: int, fused: bool) -> dict:
    from worker.model.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref

    x = torch.randn(num_tokens, hidden, device="cuda", dtype=DTYPE)
    res = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(DTYPE)
    y, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    if fused:
        run = lambda: fused_add_rmsnorm(x, res, w, EPS, out=y, residual_out=res_out)  # noqa: E731
        run()
        y_ref, res_ref = fused_add_rmsnorm_ref(x, res, w, EPS)
        err = max(_rel_err(y, y_ref), _rel_err(res_out, res_ref))
        nbytes = 5 * x.numel() * BYTES  # read x, residual; write y, residual_out
    else:
        run = lambda: rmsnorm(x, w, EPS, out=y)  # noqa: E731
        run()
        err, nbytes = _rel_err(y, rmsnorm_ref(x, w, EPS)), 2 * x.numel() * BYTES
    name = "fused_add_rmsnorm" if fused else "rmsnorm"
    return _row(name, f"{num_tokens}x{hidden}", err, _time(run), nbytes)


def bench_silu_and_mul(num_tokens: int, n_cols: int) -> dict:
    from worker.model.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

    x = torch.randn(num_tokens, 2 * n_cols, device="cuda", dtype=DTYPE)  # [T, 2N]
    out = torch.full((num_tokens, n_cols), float("nan"), device="cuda", dtype=DTYPE)
    run = lambda: silu_and_mul(x, out=out)  # noqa: E731
    run()
    err = _rel_err(out, silu_and_mul_ref(x))
    return _row("silu_and_mul", f"{num_tokens}x{n_cols}", err, _time(run), 3 * out.numel() * BYTES)


def bench_rotary(num_tokens: int) -> dict:
    from worker.model.kernels.rotary import rotary_embedding, rotary_embedding_ref

    qkv = torch.randn(num_tokens, HQ + 2 * HKV, D, device="cuda", dtype=DTYPE)  # fused projection
    q, k = qkv[:, :HQ], qkv[:, HQ : HQ + HKV]
    angles = torch.rand(num_tokens, D // 2, device="cuda") * 6.28
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    q_ref, k_ref = rotary_embedding_ref(q, cos, sin), rotary_embedding_ref(k, cos, sin)
    rotary_embedding(q, k, cos, sin)
    err = max(_rel_err(q, q_ref), _rel_err(k, k_ref))
    # In place: timing keeps rotating the same tensors, which changes values but not cost.
    nbytes = 2 * (q.numel() + k.numel()) * BYTES + 2 * cos.numel() * BYTES
    return _row("rotary", f"T={num_tokens}", err, _time(lambda: rotary_embedding(q, k, cos, sin)), nbytes)


CASES = [
    *[(bench_decode, (b, ctx)) for b in (1, 32, 256) for ctx in (1024, 4096)],
    (bench_prefill, ([8192], [0])),
    (bench_prefill, ([2048] * 4, [0] * 4)),
    (bench_prefill, ([1024] * 8, [1024] * 8)),
    (bench_copy_kv, (8192,)),
    (bench_copy_kv, (256,)),
    (bench_rmsnorm, (8192, 4096, True)),
    (bench_rmsnorm, (8192, 4096, False)),
    (bench_silu_and_mul, (8192, 14336)),
    (bench_rotary, (8192,)),
]
TOLERANCE = 2e-2  # relative L2 error of bf16 against the fp32 references


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/engine/kernels.py needs a CUDA device", file=sys.stderr)
        return 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
    torch.manual_seed(0)
    rows = []
    for fn, args in CASES:
        rows.append(fn(*args))
        torch.cuda.empty_cache()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  Hq={HQ} Hkv={HKV} D={D} {DTYPE}")
    print(f"{'kernel':<18} {'shape':<24} {'rel err':>8} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8}  note")
    for r in rows:
        tflops = f"{r['tflops']:8.1f}" if r["tflops"] else ""
        flag = "" if r["err"] < TOLERANCE else "MISMATCH "
        print(
            f"{r['kernel']:<18} {r['shape']:<24} {r['err']:8.1e} {r['ms']:9.4f} {r['gbps']:8.0f} {tflops:>8}"
            f"  {flag}{r['note']}"
        )
    return 0 if all(r["err"] < TOLERANCE for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
