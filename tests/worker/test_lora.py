"""LoRA adapters on a tiny random Llama (issue 32): adapters made by ``peft`` in the test, lightq's
greedy tokens in one mixed batch (every request its own adapter, one with none) equal PEFT's for
each; the prefix cache never shares K/V across adapters; adapters that do not fit the model stop
the start with one line naming the problem; the adapter travels with a paused request."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from shared.admission import AdmissionRule
from shared.codec import decode, encode
from shared.config import AdmissionSettings
from shared.model_files import ModelSource
from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.lora_helpers import AdapterRecipe, greedy, make_adapter
from tests.worker.test_engine import run_to_end, tiny  # noqa: F401 (fixture)
from worker.engine.engine import Engine, EngineLimits
from worker.engine.preempt import handed_back
from worker.engine.radix_cache import RadixCache
from worker.engine.request import Phase, Req
from worker.engine.token_pool import TokenPool
from worker.lora.adapter import AdapterError
from worker.lora.adapter_set import check_adapters, load_adapters
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECIPES = [
    AdapterRecipe("qv4", 4, ("q_proj", "v_proj"), seed=1),
    AdapterRecipe("mlp8", 8, ("o_proj", "gate_proj", "down_proj"), seed=2),
    AdapterRecipe("all16", 16, ALL, seed=3, alpha=16.0, rslora=True),
    AdapterRecipe("k2", 2, ("k_proj", "up_proj"), seed=4),
]
PROMPTS = [[5, 6, 7, 8, 9], [11, 3], list(range(20, 40))]
NEW = 10
POOL = 1200


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):  # noqa: F811
    """{name: folder} and PEFT's greedy tokens {name or None: per prompt}."""
    ref, _ = tiny
    root = tmp_path_factory.mktemp("adapters")
    folders, want = {}, {}
    for recipe in RECIPES:
        folders[recipe.name] = str(root / recipe.name)
        want[recipe.name] = make_adapter(ref, recipe, folders[recipe.name], PROMPTS, NEW)
    want[None] = [greedy(ref, p, NEW) for p in PROMPTS]
    assert all(want[r.name] != want[None] for r in RECIPES)  # each adapter changes the output
    return folders, want


def make_engine(folder: str, specs: list[str], cache: bool = False) -> Engine:
    model, config = load_model(ModelSource("hf", folder), torch.float32, "cpu")
    load_adapters(specs, model, max_rank=64)
    kv = attach_kv_cache(model, POOL, "cpu")
    pool = TokenPool(POOL)
    table = ReqTable(16, 128, kv.hold_slot, "cpu")
    runner = ModelRunner(
        model, pool, table, config.vocab_size, torch.device("cpu"), prefix_cache=RadixCache(pool) if cache else None
    )
    rule = AdmissionRule(AdmissionSettings(admission="conservative"))
    return Engine(runner, EngineLimits(POOL, 64, 16), eos_ids=set(), rule=rule)


def lora_req(rid: str, prompt: list[int], adapter: str | None, max_new: int = NEW) -> Req:
    params = SamplingParams(max_new_tokens=max_new)
    return Req(
        msg=GenerateRequest(id=rid, prompt_ids=prompt, params=params, created_ms=0, adapter=adapter), inbox_id="0"
    )


def specs(folders: dict[str, str]) -> list[str]:
    return [f"{name}={path}" for name, path in folders.items()]


def test_a_mixed_batch_matches_peft_for_every_adapter(tiny, adapters):  # noqa: F811
    folders, want = adapters
    engine = make_engine(tiny[1], specs(folders))
    names: list[str | None] = [*folders, None]
    # Every request of a step its own adapter (one none): prefills of mixed segments, then decodes.
    arrivals = {0: [lora_req(f"{n}/{i}", p, n) for i, p in enumerate(PROMPTS) for n in names]}
    got = run_to_end(engine, arrivals)
    for name in names:
        assert [got[f"{name}/{i}"] for i in range(len(PROMPTS))] == want[name], name


def test_the_prefix_cache_is_never_shared_across_adapters(tiny, adapters):  # noqa: F811
    folders, want = adapters
    engine = make_engine(tiny[1], specs(folders), cache=True)
    prompt = PROMPTS[2]
    # The base request fills the tree first; the adapters' requests of the same prompt come after it
    # ended (a hit would be possible), then the base again, which must still hit its own K/V.
    arrivals = {0: [lora_req("base", prompt, None)], 30: [lora_req(n, prompt, n) for n in folders]}
    arrivals[60] = [lora_req("base-again", prompt, None)]
    got = run_to_end(engine, arrivals)
    assert got["base"] == got["base-again"] == want[None][2]
    for name in folders:
        assert got[name] == want[name][2], name
    # only the base's second run hit: all of its prompt but the last token
    assert engine.runner.slots.num_hit == len(prompt) - 1


