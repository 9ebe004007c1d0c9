"""Constrained decoding (worker.runner.grammar) with SmolLM2's real tokenizer: the sampler never
draws a token the grammar forbids, a tiny random-weight Llama sampled at temperature 1 answers
JSON that validates against its schema, and a requeued request (or group sample) rebuilds its
matcher from its emitted tokens and continues exactly as an uninterrupted run."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
import xgrammar as xgr

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.model_files import ModelSource
from shared.schemas import Constraint, GenerateRequest, RequestStatus, SamplingParams
from tests.worker.token_rows import flat
from worker.engine.engine import Engine, EngineLimits
from worker.engine.events import Ended, Token
from worker.engine.request import GrammarStep, Req
from worker.engine.token_pool import TokenPool
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.grammar import Grammars
from worker.runner.grammar_cache import GrammarCache
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable
from worker.runner.sampler import SamplingBatch, sample

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152
POOL = 2048
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
JSON_SCHEMA = Constraint(kind="json_schema", spec=json.dumps(SCHEMA))
# Few tokens, for the replays: seeded noise over 49k tokens costs ~0.2 s a row a step on a small CPU.
SHORT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"]}
SHORT_SCHEMA = Constraint(kind="json_schema", spec=json.dumps(SHORT))
SAMPLED = dict(do_sample=True, temperature=1.0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer  # loaded once a session (tests/conftest.py)


@pytest.fixture(scope="module")
def cache(tokenizer):
    cache = GrammarCache.for_tokenizer(tokenizer, VOCAB, {EOS})
    yield cache
    cache.close()  # its compile processes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama with SmolLM2's vocabulary (the grammar needs real token texts)."""
    folder = tmp_path_factory.mktemp("tiny_vocab")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def make_engine(folder: str, cache: GrammarCache) -> Engine:
    model, config = load_model(ModelSource("hf", folder), torch.float32, "cpu")
    kv = attach_kv_cache(model, POOL, "cpu")
    table = ReqTable(8, 160, kv.hold_slot, "cpu")
    runner = ModelRunner(
        model, TokenPool(POOL), table, config.vocab_size, torch.device("cpu"), {EOS}, grammars=Grammars(cache)
    )
    rule = AdmissionRule(AdmissionSettings(admission="conservative"))
    return Engine(runner, EngineLimits(POOL, 256, 8), {EOS}, rule)


def run(engine: Engine, *reqs: Req) -> tuple[dict[tuple[str, int], list[int]], dict[tuple[str, int], str]]:
    """Every request to its end: tokens and finish reason per (id, choice)."""
    for r in reqs:
        engine.add(r)
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    while engine.has_work:
        for event in flat(engine.step()):
            if isinstance(event, Token):
                tokens.setdefault((event.request_id, event.choice), []).append(event.token_id)
                if event.finish_reason:
                    reasons[(event.request_id, event.choice)] = event.finish_reason
    return tokens, reasons


def msg(rid: str, constraint: Constraint | None, max_new: int = 80, **params) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=max_new, constraint=constraint, **params)
    return GenerateRequest(id=rid, prompt_ids=[1, 504, 3070, 28], params=sampling, created_ms=0)


def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == set(SCHEMA["required"]), text
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, text
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, text
    assert type(value["ok"]) is bool and value["tag"] in ("a", "b"), text


