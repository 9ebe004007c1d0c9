"""LoRA adapters loaded and unloaded at run time, the worker's side (issue 32): a tiny random
Llama with --lora_modules' adapter and spare slots (--max_loras); adapters from the registry load
between steps and answer PEFT's greedy tokens in a mixed batch; an unloaded adapter's running
request ends with it, its slot is freed after and a later adapter reuses it exactly; a request
that started elsewhere and moved after the unload brings the adapter back for itself; more adapters
than slots are paged in as requests need them (least recently used out, never one a started
request uses) and still answer PEFT's tokens; one that does not fit is reported and the worker
serves on."""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.lora import AdapterView, LoraRegistry
from shared.model_files import ModelSource
from tests.worker.test_engine import flat, tiny  # noqa: F401 (fixture)
from tests.worker.test_lora import NEW, POOL, PROMPTS, adapters, lora_req  # noqa: F401 (fixture)
from worker.engine.engine import Engine, EngineLimits
from worker.engine.events import Token
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.lora.adapter import load_adapter
from worker.lora.adapter_set import AdapterSet, load_adapters
from worker.lora.runtime import NO_SLOTS, AdapterRuntime
from worker.lora.staging import STALE, Staging
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

MAX_RANK = 16


def runtime_engine(
    folder: str, static: dict[str, str], spare: int, page_batch: int = 1
) -> tuple[Engine, AdapterRuntime]:
    model, config = load_model(ModelSource("hf", folder), torch.float32, "cpu")
    load_adapters([f"{n}={p}" for n, p in static.items()], model, MAX_RANK, spare, page_batch)
    kv = attach_kv_cache(model, POOL, "cpu")
    table = ReqTable(16, 128, kv.hold_slot, "cpu")
    runner = ModelRunner(model, TokenPool(POOL), table, config.vocab_size, torch.device("cpu"))
    rule = AdmissionRule(AdmissionSettings(admission="conservative"))
    engine = Engine(runner, EngineLimits(POOL, 64, 16), eos_ids=set(), rule=rule)
    return engine, AdapterRuntime(runner.adapters, model, MAX_RANK, static)


def step(engine: Engine, tokens: dict[str, list[int]]) -> None:
    for event in flat(engine.step()):
        if isinstance(event, Token):
            tokens.setdefault(event.request_id, []).append(event.token_id)


def run_all(engine: Engine, reqs) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for req in reqs:
        engine.add(req)
    while engine.has_work:
        step(engine, tokens)
    return tokens


def test_run_time_adapters_match_peft_in_a_mixed_batch(tiny, adapters):  # noqa: F811
    folders, want = adapters
    engine, runtime = runtime_engine(tiny[1], {"qv4": folders["qv4"]}, spare=2)
    registry = LoraRegistry(version=1, adapters={"all16": folders["all16"], "mlp8": folders["mlp8"]})
    runtime.update(registry)
    assert runtime.reconcile(set())
    assert runtime.view.serving == ("qv4", "all16", "mlp8") and runtime.view.failed == ()
    names = ["qv4", "all16", "mlp8", None]
    reqs = [lora_req(f"{name}-{i}", p, name) for i, p in enumerate(PROMPTS) for name in names]
    got = run_all(engine, reqs)
    for i in range(len(PROMPTS)):
        for name in names:
            assert got[f"{name}-{i}"] == want[name][i], (name, i)
    assert not runtime.reconcile(set())  # nothing changed: nothing to publish


def test_an_unloaded_adapter_finishes_its_requests_and_frees_its_slot(tiny, adapters):  # noqa: F811
    folders, want = adapters
    engine, runtime = runtime_engine(tiny[1], {}, spare=1)
    runtime.update(LoraRegistry(version=1, adapters={"all16": folders["all16"]}))
    runtime.reconcile(set())
    tokens: dict[str, list[int]] = {}
    engine.add(lora_req("running", PROMPTS[2], "all16"))
    for _ in range(3):
        step(engine, tokens)
    runtime.update(LoraRegistry(version=2, adapters={"k2": folders["k2"]}))
    in_use = {req.msg.adapter for req in engine.requests()}
    assert runtime.reconcile(in_use)
    # no new requests for all16; it keeps the only slot while its request runs: k2 waits in host memory
    assert runtime.view == AdapterView(serving=("k2",), resident=("all16",), adopts=True)
    while engine.has_work:
        step(engine, tokens)
        runtime.reconcile({req.msg.adapter for req in engine.requests()})
    assert tokens["running"] == want["all16"][2]  # the unload did not touch it
    assert runtime.view == AdapterView(serving=("k2",), resident=(), adopts=True)  # its slot freed as it ended
    # k2 is paged into the slot all16 left: none of all16's weights remain where k2 has none
    assert run_all(engine, [lora_req("k2", PROMPTS[0], "k2")])["k2"] == want["k2"][0]
    assert runtime.refresh() and runtime.view.resident == ("k2",)


