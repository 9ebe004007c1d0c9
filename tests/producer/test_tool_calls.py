"""``required``'s grammar (one call, or an array of them up to the cap), checked with xgrammar's own
matcher, and reading calls off a model's output (``tool_render.read_calls``, ``chat_message``):
calls kept as written, repeats included; an array cut short by max_tokens keeping the calls it
completed."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from producer.api.tool_render import ToolStream, chat_message, complete_items, read_calls
from producer.api.tools import CALLS_PER_TOOL, CalledFunction, FunctionDef, ToolCallIn, ToolPlan, template_calls

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = FunctionDef(name="get_weather", parameters=CITY)
CLOCK = FunctionDef(name="get_time", parameters={"type": "object"})
PARIS = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
ROME = json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})


def accepts(plan: ToolPlan, text: str) -> bool:
    """Whether ``text`` is a complete answer under the plan's grammar (a character vocabulary)."""
    info = xgr.TokenizerInfo(["<eos>", *(chr(c) for c in range(32, 127))], stop_token_ids=[0])
    constraint = plan.constraint()
    assert constraint is not None
    grammar = xgr.GrammarCompiler(info).compile_json_schema(constraint.spec, any_whitespace=False)
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.accept_token(0) and matcher.is_terminated()


@pytest.mark.parametrize("tools", [(WEATHER,), (WEATHER, CLOCK)])
def test_required_parallel_calls_are_capped_per_tool(tools):
    plan = ToolPlan("required", tools)
    cap = CALLS_PER_TOOL * len(tools)
    assert accepts(plan, "[" + ", ".join([PARIS] * cap) + "]")
    assert not accepts(plan, "[" + ", ".join([PARIS] * (cap + 1)) + "]")
    assert accepts(plan, PARIS)  # one call may stand alone, and then the answer ends
    single = ToolPlan("required", tools, parallel=False)
    assert accepts(single, PARIS) and accepts(single, f"[{PARIS}]")
    assert not accepts(single, f"[{PARIS}, {ROME}]")
    assert not accepts(plan, "[]")


def test_calls_are_kept_as_written_repeats_included():
    """Two dice rolled are two calls: nothing is merged."""
    plan = ToolPlan("required", (WEATHER,))
    calls = read_calls(plan, f"[{PARIS}, {ROME}, {PARIS}]")
    assert calls is not None
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome", "Paris"]
    assert len({c.id for c in calls}) == 3
    (one,) = read_calls(plan, PARIS) or []
    assert one.name == "get_weather" and json.loads(one.arguments) == {"city": "Paris"}


@pytest.mark.parametrize(
    ("text", "cities"),
    [
        (f'[{PARIS}, {ROME}, {{"name": "get_wea', ["Paris", "Rome"]),
        (f"[{PARIS}, ", ["Paris"]),
        (f"<tool_call>\n[{ROME}, {ROME}, ", ["Rome", "Rome"]),
        ('[{"name": "get_weather", "arguments": {"ci', None),  # no call completed
        (PARIS[:-3], None),  # a lone object cut short
        (f'[{PARIS}, {{"name": "get_weather"}}, {{"name": "no_such_tool"}}, {{"na', None),  # not all calls
    ],
)
def test_an_array_cut_short_keeps_its_complete_calls(text, cities):
    calls = read_calls(ToolPlan("required", (WEATHER,)), text, is_cut=True)
    assert (None if calls is None else [json.loads(c.arguments)["city"] for c in calls]) == cities


def test_complete_items_reads_up_to_the_first_incomplete_one():
    assert complete_items('[1, {"a": [2, 3]}, "x", tr') == [1, {"a": [2, 3]}, "x"]
    assert complete_items(" [] trailing") == []
    assert complete_items('{"a": 1}') is None


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_a_cut_answer_is_its_calls_with_finish_reason_length(mode):
    plan = ToolPlan(mode, (WEATHER,))
    text = f"[{PARIS}, {ROME}, {{"
    message, reason = chat_message(plan, text, "length")
    assert reason == "length" and message.content is None
    cities = [json.dumps({"city": "Paris"}), json.dumps({"city": "Rome"})]
    assert [c["function"]["arguments"] for c in message.tool_calls] == cities
    stream = ToolStream(plan, 1)
    assert stream.delta(0, text[:10], None) == (None, None)  # held while it may be a call
    delta, reason = stream.delta(0, text[10:], "length")
    assert reason == "length" and [c["index"] for c in delta["tool_calls"]] == [0, 1]
    # No call completed: required's raw JSON is no content a client could parse (empty, as vLLM
    # answers); auto's text is content as written.
    cut = '[{"name": "get_wea'
    message, reason = chat_message(plan, cut, "length")
    assert (message.content, reason) == ("" if mode == "required" else cut, "length")
    stream = ToolStream(plan, 1)
    assert stream.delta(0, cut, "length") == (({} if mode == "required" else {"content": cut}), "length")


@pytest.mark.parametrize("text", ['{"city": "', '{"city": "Paris"'])
def test_a_named_call_a_stop_string_cut_short_is_no_finished_call(text):
    """The worker's "stop" is also a stop string's (``"stop": ["Paris"]`` or ``["}"]``): arguments
    cut short by one are not a call to run, so the reason stays "stop"; before, it was "tool_calls"
    with unparsable arguments (red team 3). A whole call stays "tool_calls"."""
    plan = ToolPlan("named", (WEATHER,), named="get_weather")
    message, reason = chat_message(plan, text, "stop")
    assert reason == "stop" and message.tool_calls[0]["function"]["arguments"] == text
    stream = ToolStream(plan, 1)
    stream.delta(0, text[:3], None)
    assert stream.delta(0, text[3:], "stop")[1] == "stop"
    whole = '{"city": "Paris"}'
    assert chat_message(plan, whole, "stop")[1] == "tool_calls"
    stream = ToolStream(plan, 1)
    stream.delta(0, whole[:5], None)
    assert stream.delta(0, whole[5:], "stop")[1] == "tool_calls"


@pytest.mark.parametrize("mode", ["required", "auto"])
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_text_nested_past_the_parser_is_no_call_and_no_500(mode, reason):
    """A schema that lets the model nest arrays (a ``$ref`` to itself) over 1,200 tokens: Python's
    parser gives up with RecursionError, which was a 500 after the whole generation (red team 5)."""
    deep = "[" * 5000
    assert complete_items(deep) == []
    message, finish = chat_message(ToolPlan(mode, (WEATHER,)), deep, reason)
    assert finish == reason and not message.tool_calls
    named = ToolPlan("named", (WEATHER,), named="get_weather")
    message, finish = chat_message(named, '{"city": ' + deep, "stop")
    assert finish == "stop"  # arguments that do not parse: no finished call


def test_a_conversations_call_nested_past_the_parser_goes_to_the_template_as_sent():
    """An earlier turn's call whose arguments nest 100,000 deep: a 500 at the door before (red team 5)."""
    deep = "[" * 100_000 + "]" * 100_000
    (call,) = template_calls([ToolCallIn(id="c1", function=CalledFunction(name="f", arguments=deep))])
    assert call["function"]["arguments"] == deep
    (call,) = template_calls([ToolCallIn(id="c2", function=CalledFunction(name="f", arguments='{"a": 1}'))])
    assert call["function"]["arguments"] == {"a": 1}