def test_the_sampler_never_draws_a_forbidden_token(cache, tokenizer):
    """Random logits, two constrained rows beside an unconstrained one: every drawn token is accepted
    by its matcher, and the unconstrained row draws what it would alone (seeded noise)."""
    torch.manual_seed(1)
    grammars = Grammars(cache)
    regex = Constraint(kind="regex", spec=r"[0-9]{3}-[a-z]{2,4}\.")
    free = Req(msg=msg("free", None, seed=1, **SAMPLED), inbox_id="0-1")
    constrained = [Req(msg=msg(f"r{i}", regex, **SAMPLED), inbox_id="0-1") for i in (1, 2)]
    reqs = [free, *constrained]
    for r in reqs:
        grammars.start(r)
    for step in range(12):
        params = [r.msg.params for r in reqs]
        logits = torch.randn(len(reqs), VOCAB) * 4
        mask = grammars.mask(reqs)
        assert mask is not None and mask.rows == list(range(1, len(reqs)))
        lens = [step] * len(reqs)
        ids = sample(
            logits, SamplingBatch.build(params, VOCAB, torch.device("cpu"), output_lens=lens, grammar=mask)
        ).ids
        alone = sample(logits[:1], SamplingBatch.build(params[:1], VOCAB, torch.device("cpu"), output_lens=[step])).ids
        assert ids[0] == alone[0]
        steps = grammars.accept(reqs, ids)
        assert GrammarStep.STUCK not in steps  # every drawn token was allowed
        for r, token_id, is_ended in zip(reqs[1:], ids[1:], [s is GrammarStep.ENDED for s in steps[1:]]):
            r.output_ids.append(token_id)
            assert is_ended == grammars.matchers[r].is_terminated()
            if is_ended:
                assert token_id == EOS
                grammars.finish(r)
        reqs = [reqs[0], *(r for r in reqs[1:] if r in grammars.matchers)]
        if len(reqs) == 1:
            break
    assert len(reqs) == 1 and list(grammars.matchers) == [], "both constrained rows end within 12 tokens"
    texts = [tokenizer.decode(r.output_ids[:-1]) for r in constrained]
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}\.", t) for t in texts), texts


def test_every_sampled_answer_follows_its_json_schema(tiny, cache, tokenizer):
    engine = make_engine(tiny, cache)
    torch.manual_seed(3)  # unseeded rows: the cheap noise
    reqs = [Req(msg=msg(f"j{i}", JSON_SCHEMA, **SAMPLED), inbox_id=f"{i}-0") for i in range(4)]
    regex = Req(msg=msg("re", Constraint(kind="regex", spec=r"(yes|no), [0-9]{2}"), **SAMPLED), inbox_id="9-0")
    free = Req(msg=msg("free", None, max_new=10, **SAMPLED), inbox_id="10-0")
    tokens, reasons = run(engine, *reqs, regex, free)
    for r in reqs:
        out = tokens[(r.id, 0)]
        assert reasons[(r.id, 0)] == "stop" and out[-1] == EOS
        check_person(tokenizer.decode(out[:-1]))
    assert re.fullmatch(r"(yes|no), [0-9]{2}", tokenizer.decode(tokens[("re", 0)][:-1]))
    assert len(tokens[("free", 0)]) == 10  # unconstrained beside them
    assert engine.runner.grammars.matchers == {}  # every matcher went with its row
    assert engine.runner.pool.num_free == POOL


def test_a_requeued_request_replays_its_matcher_and_continues_exactly(tiny, cache, tokenizer):
    """Seeded sampling keys its noise by output index: a run resumed after k emitted tokens gives the
    uninterrupted run's tokens only if its matcher was rebuilt at the same state."""
    engine = make_engine(tiny, cache)
    whole, _ = run(engine, Req(msg=msg("s", SHORT_SCHEMA, seed=7, **SAMPLED), inbox_id="1-0"))
    full = whole[("s", 0)]
    assert type(json.loads(tokenizer.decode(full[:-1]))["n"]) is int
    for k in (2, len(full) - 2):
        again = msg("s", SHORT_SCHEMA, seed=7, **SAMPLED).model_copy(update={"resume_ids": full[:k], "attempt": 1})
        resumed, reasons = run(engine, Req(msg=again, inbox_id="2-0"))
        assert full[:k] + resumed[("s", 0)] == full, k
        assert reasons[("s", 0)] == "stop"