def moved(rid: str, prompt: list[int], adapter: str, folder: str | None, resume: list[int]) -> Req:
    """A request that emitted ``resume`` elsewhere and came back to the queue, with its adapter's folder."""
    msg = lora_req(rid, prompt, adapter).msg
    return Req(msg=msg.model_copy(update={"adapter_path": folder, "resume_ids": resume}), inbox_id="0")


def test_a_moved_request_brings_its_unloaded_adapter_for_itself_alone(tiny, adapters):  # noqa: F811
    """Unloaded while the request ran elsewhere, then the request moved here: the worker loads the
    adapter again from the request's folder, as a retiring one (never served to new requests), the
    request ends with PEFT's tokens after those it had sent, and the adapter is forgotten after it.
    One that never started, or carries no folder, is not adopted (the worker answers model_not_found)."""
    folders, want = adapters
    engine, runtime = runtime_engine(tiny[1], {}, spare=1)
    runtime.update(LoraRegistry(version=2, adapters={"k2": folders["k2"]}))  # all16 unloaded meanwhile
    runtime.reconcile(set())
    assert runtime.view.adopts and "all16" not in runtime.view.serving
    assert not runtime.adopt(moved("fresh", PROMPTS[2], "all16", folders["all16"], []).msg)  # never started
    assert not runtime.adopt(moved("old", PROMPTS[2], "all16", None, want["all16"][2][:3]).msg)  # no folder
    req = moved("m", PROMPTS[2], "all16", folders["all16"], want["all16"][2][:3])
    assert runtime.adopt(req.msg) and runtime.adopt(req.msg)  # a second such request shares it
    runtime.reconcile({"all16"})
    assert runtime.view.serving == ("k2",) and "all16" in runtime.adapters.host  # never for new requests
    assert run_all(engine, [req])["m"] == want["all16"][2][3:]
    runtime.reconcile(set())  # its request ended: forgotten
    assert "all16" not in runtime.loaded and "all16" not in runtime.adapters.host and not runtime.pending
    assert run_all(engine, [lora_req("k2", PROMPTS[0], "k2")])["k2"] == want["k2"][0]  # its slot is k2's now

    none = AdapterRuntime(None, None, MAX_RANK, ())  # type: ignore[arg-type]
    assert not none.view.adopts and not none.adopt(req.msg)  # no run-time slots: nothing to load it into


def test_more_adapters_than_slots_are_paged_in_as_requests_need_them(tiny, adapters):  # noqa: F811
    folders, want = adapters
    engine, runtime = runtime_engine(tiny[1], {}, spare=1)
    runtime.update(LoraRegistry(version=1, adapters={n: folders[n] for n in ("qv4", "mlp8", "k2")}))
    runtime.reconcile(set())
    assert runtime.view.serving == ("k2", "mlp8", "qv4") and len(runtime.view.resident) == 1
    # one slot, three adapters in one burst: each waits for the slot in turn, the base goes ahead
    names = ["qv4", "mlp8", None, "k2"]
    got = run_all(engine, [lora_req(f"{name}", PROMPTS[1], name) for name in names])
    for name in names:
        assert got[f"{name}"] == want[name][1], name


def test_queued_requests_page_their_adapters_in_only_when_admission_reaches_them(tiny, adapters):  # noqa: F811
    """Queuing a request begins its grammar, not its adapter's page-in: paged in on arrival, each
    queued adapter evicted an idle one an earlier queued request needed (the 1,000-adapter run paged
    ~1,000 in as its requests were queued). Each adapter not resident is paged in once, as it starts."""
    folders, want = adapters
    engine, runtime = runtime_engine(tiny[1], {}, spare=2)
    runtime.update(LoraRegistry(version=1, adapters=folders))
    runtime.reconcile(set())
    lora = engine.runner.adapters
    assert lora is not None
    resident, loads = dict(lora.slots), lora.loads
    names = [*resident, *(name for name in folders if name not in resident)]  # the resident ones first
    reqs = [lora_req(f"q{i}", PROMPTS[i % len(PROMPTS)], name) for i, name in enumerate(names)]
    for req in reqs:
        engine.add(req)
    assert dict(lora.slots) == resident and lora.loads == loads  # queued: nothing paged in or out
    tokens = run_all(engine, [])
    assert tokens == {f"q{i}": want[name][i % len(PROMPTS)] for i, name in enumerate(names)}
    assert lora.loads - loads == len(names) - len(resident)  # each of the others once