def write_json(path: str, update: dict) -> None:
    with open(path) as f:
        config = json.load(f)
    config.update(update)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    "change, message",
    [
        ("rank", "rank 16 of model.layers.0.mlp.down_proj is over --max_lora_rank 8"),
        ("dora", "DoRA is not supported"),
        ("missing", "cannot read adapter_config.json"),
        ("shape", "do not fit a [32, 64] layer"),
        ("target", "targets model.layers.0.self_attn.rotary, which is no linear layer"),
    ],
)
def test_an_adapter_that_does_not_fit_is_one_line_naming_it(tiny, adapters, tmp_path, change, message):  # noqa: F811
    from safetensors.torch import load_file, save_file

    folders, _ = adapters
    folder = str(tmp_path / "bad")
    shutil.copytree(folders["all16"], folder)
    weights = os.path.join(folder, "adapter_model.safetensors")
    if change == "dora":
        write_json(os.path.join(folder, "adapter_config.json"), {"use_dora": True})
    elif change == "missing":
        os.remove(os.path.join(folder, "adapter_config.json"))
    elif change in ("shape", "target"):
        tensors = load_file(weights)
        k_b = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
        if change == "shape":
            tensors[k_b] = torch.zeros(16, 16)  # k_proj's 32 rows (2 KV heads of 16) given 16
        else:
            for ab in "AB":
                key = f"base_model.model.model.layers.0.self_attn.k_proj.lora_{ab}.weight"
                tensors[key.replace("k_proj", "rotary")] = tensors.pop(key)
        save_file(tensors, weights)
    max_rank = 8 if change == "rank" else 64
    with pytest.raises(AdapterError) as caught:
        check_adapters([f"bad={folder}"], tiny[1], tp=1, max_rank=max_rank)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"LoRA adapter 'bad' ({folder}): ")
    assert message in text


def test_counting_and_tensor_parallel_are_refused(adapters, tiny):  # noqa: F811
    folders, _ = adapters
    with pytest.raises(AdapterError, match="counting stand-in"):
        check_adapters(specs(folders), "counting", tp=1, max_rank=64)
    with pytest.raises(AdapterError, match="--tp above 1"):
        check_adapters(specs(folders), tiny[1], tp=2, max_rank=64)


def test_serve_checks_adapters_before_any_child_starts(tiny, adapters):  # noqa: F811
    from lightq.checks import check_lora

    folders, _ = adapters
    check_lora(specs(folders), tiny[1], 1, 64)  # they fit
    with pytest.raises(SystemExit, match=r"^lightq: LoRA adapter 'all16' \(.*\): rank 16 .* over --max_lora_rank 8$"):
        check_lora([f"all16={folders['all16']}"], tiny[1], 1, 8)


def test_an_unknown_adapter_is_refused_at_start(tiny, adapters):  # noqa: F811
    folders, _ = adapters
    engine = make_engine(tiny[1], specs(folders))
    with pytest.raises(ValueError, match="'other' is not served by this worker"):
        engine.runner.start(lora_req("x", [1, 2], "other"))


def test_the_adapter_travels_with_a_paused_request():
    req = lora_req("p", [1, 2, 3], "qv4")
    req.phase, req.output_ids = Phase.RUNNING, [7, 8]
    msg, counted = handed_back([req])
    assert counted and msg.resume_ids == [7, 8]
    assert decode(GenerateRequest, encode(msg)).adapter == "qv4"  # as the queue carries it


FAMILY_TARGETS = {
    "bloom": ("query_key_value", "dense", "dense_4h_to_h"),  # BLOOM's fused qkv is one checkpoint tensor
    "qwen2-tied": ("q_proj", "v_proj", "up_proj", "down_proj"),  # q/k/v biases in the base, none in the adapter
    "mistral": ("k_proj", "o_proj", "gate_proj"),
}


@pytest.mark.parametrize("family", FAMILY_TARGETS)
def test_other_families_match_peft(family, tmp_path):
    from tests.worker.test_models_families import _reference

    ref = _reference(family)
    ref.save_pretrained(tmp_path / "base")
    recipe = AdapterRecipe("x", 8, FAMILY_TARGETS[family], seed=5, alpha=64.0)
    want = make_adapter(ref, recipe, str(tmp_path / "x"), PROMPTS, NEW)
    base = [greedy(ref, p, NEW) for p in PROMPTS]
    assert want != base
    engine = make_engine(str(tmp_path / "base"), [f"x={tmp_path / 'x'}"])
    arrivals = {0: [lora_req(f"{n}/{i}", p, n) for i, p in enumerate(PROMPTS) for n in ("x", None)]}
    got = run_to_end(engine, arrivals)
    assert [got[f"x/{i}"] for i in range(len(PROMPTS))] == want
    assert [got[f"None/{i}"] for i in range(len(PROMPTS))] == base