def test_a_requeued_group_replays_each_samples_matcher(tiny, cache, tokenizer):
    """Greedy (cheap): each open sample continues after its own emitted tokens, through its own matcher."""
    engine = make_engine(tiny, cache)
    group = msg("g", JSON_SCHEMA).model_copy(update={"n": 3})
    whole, _ = run(engine, Req(msg=group, inbox_id="1-0"))
    out = whole[("g", 0)]
    check_person(tokenizer.decode(out[:-1]))
    assert [whole[("g", c)] for c in range(3)] == [out] * 3
    emitted = [out[:3], [], out[: len(out) // 2]]
    again = group.model_copy(update={"group_resume": emitted, "attempt": 1})
    resumed, _ = run(engine, Req(msg=again, inbox_id="2-0"))
    assert [emitted[c] + resumed[("g", c)] for c in range(3)] == [out] * 3


def test_the_cache_is_bounded_and_reports_bad_constraints(tokenizer):
    cache = GrammarCache.for_tokenizer(tokenizer, VOCAB, {EOS}, max_entries=2)
    try:
        for n in range(4):
            assert cache.error(Constraint(kind="regex", spec=f"a{{{n + 1}}}")) is None
        assert len(cache) == 2
        assert "regex" in cache.error(Constraint(kind="regex", spec="(abc"))
        assert "json_schema" in cache.error(Constraint(kind="json_schema", spec='{"type": "foo"}'))
    finally:
        cache.close()


def test_the_producers_parse_is_compiled_and_the_spec_never_read(cache):
    """A constraint carries the producer's parse (``grammar``, xgrammar's EBNF text): the worker
    compiles that and never converts the schema again (here ``spec`` is not even JSON)."""
    parse = str(xgr.Grammar.from_json_schema(json.dumps(SHORT), any_whitespace=False))
    matcher = xgr.GrammarMatcher(cache.get(Constraint(kind="json_schema", spec="{not json", grammar=parse)))
    assert matcher.accept_string('{"n": 42}') and not matcher.accept_string(",")


SYNTHETIC_STOP = "</s>"


def synthetic_cache(width: int) -> tuple[GrammarCache, list[str]]:
    """A tokenizer-free vocabulary (printable characters, some multi-character pieces, a stop token),
    narrower than the logits (``width``), as a model's padded vocabulary is."""
    pieces = [chr(c) for c in range(32, 127)] + ['{"', '":', '", "', "true", "false", "12", "ab", "yes", "no", "]}"]
    vocab = [*pieces, SYNTHETIC_STOP]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=width, stop_token_ids=[len(vocab) - 1])
    return GrammarCache(info, width), vocab


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_the_batched_mask_on_the_logits_device(device):
    """Random logits on ``device`` (a CUDA device applies xgrammar's GPU kernel): constrained rows
    only ever draw allowed tokens (their matchers accept every one) and end at their grammar's end."""
    width = 160
    cache, pieces = synthetic_cache(width)
    grammars = Grammars(cache)
    small = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 12]}},
        "required": ["ok", "n"],
    }
    kinds = [
        Constraint(kind="json_schema", spec=json.dumps(small)),
        Constraint(kind="regex", spec="(yes|no)-[a-c]{3}"),
        None,
    ]
    reqs = [Req(msg=msg(f"r{i}", kinds[i % 3], seed=i if i % 2 else None, **SAMPLED), inbox_id="0-1") for i in range(9)]
    for r in reqs:
        grammars.start(r)
    torch.manual_seed(5)
    live = list(reqs)
    for step in range(60):
        logits = torch.randn(len(live), width, device=device) * 3
        batch = SamplingBatch.build(
            [r.msg.params for r in live],
            width,
            torch.device(device),
            output_lens=[step] * len(live),
            grammar=grammars.mask(live),
        )
        ids = sample(logits, batch).ids
        for r, token_id, step in zip(live, ids, grammars.accept(live, ids)):
            assert step is not GrammarStep.STUCK
            ended = step is GrammarStep.ENDED
            r.output_ids.append(token_id)
            assert not ended or r.msg.params.constraint is not None
            if ended:
                assert token_id == len(pieces) - 1 and grammars.matchers[r].is_terminated()
                grammars.finish(r)
        live = [r for r in live if r in grammars.matchers]
        if not live:
            break
    assert not live, "every constrained row ends well within 60 tokens"
    for r in reqs:
        if r.msg.params.constraint is None:
            continue
        text = "".join(pieces[t] for t in r.output_ids[:-1])
        if r.msg.params.constraint.kind == "regex":
            assert re.fullmatch("(yes|no)-[a-c]{3}", text), text
        else:
            value = json.loads(text)
            assert type(value["ok"]) is bool and value["n"] in (1, 12), text
    cache.close()