def test_the_least_recently_used_unpinned_adapter_is_evicted(tiny, adapters):  # noqa: F811
    folders, _ = adapters
    engine, runtime = runtime_engine(tiny[1], {"all16": folders["all16"]}, spare=2)
    runtime.update(LoraRegistry(version=1, adapters={n: folders[n] for n in ("qv4", "mlp8", "k2")}))
    runtime.reconcile(set())  # k2 and mlp8 take the two free slots, by name; qv4 waits in host memory
    cache = runtime.adapters
    assert set(cache.slots) == {"all16", "k2", "mlp8"}
    assert cache.make_resident("k2", pinned=())  # used: mlp8 is now the least recent
    assert cache.make_resident("qv4", pinned=()) and set(cache.slots) == {"all16", "k2", "qv4"}
    assert cache.make_resident("mlp8", pinned=["qv4"]) and set(cache.slots) == {"all16", "qv4", "mlp8"}
    assert not cache.make_resident("k2", pinned=["qv4", "mlp8"])  # every run-time slot in use: it waits
    assert "all16" in cache.slots  # --lora_modules' adapters are never evicted


def test_while_every_slot_is_pinned_askers_are_refused_without_a_walk_until_a_pin_goes(tiny, adapters):  # noqa: F811
    """AdapterPins: one refusal (every run-time slot pinned) answers the next askers at once, without
    asking the adapter set; a released pin lets the next asker page its adapter in."""
    folders, _ = adapters
    engine, runtime = runtime_engine(tiny[1], {}, spare=1)
    runtime.update(LoraRegistry(version=1, adapters={n: folders[n] for n in ("qv4", "mlp8", "k2")}))
    runtime.reconcile(set())
    pins, cache = engine.runner.pins, runtime.adapters
    (resident,) = cache.slots
    pins.pin(0, resident)
    waiting = [n for n in ("qv4", "mlp8", "k2") if n != resident]
    assert not pins.page_in(waiting[0])  # asked the set: every slot pinned
    asked = []
    cache.make_resident = lambda *a: asked.append(a) or False  # the next askers must not get this far
    assert not pins.page_in(waiting[1]) and asked == []
    del cache.make_resident
    assert pins.page_in(resident)  # on the device: answered by the set (it touches its order)
    pins.unpin(0)
    assert pins.page_in(waiting[1]) and set(cache.slots) == {waiting[1]}


def test_once_every_slot_was_pinned_adapters_are_paged_in_a_batch_at_a_time(tiny, adapters):  # noqa: F811
    """--lora_page_batch 2 over two run-time slots: after a refusal, one freed slot is not enough (the
    set is not even asked); the second lets the waiting adapter in. And the engine's tokens are still
    PEFT's when requests wait for a batch of slots."""
    folders, want = adapters
    engine, runtime = runtime_engine(tiny[1], {}, spare=2, page_batch=2)
    runtime.update(LoraRegistry(version=1, adapters={n: folders[n] for n in ("qv4", "mlp8", "k2")}))
    runtime.reconcile(set())
    pins, cache = engine.runner.pins, runtime.adapters
    first, second = sorted(cache.slots)
    (third,) = {"qv4", "mlp8", "k2"} - {first, second}
    pins.pin(0, first)
    pins.pin(1, second)
    assert not pins.page_in(third)  # both slots pinned: refused
    pins.unpin(0)
    asked = []
    cache.make_resident = lambda *a: asked.append(a) or False
    assert not pins.page_in(third) and asked == []  # one free slot of the two it waits for
    del cache.make_resident
    assert pins.page_in(second)  # a resident adapter is never held back
    pins.unpin(1)
    assert pins.page_in(third) and third in cache.slots

    engine, runtime = runtime_engine(tiny[1], {}, spare=2, page_batch=2)
    runtime.update(LoraRegistry(version=1, adapters={n: folders[n] for n in ("qv4", "mlp8", "k2")}))
    runtime.reconcile(set())
    names = ["qv4", "mlp8", "k2", None, "qv4", "k2", "mlp8"]
    got = run_all(engine, [lora_req(f"{i}", PROMPTS[i % 2], name) for i, name in enumerate(names)])
    for i, name in enumerate(names):
        assert got[f"{i}"] == want[name][i % 2], (i, name)


