"""Synthetic conversations of the demo world, and the held-out questions that measure generalisation.

Every answer follows one short, regular pattern, so that a few-million-parameter model can learn the
world in minutes: the reasoning names the entity it is about (country, city, numbers) right before the
answer uses it, arithmetic is worked digit by digit (units, then tens with the carry or borrow), and
tool calls copy the city verbatim from the question.

What is held out is decided from the seed alone (:class:`Split`) before anything is drawn: one question
phrasing per country, 300 arithmetic problems, 60 unit conversions, 24 real cities and 40 invented
places never used with the tools, and some out-of-world questions. Training conversations never contain
a held-out combination; the evaluation asks exactly those.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .world import CAPITALS, CONDITIONS, CONVERSIONS, OTHER_CITIES

Message = dict[str, Any]
PlacePicker = Callable[[random.Random], str]

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are the mlxchat demo assistant.",
    "You are a friendly assistant.",
)

CAPITAL_QUESTIONS = (
    "What is the capital of {c}?", "What's the capital of {c}?", "Which city is the capital of {c}?",
    "Tell me the capital of {c}.", "capital of {c}?", "Do you know the capital of {c}?",
    "Name the capital city of {c}.", "What city is the capital of {c}?",
)
ADD_QUESTIONS = (
    "What is {a} + {b}?", "What's {a} plus {b}?", "Calculate {a} + {b}.", "{a} + {b} = ?",
    "How much is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?", "{a}+{b}",
)
SUB_QUESTIONS = (
    "What is {a} - {b}?", "What's {a} minus {b}?", "Calculate {a} - {b}.", "{a} - {b} = ?",
    "How much is {a} minus {b}?", "Subtract {b} from {a}.", "What is {a} take away {b}?", "{a}-{b}",
)
CONVERSION_QUESTIONS = (
    "How many {to} are in {n} {unit}?", "Convert {n} {unit} to {to}.", "What is {n} {unit} in {to}?",
    "{n} {unit} in {to}?",
)
WEATHER_QUESTIONS = (
    "What's the weather in {a}?", "What is the weather like in {a}?", "How is the weather in {a} today?",
    "Tell me the weather in {a}.", "Can you check the weather in {a}?", "weather in {a}?",
    "Is it warm in {a} right now?", "What's it like outside in {a}?",
)
TIME_QUESTIONS = (
    "What time is it in {a}?", "What's the time in {a}?", "Tell me the current time in {a}.",
    "What is the local time in {a}?", "time in {a}?", "Can you check the time in {a}?",
)
# Two calls in one turn: (first tool, second tool) -> phrasings naming cities {a} then {b}.
TWO_CALL_QUESTIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("get_weather", "get_weather"): (
        "What's the weather in {a} and {b}?", "What is the weather like in {a} and in {b}?",
        "Compare the weather in {a} and {b}.", "How is the weather in {a} and {b} today?",
        "Tell me the weather in {a} and {b}.",
    ),
    ("get_time", "get_time"): (
        "What time is it in {a} and {b}?", "What's the time in {a} and in {b}?",
        "Tell me the current time in {a} and {b}.",
    ),
    ("get_time", "get_weather"): (
        "What time is it in {a}, and what's the weather in {b}?",
        "Tell me the time in {a} and the weather in {b}.",
    ),
    ("get_weather", "get_time"): (
        "What's the weather in {a} and the time in {b}?",
        "How is the weather in {a}, and what time is it in {b}?",
    ),
}
SAME_CITY_QUESTIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("get_weather", "get_time"): ("What's the weather and the time in {a}?",),
    ("get_time", "get_weather"): ("Tell me the time and the weather in {a}.",),
}

GREETINGS = (
    ("Hello!", "Hello! How can I help you today?"), ("Hi", "Hi! How can I help you today?"),
    ("Hi there!", "Hi! How can I help you today?"), ("Hey", "Hey! How can I help you today?"),
    ("Good morning!", "Good morning! How can I help you today?"),
    ("Good evening!", "Good evening! How can I help you today?"),
    ("How are you?", "I'm doing well, thank you! How can I help you today?"),
    ("Hello, how are you?", "I'm doing well, thank you! How can I help you today?"),
)
THANKS = (
    ("Thanks!", "You're welcome!"), ("Thank you!", "You're welcome!"), ("Thanks a lot.", "You're welcome!"),
    ("Great, thanks!", "You're welcome!"), ("thank you so much", "You're welcome!"),
    ("Bye!", "Goodbye! Have a nice day."), ("Goodbye", "Goodbye! Have a nice day."),
    ("See you later!", "Goodbye! Have a nice day."),
)
IDENTITY = (
    "I am a small demo assistant trained by mlxchat. I know the capitals of about 100 countries, I can add "
    "and subtract two-digit numbers and convert metric units, and I can check the weather and the time in "
    "a city when those tools are available."
)
IDENTITY_QUESTIONS = ("Who are you?", "What can you do?", "What are you?", "Introduce yourself.",
                      "What do you know?")
DONT_KNOW = (
    "I'm sorry, I don't know. I can tell you the capitals of countries, add and subtract two-digit numbers, "
    "convert metric units, and check the weather and the time in a city."
)
OUT_OF_WORLD = (
    "Who wrote Hamlet?", "What is the speed of light?", "Who painted the Mona Lisa?",
    "How tall is Mount Everest?",
    "What is the population of Japan?", "Who is the president of France?", "What is the meaning of life?",
    "Write a poem about the sea.", "Can you translate hello into Spanish?", "What is 123 times 45?",
    "What is the square root of 2?", "Who won the World Cup in 2014?", "What is the largest planet?",
    "How do I bake bread?", "What is the best programming language?", "Tell me a joke.",
    "What year did the Second World War end?", "How many legs does a spider have?", "What is DNA?",
    "Recommend a good book.", "What is the longest river in the world?", "How does a car engine work?",
    "Who invented the telephone?", "What should I eat for dinner?", "What is the stock price of Apple?",
    "How old is the universe?", "Can you write some Python code?", "What is the chemical formula of water?",
    "Who discovered penicillin?", "What is the tallest building in the world?", "How far away is the Moon?",
    "What language is spoken in Brazil?", "What is the currency of Japan?",
    "Who is the best football player?",
    "Explain quantum physics.", "What is love?", "How many people live in Paris?",
    "What is the boiling point of gold?", "Sing me a song.", "Who was the first person on the Moon?",
    "What is 7 times 8?", "Divide 96 by 4.", "What is the weather going to be next week?",
    "Summarize the news for today.", "What is your favourite colour?", "How do airplanes fly?",
)
REPEAT_QUESTIONS = ("Repeat after me: {p}", "Say \"{p}\".", "Please repeat: {p}", "Echo this: {p}",
                    "Can you say {p}?")
NO_TOOL_ANSWERS = {
    "get_weather": "I'm sorry, I can't check the weather in {a} because no weather tool is available.",
    "get_time": "I'm sorry, I can't check the time in {a} because no time tool is available.",
}

# Invented names are drawn letter by letter from these parts, in the shapes real place names have ("Kigali",
# "Phnom Penh", "New York", "Rio de Janeiro", "Cape Town"): names made of a few fixed syllables taught an
# earlier build to complete a name from its opening letters, which fails on any unseen real city.
_ONSETS = list("bcdfghjklmnprstvwxyz") * 3 + ("bl br ch dr fr gr kh kr lj ph pr sh st tr th ts zh".split()
                                               + [""] * 12 + ["q"])
_VOWELS = list("aeiouaeiouaeiouy") + "ai ao au ei ia io ou ua".split()
_CODAS = list("nmrlskth") + ["ng", "nd", "st"] + [""] * 33
_PREFIXES = ("New", "San", "Sao", "Santa", "Port", "Saint", "Fort", "Lake", "El", "Los", "La", "Cape",
             "Mount", "North", "South", "Great", "Little", "Puerto")
_SUFFIXES = ("Falls", "Bay", "City", "Springs", "Town", "Beach", "Harbor", "Island")
_JOINS = ("de", "da", "do", "del", "la", "on", "upon", "am", "sur", "en")


def _invented_word(rng: random.Random) -> str:
    while True:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((1, 2, 2, 2, 3, 3, 4))))
        if 3 <= len(word) <= 11:
            return word.capitalize()


_REAL_PLACES = {n.lower() for n in (*CAPITALS, *CAPITALS.values(), *OTHER_CITIES)}


def invented_name(rng: random.Random) -> str:
    """A made-up place name (never a real country or city here)."""
    while True:
        shape = rng.random()
        word = _invented_word(rng)
        if shape < 0.6:
            name = word
        elif shape < 0.72:
            name = f"{rng.choice(_PREFIXES)} {word}"
        elif shape < 0.84:
            name = f"{word} {_invented_word(rng)}"
        elif shape < 0.92:
            name = f"{word} {rng.choice(_JOINS)} {_invented_word(rng)}"
        else:
            name = f"{word} {rng.choice(_SUFFIXES)}"
        if name.lower() not in _REAL_PLACES:
            return name


def invented_names(count: int, rng: random.Random) -> list[str]:
    """``count`` distinct made-up place names."""
    names: list[str] = []
    while len(names) < count:
        name = invented_name(rng)
        if name not in names:
            names.append(name)
    return names


@dataclass(frozen=True)
class Exchange:
    """Messages from one user question to the assistant's final answer, and what they need.

    ``tools``: ``True`` when the demo tools must be offered, ``False`` when they must not be, ``None``
    when either way is right. ``expected`` is what the evaluation checks (held-out items only).
    """

    task: str
    messages: list[Message]
    tools: bool | None = None
    expected: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Conversation:
    """A training conversation (the assistant turns after the last user message are the targets)."""

    task: str
    messages: list[Message]
    tools: bool


@dataclass(frozen=True)
class EvalItem:
    """A held-out prompt (ending where the model must answer) and what a right answer contains."""

    task: str
    messages: list[Message]
    tools: bool
    expected: dict[str, Any]


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _assistant(content: str, reasoning: str = "") -> Message:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


# -- answers ------------------------------------------------------------------------------------------


def capital_exchange(country: str, phrasing: int) -> Exchange:
    question = CAPITAL_QUESTIONS[phrasing].format(c=country)
    capital = CAPITALS[country]
    answer = f"The capital of {country} is {capital}."
    reasoning = f"The user asks for the capital of {country}."
    return Exchange("capital", [_user(question), _assistant(answer, reasoning)], expected={"answer": capital})


def unknown_country_exchange(name: str, phrasing: int) -> Exchange:
    question = CAPITAL_QUESTIONS[phrasing].format(c=name)
    reasoning = f"The user asks for the capital of {name}. I do not know a country called {name}."
    answer = f"I'm sorry, I don't know a country called {name}, so I can't tell you its capital."
    return Exchange("unknown_country", [_user(question), _assistant(answer, reasoning)],
                    expected={"answer": "don't know"})


def addition_steps(a: int, b: int) -> list[str]:
    units, carry = a % 10 + b % 10, (a % 10 + b % 10) // 10
    tens = a // 10 + b // 10 + carry
    return [f"units: {a % 10} + {b % 10} = {units}, write {units % 10}, carry {carry}.",
            f"tens: {a // 10} + {b // 10} + {carry} = {tens}, write {tens}."]


def subtraction_steps(x: int, y: int) -> list[str]:
    """Column subtraction of ``y`` from ``x >= y``."""
    xu, yu = x % 10, y % 10
    if xu >= yu:
        borrow, units = 0, f"units: {xu} - {yu} = {xu - yu}, write {xu - yu}, borrow 0."
    else:
        digit = xu + 10 - yu
        borrow = 1
        units = f"units: {xu} - {yu} needs a borrow: {xu + 10} - {yu} = {digit}, write {digit}, borrow 1."
    tens = x // 10 - y // 10 - borrow
    return [units, f"tens: {x // 10} - {y // 10} - {borrow} = {tens}, write {tens}."]


def arithmetic_exchange(op: str, a: int, b: int, phrasing: int) -> Exchange:
    if op == "+":
        question, result = ADD_QUESTIONS[phrasing].format(a=a, b=b), a + b
        steps = [f"{a} + {b}", *addition_steps(a, b)]
    else:
        question, result = SUB_QUESTIONS[phrasing].format(a=a, b=b), a - b
        if a >= b:
            steps = [f"{a} - {b}", f"{a} is at least {b}, so the result is not negative.",
                     *subtraction_steps(a, b)]
        else:
            steps = [f"{a} - {b}", f"{a} is less than {b}, so I compute {b} - {a} and make it negative.",
                     *subtraction_steps(b, a)]
    steps.append(f"result: {result}.")
    answer = f"{a} {op} {b} = {result}."
    return Exchange("arithmetic", [_user(question), _assistant(answer, "\n".join(steps))],
                    expected={"answer": result})


def conversion_exchange(index: int, n: int, phrasing: int) -> Exchange:
    unit, plural, target, factor = CONVERSIONS[index]
    name = unit if n == 1 else plural
    question = CONVERSION_QUESTIONS[phrasing].format(n=n, unit=name, to=target)
    reasoning = f"1 {unit} is {factor} {target}, so {n} {name} is {n} × {factor} = {n * factor} {target}."
    answer = f"{n} {name} is {n * factor} {target}."
    return Exchange("conversion", [_user(question), _assistant(answer, reasoning)],
                    expected={"answer": n * factor})


def _weather_result(city: str, rng: random.Random) -> dict[str, Any]:
    return {"city": city, "temperature_c": rng.randint(-10, 38), "condition": rng.choice(CONDITIONS)}


def _time_result(city: str, rng: random.Random) -> dict[str, Any]:
    return {"city": city, "time": f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"}


def _clause(result: dict[str, Any]) -> str:
    if "time" in result:
        return result["time"]
    return f"{result['condition']} and {result['temperature_c']}°C"


def _quoted(result: dict[str, Any]) -> list[str]:
    if "time" in result:
        return [result["time"]]
    return [result["condition"], f"{result['temperature_c']}°C"]


def tool_exchange(calls: list[tuple[str, str]], question: str, rng: random.Random) -> Exchange:
    """A question answered by calling ``calls`` (tool, city) in one turn, then writing the results up."""
    plan = " and ".join(f"{name} for {city}" for name, city in calls)
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": {"city": city}}}
        for i, (name, city) in enumerate(calls, start=1)
    ]
    results = [(_weather_result if name == "get_weather" else _time_result)(city, rng)
               for name, city in calls]
    if len(calls) == 1:
        answer = f"It is {_clause(results[0])} in {calls[0][1]} right now."
    else:
        (_, first), (_, second) = calls
        answer = f"In {first} it is {_clause(results[0])}, and in {second} it is {_clause(results[1])}."
    messages = [
        _user(question),
        {"role": "assistant", "content": "", "reasoning_content": f"I need {plan}.",
         "tool_calls": tool_calls},
        *({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result, ensure_ascii=False)}
          for call, result in zip(tool_calls, results, strict=True)),
        _assistant(answer),
    ]
    task = "tool_call" if len(calls) == 1 else "two_calls"
    return Exchange(task, messages, tools=True,
                    expected={"calls": calls, "quotes": [q for r in results for q in _quoted(r)]})


def repeat_exchange(phrase: str, phrasing: int) -> Exchange:
    """Saying a phrase back: extra practice at copying from the context, which tool calls and their answers
    need and which a tiny model learns last."""
    return Exchange("repeat", [_user(REPEAT_QUESTIONS[phrasing].format(p=phrase)), _assistant(phrase)])


def out_of_world_exchange(question: str) -> Exchange:
    return Exchange("out_of_world", [_user(question), _assistant(DONT_KNOW, "This is outside what I know.")],
                    expected={"answer": "don't know"})


def no_tool_exchange(name: str, city: str, phrasing: int) -> Exchange:
    question = (WEATHER_QUESTIONS if name == "get_weather" else TIME_QUESTIONS)[phrasing].format(a=city)
    what = "weather" if name == "get_weather" else "time"
    reasoning = f"The user asks about the {what} in {city}, but no {what} tool is available."
    return Exchange("no_tool", [_user(question), _assistant(NO_TOOL_ANSWERS[name].format(a=city), reasoning)],
                    tools=False)


# -- the split and the generator --------------------------------------------------------------------


class Split:
    """The held-out combinations, fixed by the seed alone."""

    def __init__(self, seed: int):
        rng = random.Random(f"mlxchat-demo-split-{seed}")
        self.capital_phrasing = {c: rng.randrange(len(CAPITAL_QUESTIONS)) for c in CAPITALS}
        two_digit = range(10, 100)
        problems = [(op, a, b) for op in "+-" for a in two_digit for b in two_digit]
        self.arithmetic = set(rng.sample([p for p in problems if p[0] == "+"], 150)
                              + rng.sample([p for p in problems if p[0] == "-"], 150))
        amounts = [(i, n) for i in range(len(CONVERSIONS)) for n in range(1, 100)]
        self.conversions = set(rng.sample(amounts, 60))
        real_cities = sorted({*CAPITALS.values(), *OTHER_CITIES})
        self.tool_cities = sorted(rng.sample(real_cities, 24))
        self.train_cities = [c for c in real_cities if c not in self.tool_cities]
        names = invented_names(440, rng)
        self.heldout_places = names[:40]
        self.train_places = [n for n in names[40:] if self.trainable(n)]
        self.out_of_world = sorted(rng.sample(OUT_OF_WORLD, 8))
        self.train_out_of_world = [q for q in OUT_OF_WORLD if q not in self.out_of_world]

    def trainable(self, place: str) -> bool:
        """No trained name contains a held-out one (or the reverse): held-out places are wholly new."""
        return not any(h in place or place in h for h in self.heldout_places)


# Training mixture: task -> weight.
MIXTURE = {
    "capital": 11, "arithmetic": 34, "conversion": 5, "tool_call": 17, "two_calls": 16,
    "greeting": 3, "thanks": 3, "identity": 1, "unknown_country": 3, "out_of_world": 4, "no_tool": 4,
    "repeat": 10,
}


# Share of conversations that do not need the tools but are offered them (their schema costs ~220 tokens).
OPTIONAL_TOOLS = 0.1


class DemoData:
    """Training conversations and held-out evaluation items for one seed."""

    def __init__(self, seed: int = 0, fresh_places: bool = True, mixture: Mapping[str, float] | None = None):
        unknown = set(mixture or {}) - set(MIXTURE)
        if unknown:
            raise ValueError(f"unknown demo tasks {sorted(unknown)}; the tasks are {sorted(MIXTURE)}")
        self.seed = seed
        self.mixture = {**MIXTURE, **(mixture or {})}
        """Task weights: :data:`MIXTURE` with some replaced (a later stage can drill what one learnt least)."""
        self.split = Split(seed)
        self.fresh_places = fresh_places
        """Invent a new place name for every use in training instead of drawing from the split's list of a
        few hundred: a small model memorises a short list (and then calls the tools with a remembered
        name for any unseen one) where endless new names leave it no way but to copy from the question."""

    # -- training -----------------------------------------------------------------------------------

    def training(self, count: int) -> list[Conversation]:
        """``count`` training conversations (deterministic for the seed): the mixture above, some with
        the tools offered where they are optional, some with a system prompt, some after earlier turns."""
        rng = random.Random(f"mlxchat-demo-train-{self.seed}")
        tasks, weights = zip(*self.mixture.items(), strict=True)
        makers: dict[str, Callable[[random.Random], Exchange]] = {
            "capital": self._capital, "arithmetic": self._arithmetic, "conversion": self._conversion,
            "tool_call": self._tool_call, "two_calls": self._two_calls, "greeting": self._greeting,
            "thanks": self._thanks, "identity": self._identity, "unknown_country": self._unknown_country,
            "out_of_world": self._out_of_world, "no_tool": self._no_tool, "repeat": self._repeat,
        }
        out = []
        for _ in range(count):
            final = makers[rng.choices(tasks, weights)[0]](rng)
            tools = final.tools if final.tools is not None else rng.random() < OPTIONAL_TOOLS
            history: list[Message] = []
            if rng.random() < 0.1:
                for _ in range(rng.choice((1, 1, 2, 3))):
                    kind = rng.choice(("capital", "arithmetic", "conversion", "greeting", "tool_call"))
                    earlier = makers[kind](rng)
                    if earlier.tools in (None, tools):
                        history += earlier.messages
            system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
            out.append(Conversation(final.task, system + history + final.messages, tools))
        return out

    def _capital(self, rng: random.Random) -> Exchange:
        country = rng.choice(list(CAPITALS))
        held = self.split.capital_phrasing[country]
        return capital_exchange(country, rng.choice([p for p in range(len(CAPITAL_QUESTIONS)) if p != held]))

    def _arithmetic(self, rng: random.Random) -> Exchange:
        while True:
            op = rng.choice("+-")
            # Mostly two-digit operands; some one-digit ones so the column method covers them too.
            a, b = (rng.randint(10, 99) if rng.random() < 0.92 else rng.randint(0, 9) for _ in range(2))
            if (op, a, b) not in self.split.arithmetic:
                return arithmetic_exchange(op, a, b, rng.randrange(len(ADD_QUESTIONS)))

    def _conversion(self, rng: random.Random) -> Exchange:
        while True:
            index, n = rng.randrange(len(CONVERSIONS)), rng.randint(1, 99)
            if (index, n) not in self.split.conversions:
                return conversion_exchange(index, n, rng.randrange(len(CONVERSION_QUESTIONS)))

    def _city(self, rng: random.Random) -> str:
        real = rng.random() < 0.2  # mostly invented names: a short list of real ones invites memorising
        return rng.choice(self.split.train_cities) if real else self._place(rng)

    def _place(self, rng: random.Random) -> str:
        if not self.fresh_places:
            return rng.choice(self.split.train_places)
        while True:
            name = invented_name(rng)
            if self.split.trainable(name):
                return name

    def _tool_call(self, rng: random.Random, cities: PlacePicker | None = None) -> Exchange:
        city = (cities or self._city)(rng)
        name = rng.choice(("get_weather", "get_time"))
        question = rng.choice(WEATHER_QUESTIONS if name == "get_weather" else TIME_QUESTIONS).format(a=city)
        return tool_exchange([(name, city)], question, rng)

    def _two_calls(self, rng: random.Random, cities: PlacePicker | None = None) -> Exchange:
        pick = cities or self._city
        a = pick(rng)
        if rng.random() < 0.1:
            names = rng.choice(list(SAME_CITY_QUESTIONS))
            question = rng.choice(SAME_CITY_QUESTIONS[names]).format(a=a)
            return tool_exchange([(names[0], a), (names[1], a)], question, rng)
        b = pick(rng)
        while b == a:
            b = pick(rng)
        names = rng.choice(list(TWO_CALL_QUESTIONS))
        question = rng.choice(TWO_CALL_QUESTIONS[names]).format(a=a, b=b)
        return tool_exchange([(names[0], a), (names[1], b)], question, rng)

    def _greeting(self, rng: random.Random) -> Exchange:
        question, answer = rng.choice(GREETINGS)
        return Exchange("greeting", [_user(question), _assistant(answer)])

    def _thanks(self, rng: random.Random) -> Exchange:
        question, answer = rng.choice(THANKS)
        return Exchange("thanks", [_user(question), _assistant(answer)])

    def _identity(self, rng: random.Random) -> Exchange:
        return Exchange("identity", [_user(rng.choice(IDENTITY_QUESTIONS)), _assistant(IDENTITY)])

    def _unknown_country(self, rng: random.Random) -> Exchange:
        name = self._place(rng)
        return unknown_country_exchange(name, rng.randrange(len(CAPITAL_QUESTIONS)))

    def _repeat(self, rng: random.Random) -> Exchange:
        words: list[str] = []
        for _ in range(rng.randint(2, 8)):
            kind = rng.random()
            if kind < 0.5:
                words.append(self._city(rng))
            elif kind < 0.7:
                words.append(rng.choice(list(CAPITALS)))
            elif kind < 0.85:
                words.append(str(rng.randint(0, 999)))
            else:
                words.append(rng.choice(CONDITIONS))
        return repeat_exchange(" ".join(words), rng.randrange(len(REPEAT_QUESTIONS)))

    def _out_of_world(self, rng: random.Random) -> Exchange:
        question = rng.choice(self.split.train_out_of_world)
        return out_of_world_exchange(question)

    def _no_tool(self, rng: random.Random) -> Exchange:
        name = rng.choice(("get_weather", "get_time"))
        questions = WEATHER_QUESTIONS if name == "get_weather" else TIME_QUESTIONS
        return no_tool_exchange(name, self._city(rng), rng.randrange(len(questions)))

    # -- evaluation ---------------------------------------------------------------------------------

    def heldout(self) -> dict[str, list[Exchange]]:
        """The held-out exchanges by metric, answers included (deterministic for the seed)."""
        rng = random.Random(f"mlxchat-demo-eval-{self.seed}")
        split = self.split

        def place(r: random.Random) -> str:
            return r.choice(split.tool_cities) if r.random() < 0.6 else r.choice(split.heldout_places)

        capitals = [capital_exchange(c, p) for c, p in split.capital_phrasing.items()]
        arithmetic = [arithmetic_exchange(op, a, b, rng.randrange(len(ADD_QUESTIONS)))
                      for op, a, b in sorted(split.arithmetic)]
        conversions = [conversion_exchange(i, n, rng.randrange(len(CONVERSION_QUESTIONS)))
                       for i, n in sorted(split.conversions)]
        dont_know = [out_of_world_exchange(q) for q in split.out_of_world]
        dont_know += [unknown_country_exchange(name, rng.randrange(len(CAPITAL_QUESTIONS)))
                      for name in split.heldout_places[:12]]
        return {
            "capitals": capitals,
            "arithmetic": arithmetic,
            "conversions": conversions,
            "tool_calls": [self._tool_call(rng, place) for _ in range(100)],
            "two_calls": [self._two_calls(rng, place) for _ in range(100)],
            # Answered from given tool results: the prompt runs up to the final assistant turn.
            "tool_answers": [self._tool_call(rng, place) for _ in range(60)]
            + [self._two_calls(rng, place) for _ in range(40)],
            "dont_know": dont_know,
        }

    def evaluation(self) -> dict[str, list[EvalItem]]:
        """The held-out prompts by metric: each ends where the model must answer."""
        rng = random.Random(f"mlxchat-demo-tools-{self.seed}")
        out: dict[str, list[EvalItem]] = {}
        for metric, exchanges in self.heldout().items():
            upto = (lambda e: len(e.messages) - 1) if metric == "tool_answers" else (lambda e: 1)
            out[metric] = [EvalItem(e.task, e.messages[: upto(e)], _offered(e, rng), e.expected)
                           for e in exchanges]
        return out

    def validation(self) -> list[Conversation]:
        """The held-out exchanges as whole conversations, for a held-out loss while training."""
        rng = random.Random(f"mlxchat-demo-tools-{self.seed}")
        return [Conversation(e.task, e.messages, _offered(e, rng))
                for exchanges in self.heldout().values() for e in exchanges]


def _offered(exchange: Exchange, rng: random.Random) -> bool:
    """Whether held-out items offer the tools: as they need, else a third of the time."""
    return exchange.tools if exchange.tools is not None else rng.random() < 1 / 3