@pytest.mark.parametrize("parsed", [False, True], ids=["spec", "producer's parse"])
def test_a_length_bounded_string_admits_no_raw_control_character(cache, tokenizer, parsed):
    """Inside a string with maxLength, no token the grammar allows decodes to a raw U+0000-U+001F
    (JSON forbids them unescaped; xgrammar's own rule admitted them: #800, and a sampled answer
    failed json.loads), and plain text tokens are still allowed; from the spec or the producer's parse."""
    spec = json.dumps({"type": "string", "maxLength": 40})
    grammar = str(xgr.Grammar.from_json_schema(spec, any_whitespace=False)) if parsed else ""
    schema = Constraint(kind="json_schema", spec=spec, grammar=grammar)
    matcher = xgr.GrammarMatcher(cache.get(schema))
    assert matcher.accept_string('"')
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(allowed, bitmask)  # forbidden tokens become -inf
    ids = (allowed[0] == 0).nonzero().flatten().tolist()
    texts = {i: tokenizer.decode([i]) for i in ids}
    assert len(ids) > 10_000 and "hello" in {t.strip() for t in texts.values()}
    raw = {i: t for i, t in texts.items() if any(ord(c) < 0x20 for c in t)}
    assert not raw, list(raw.items())[:5]


def test_a_grammar_that_allows_no_token_fails_its_request_and_publishes_nothing(tiny, cache):
    """A constraint xgrammar compiles but no text meets (a red-team probe's ``[^\\s\\S]``, or a schema
    whose parts contradict): its mask allows no token. The request ends with ``invalid_constraint``
    (the producer's 400) at once, after the tokens it had, and no token outside its grammar is
    published (it used to emit token 0 with a null logprob and finish ``stop``); the rows beside it
    go on."""
    engine = make_engine(tiny, cache)
    never = Req(msg=msg("never", Constraint(kind="regex", spec=r"[^\s\S]")), inbox_id="1-0")
    late = Req(msg=msg("late", Constraint(kind="regex", spec=r"ab[^\s\S]")), inbox_id="2-0")
    free = Req(msg=msg("free", None, max_new=6), inbox_id="3-0")
    for r in (never, late, free):
        engine.add(r)
    tokens: dict[str, list[int]] = {}
    ended: dict[str, Ended] = {}
    while engine.has_work:
        events = engine.step()
        ended.update((e.request_id, e) for e in events if isinstance(e, Ended))
        for event in flat(events):
            if isinstance(event, Token):
                tokens.setdefault(event.request_id, []).append(event.token_id)
    assert set(ended) == {"never", "late"}
    for rid, emitted in (("never", 0), ("late", len(tokens.get("late", [])))):
        end = ended[rid]
        assert end.status is RequestStatus.FAILED and end.reason == "error" and end.num_output == emitted
        assert Constraint.error_code(end.error) == Constraint.INVALID, end.error
    assert "never" not in tokens and tokens["late"], tokens  # "ab" came out, in the grammar's tokens
    assert len(tokens["free"]) == 6
    assert engine.runner.grammars.matchers == {} and engine.runner.pool.num_free == POOL