def test_an_adapter_that_does_not_fit_is_reported_and_the_worker_serves_on(tiny, adapters, tmp_path):  # noqa: F811
    from safetensors.torch import load_file, save_file

    folders, want = adapters
    bad = str(tmp_path / "bad")
    shutil.copytree(folders["qv4"], bad)
    weights = os.path.join(bad, "adapter_model.safetensors")
    tensors = load_file(weights)
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.zeros(3, tensors[key].shape[1])  # rows that fit no layer
    save_file(tensors, weights)
    engine, runtime = runtime_engine(tiny[1], {}, spare=2)
    runtime.update(LoraRegistry(version=1, adapters={"bad": bad, "mlp8": folders["mlp8"]}))
    assert runtime.reconcile(set())
    assert runtime.view.serving == ("mlp8",)
    ((name, path, error),) = runtime.view.failed
    assert (name, path) == ("bad", bad) and "do not fit" in error
    assert run_all(engine, [lora_req("m", PROMPTS[1], "mlp8")])["m"] == want["mlp8"][1]
    runtime.update(LoraRegistry(version=2, adapters={"mlp8": folders["mlp8"]}))  # unloading forgets the failure
    runtime.reconcile(set())
    assert runtime.view.failed == ()


def test_adapters_that_once_killed_every_worker_are_reported_and_the_worker_serves_on(
    tiny, adapters, tmp_path, monkeypatch
):  # noqa: F811
    """A registry is durable, so an adapter whose load raised out of the runtime killed every worker
    at every restart: a config whose lora_alpha is no number (the file changed after the producer
    checked it), weights of rank 0 (a division by zero), and any error load_adapter does not expect."""
    import json

    from safetensors.torch import load_file, save_file

    folders, want = adapters
    alpha, rank0 = (str(tmp_path / n) for n in ("alpha", "rank0"))
    for folder in (alpha, rank0):
        shutil.copytree(folders["qv4"], folder)
    config_file = os.path.join(alpha, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "lora_alpha": "abc"}, f)
    weights = os.path.join(rank0, "adapter_model.safetensors")
    tensors = load_file(weights)
    module = next(k for k in tensors if "lora_A" in k).split(".lora_A")[0]
    tensors[f"{module}.lora_A.weight"] = torch.zeros(0, tensors[f"{module}.lora_A.weight"].shape[1])
    tensors[f"{module}.lora_B.weight"] = torch.zeros(tensors[f"{module}.lora_B.weight"].shape[0], 0)
    save_file(tensors, weights)
    engine, runtime = runtime_engine(tiny[1], {}, spare=2)
    runtime.update(LoraRegistry(version=1, adapters={"alpha": alpha, "rank0": rank0, "mlp8": folders["mlp8"]}))
    assert runtime.reconcile(set())
    failed = {name: error for name, _, error in runtime.view.failed}
    assert runtime.view.serving == ("mlp8",)
    assert "lora_alpha 'abc' is not a finite number" in failed["alpha"] and "has rank 0" in failed["rank0"]
    assert run_all(engine, [lora_req("m", PROMPTS[1], "mlp8")])["m"] == want["mlp8"][1]

    def broken(*args, **kwargs):
        raise RuntimeError("a check load_adapter lacks")

    monkeypatch.setattr("worker.lora.runtime.load_adapter", broken)
    runtime.update(LoraRegistry(version=2, adapters={"mlp8": folders["mlp8"], "k2": folders["k2"]}))
    assert runtime.reconcile(set())
    assert runtime.view.failed == (("k2", folders["k2"], "RuntimeError: a check load_adapter lacks"),)
    assert runtime.view.serving == ("mlp8",)


def test_a_worker_without_slots_reports_every_adapter(tiny, adapters):  # noqa: F811
    folders, _ = adapters
    runtime = AdapterRuntime(None, None, MAX_RANK, ())  # type: ignore[arg-type]
    runtime.update(LoraRegistry(version=1, adapters={"qv4": folders["qv4"]}))
    assert runtime.reconcile(set())
    assert runtime.view.failed == (("qv4", folders["qv4"], NO_SLOTS),) and runtime.view.serving == ()


def test_a_staged_page_in_writes_the_slots_the_plain_copies_write(tiny, adapters):  # noqa: F811
    """``scatter_copy`` (one DMA of an adapter's host buffer, one launch; Triton's interpreter here)
    against the reference's piece-by-piece copies (tests/worker/test_lora_gpu.py: on a GPU, bf16)."""
    folders, _ = adapters
    page_in_both_ways(tiny[1], folders, ["all16", "k2", "mlp8", "qv4", "all16", "k2"], "cpu", torch.float32)


