"""mlxchat.demo's data: deterministic for a seed, held-out combinations never in training, answers right."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace

import pytest

from mlxchat.demo.build import Recipe, parse_mixture, stage_arguments
from mlxchat.demo.data import (
    ADD_QUESTIONS,
    CAPITAL_QUESTIONS,
    CONVERSION_QUESTIONS,
    SUB_QUESTIONS,
    DemoData,
    arithmetic_exchange,
    conversion_exchange,
    invented_name,
)
from mlxchat.demo.evaluate import CHECKS, Reply
from mlxchat.demo.world import CAPITALS, CONVERSIONS, clock_report, get_time, get_weather, weather_report

SEED = 0


@pytest.fixture(scope="module")
def data() -> DemoData:
    return DemoData(SEED)


@pytest.fixture(scope="module")
def training(data):
    return data.training(8000)


def user_texts(conversations) -> set[str]:
    return {m["content"] for c in conversations for m in c.messages if m["role"] == "user"}


def called_cities(conversations) -> set[str]:
    return {call["function"]["arguments"]["city"] for c in conversations for m in c.messages
            for call in m.get("tool_calls") or []}


def test_deterministic_for_a_seed():
    assert DemoData(7).training(300) == DemoData(7).training(300)
    assert DemoData(7).evaluation() == DemoData(7).evaluation()
    assert DemoData(7).training(300) != DemoData(8).training(300)


def test_mixture_covers_every_task(training):
    tasks = {c.task for c in training}
    assert tasks == {"capital", "arithmetic", "conversion", "tool_call", "two_calls", "greeting", "thanks",
                     "identity", "unknown_country", "out_of_world", "no_tool", "repeat"}
    assert all(c.tools for c in training if c.task in ("tool_call", "two_calls"))
    assert not any(c.tools for c in training if c.task == "no_tool")


def test_a_stage_can_reweigh_the_tasks():
    tasks = [c.task for c in DemoData(SEED, mixture=parse_mixture("capital=100, arithmetic=0")).training(400)]
    assert "arithmetic" not in tasks and tasks.count("capital") > len(tasks) / 2
    with pytest.raises(ValueError, match="unknown demo tasks"):
        DemoData(SEED, mixture={"poetry": 1})
    with pytest.raises(ValueError, match="'capital' is not task=weight"):
        parse_mixture("capital")


def test_stage_commands_chain_the_stages_through_named_folders():
    first = asdict(Recipe())
    second = asdict(replace(Recipe(), steps=10, mixture="capital=30", init="/tmp/somewhere"))
    assert stage_arguments(first, 0, 2) == "--out stage1"
    assert stage_arguments(second, 1, 2) == "--steps 10 --mixture capital=30 --init stage1"
    assert stage_arguments(first, 0, 1) == ""


def test_invented_names_have_the_shapes_of_real_ones():
    rng = random.Random(0)
    names = [invented_name(rng) for _ in range(2000)]
    assert not {n.lower() for n in names} & {n.lower() for n in (*CAPITALS, *CAPITALS.values())}
    words = [n.split() for n in names]
    assert all(w[0][0].isupper() for w in words)
    assert {len(w) for w in words} == {1, 2, 3}
    assert any(w[1].islower() for w in words if len(w) == 3)  # "Rio de Janeiro"
    assert len({n[:3] for n in names}) > 300  # not a few syllables to complete from the first letters


def test_heldout_capital_phrasings_never_trained(data, training):
    asked = user_texts(training)
    held = {CAPITAL_QUESTIONS[p].format(c=c) for c, p in data.split.capital_phrasing.items()}
    assert not held & asked
    # ...while every country is trained with its other phrasings.
    assert all(any(f" {country}?" in q or f" {country}." in q for q in asked) for country in CAPITALS)


def test_heldout_arithmetic_and_conversions_never_trained(data, training):
    asked = user_texts(training)
    for op, a, b in data.split.arithmetic:
        phrasings = ADD_QUESTIONS if op == "+" else SUB_QUESTIONS
        assert not {q.format(a=a, b=b) for q in phrasings} & asked
    for index, n in data.split.conversions:
        unit, plural, target, _ = CONVERSIONS[index]
        name = unit if n == 1 else plural
        assert not {q.format(n=n, unit=name, to=target) for q in CONVERSION_QUESTIONS} & asked


def test_heldout_places_never_used_with_tools_or_as_countries(data, training):
    held = set(data.split.tool_cities) | set(data.split.heldout_places)
    assert not called_cities(training) & held
    assert not any(place in text for text in user_texts(training) for place in data.split.heldout_places)
    assert not set(data.split.out_of_world) & user_texts(training)


def test_evaluation_asks_the_heldout_items(data):
    items = data.evaluation()
    assert {k: len(v) for k, v in items.items()} == {
        "capitals": len(CAPITALS), "arithmetic": 300, "conversions": 60, "tool_calls": 100, "two_calls": 100,
        "tool_answers": 100, "dont_know": 20}
    held = set(data.split.tool_cities) | set(data.split.heldout_places)
    for item in items["tool_calls"] + items["two_calls"]:
        assert item.tools and item.messages[-1]["role"] == "user"
        assert {city for _, city in item.expected["calls"]} <= held
    assert all(len(i.expected["calls"]) == 2 for i in items["two_calls"])
    for item in items["tool_answers"]:
        assert item.messages[-1]["role"] == "tool"


ARITHMETIC_CASES = [
    ("+", 47, 38, 85,
     "47 + 38\nunits: 7 + 8 = 15, write 5, carry 1.\ntens: 4 + 3 + 1 = 8, write 8.\nresult: 85."),
    ("+", 99, 99, 198,
     "99 + 99\nunits: 9 + 9 = 18, write 8, carry 1.\ntens: 9 + 9 + 1 = 19, write 19.\nresult: 198."),
    ("-", 50, 7, 43,
     "50 - 7\n50 is at least 7, so the result is not negative.\nunits: 0 - 7 needs a borrow: "
     "10 - 7 = 3, write 3, borrow 1.\ntens: 5 - 0 - 1 = 4, write 4.\nresult: 43."),
    ("-", 21, 97, -76,
     "21 - 97\n21 is less than 97, so I compute 97 - 21 and make it negative.\nunits: 7 - 1 = 6, "
     "write 6, borrow 0.\ntens: 9 - 2 - 0 = 7, write 7.\nresult: -76."),
]


@pytest.mark.parametrize(("op", "a", "b", "result", "reasoning"), ARITHMETIC_CASES)
def test_arithmetic_reasoning_goes_digit_by_digit(op, a, b, result, reasoning):
    exchange = arithmetic_exchange(op, a, b, 0)
    answer = exchange.messages[-1]
    assert answer["reasoning_content"] == reasoning
    assert answer["content"] == f"{a} {op} {b} = {result}."
    assert exchange.expected == {"answer": result}


def test_every_arithmetic_trace_is_right():
    for op in "+-":
        for a in range(0, 100, 3):
            for b in range(0, 100, 7):
                reasoning = arithmetic_exchange(op, a, b, 0).messages[-1]["reasoning_content"]
                assert reasoning.endswith(f"result: {a + b if op == '+' else a - b}.")


def test_conversion_answer():
    exchange = conversion_exchange(0, 25, 0)
    assert exchange.messages[0]["content"] == "How many meters are in 25 kilometers?"
    assert exchange.messages[-1]["content"] == "25 kilometers is 25000 meters."


def test_repeat_answers_are_the_phrase_verbatim(training):
    repeats = [c for c in training if c.task == "repeat"]
    assert repeats
    for c in repeats:
        question, answer = c.messages[-2]["content"], c.messages[-1]["content"]
        assert answer and answer in question and not c.messages[-1]["reasoning_content"]


def test_tool_exchanges_answer_from_their_results(training):
    for c in training:
        if c.task not in ("tool_call", "two_calls"):
            continue
        calls = [m for m in c.messages if m.get("tool_calls")][-1]["tool_calls"]
        results = [json.loads(m["content"]) for m in c.messages[-1 - len(calls):-1]]
        answer = c.messages[-1]["content"]
        for call, result in zip(calls, results, strict=True):
            assert result["city"] == call["function"]["arguments"]["city"]
            assert all(str(v) in answer for k, v in result.items())


def test_checks_accept_the_reference_answers(data):
    """The evaluation's checks pass the training-format answer of every held-out item."""
    for metric, exchanges in data.heldout().items():
        for exchange in exchanges:
            final = exchange.messages[-1]
            if metric in ("tool_calls", "two_calls"):
                call_turn = exchange.messages[1]
                text = f"<think>\n{call_turn['reasoning_content']}\n</think>\n\n" + "\n".join(
                    "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                  "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                    for c in call_turn["tool_calls"])
            else:
                text = f"<think>\n{final.get('reasoning_content', '')}\n</think>\n\n{final['content']}"
            assert CHECKS[metric](Reply.parse(text), exchange.expected), (metric, text)


def test_demo_tools_are_deterministic_stand_ins():
    assert json.loads(get_weather("Paris")) == weather_report("Paris") == weather_report("Paris")
    assert json.loads(get_time("Oslo"))["time"] == clock_report("Oslo")["time"]
    assert get_weather.schema["function"]["parameters"]["required"] == ["city"]