def page_in_both_ways(base: str, folders: dict[str, str], order: list[str], device: str, dtype: torch.dtype) -> None:
    """Adapters of other ranks and targets paged into the same slot in turn, by copies and staged
    (a smaller rank zeroes what the last one wrote past it; every other one prefetched while the
    slot is taken: ``worker.lora.staging``), the staging buffers NaN-poisoned before each page-in:
    every stack equal after each."""
    sets = []
    for staging in (False, True):
        model, _ = load_model(ModelSource("hf", base), dtype, device)
        lora = AdapterSet([], spare=1, rank=MAX_RANK)
        lora.install(model, staging=staging)
        sets.append((model, lora))
    staged = sets[1][1].staging
    assert sets[0][1].staging is None and staged is not None and len(staged.ahead) == 1
    for i, name in enumerate(order):
        for model, lora in sets:
            adapter = load_adapter(name, folders[name], model, MAX_RANK)
            assert adapter.flat is not None
            for buffer in [] if lora.staging is None else [lora.staging.direct, *lora.staging.ahead]:
                buffer.fill_(float("nan"))
            lora.register(dataclasses.replace(adapter, name=f"{name}-{i}"))  # a new name: paged in
            if i % 2:  # the slot holds the last adapter: this one's copy goes ahead
                lora.prefetch(f"{name}-{i}")
            assert lora.make_resident(f"{name}-{i}", pinned=()) and lora.slots[f"{name}-{i}"] == 1
        for layer, want in sets[0][1].layers.items():
            got = sets[1][1].layers[layer]
            assert torch.equal(got.lora_a, want.lora_a) and torch.equal(got.lora_b, want.lora_b), (name, layer)
    assert any(layer.lora_a[1].any() for layer in sets[1][1].layers.values())
    assert staged.prefetched == staged.used == len(order) // 2 and staged.free == [0]


def test_adapters_copied_ahead_take_the_page_batch_of_buffers_unless_more_are_asked(tiny):  # noqa: F811
    """--lora_prefetch: its staging buffers, each one adapter at the stacks' rank; 0: --lora_page_batch."""
    sizes = {}
    for prefetch, want in ((0, 2), (5, 5)):
        model, _ = load_model(ModelSource("hf", tiny[1]), torch.float32, "cpu")
        lora = AdapterSet([], spare=4, rank=MAX_RANK, page_batch=2, prefetch=prefetch)
        size = lora.install(model, staging=True)
        assert lora.staging is not None and len(lora.staging.ahead) == want
        assert lora.staging.nbytes == (want + 1) * lora.staging.direct.numel() * 4  # counted in the stacks' bytes
        sizes[want] = size
    assert sizes[5] - sizes[2] == 3 * lora.staging.direct.numel() * 4


def test_staged_copies_keep_their_buffers_until_used_or_stale():
    """Staging's bookkeeping: askers beyond the spare buffers cost nothing; a staged copy nobody pages
    in gives its buffer up after STALE times as many page-ins went by; a used or forgotten one frees it."""
    staging = Staging(8, torch.float32, torch.device("cpu"), ahead=2)
    flats = {name: torch.full((8,), float(i)) for i, name in enumerate("abcd")}
    staging.prefetch("a", flats["a"])
    staging.prefetch("b", flats["b"])
    staging.prefetch("c", flats["c"])  # no buffer free and none stale: not staged
    assert list(staging.staged) == ["a", "b"] and staging.prefetched == 2 and not staging.free
    assert torch.equal(staging.ahead[staging.staged["a"][0]], flats["a"])
    staging.write("b", None, flats["b"])  # used: its buffer is free again
    assert staging.used == 1 and list(staging.staged) == ["a"] and len(staging.free) == 1
    staging.prefetch("c", flats["c"])
    for _ in range(STALE * 2 - 2):  # with "b"'s, one page-in short of "a" going stale
        staging.write("other", None, flats["d"])
    staging.prefetch("d", flats["d"])  # "a" not stale yet
    assert "d" not in staging.staged
    staging.write("other", None, flats["d"])
    staging.prefetch("d", flats["d"])  # now "a" (the oldest) gives its buffer to "d"
    assert list(staging.staged) == ["c", "d"] and torch.equal(staging.ahead[staging.staged["d"][0]], flats["d"])
    staging.forget("c")
    assert list(staging.staged) == ["d"] and len(staging.free) == 1
