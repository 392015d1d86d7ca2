"""The words the benchmark conversations are made of: the same text for every engine and every run."""

from __future__ import annotations

import random

SYSTEM = "You are a concise assistant. Answer in a few sentences."

USER_TURNS = (
    "What is the capital of France, and why did it become the capital?",
    "How many people live there today, roughly?",
    "Name three museums worth a visit and say what each is known for.",
    "Which one would you pick for a rainy afternoon with children?",
    "How do I get there from the Gare du Nord by public transport?",
    "What does a single metro ticket cost, and is a day pass cheaper?",
    "Suggest a simple lunch nearby that is not too expensive.",
    "Is it usually crowded on weekday mornings in spring?",
    "Write a two-line poem about the river that runs through the city.",
    "Summarise our conversation in one sentence.",
)

IMAGE_QUESTION = "What is in this picture? Answer in one sentence."
"""The question of the image rows (benchmarks/vision.py)."""

FOLLOW_UPS = (
    "Summarise the report above in three sentences.",
    "Which section mentions the harbour, and what does it say?",
    "List two risks the report names and one remedy for each.",
)

_WORDS = (
    "the a an of to in and or but for with on at by from as is are was were be been has have had will would "
    "can could may might must should city river harbour bridge market council budget report section year "
    "month week day morning evening plan project road rail station ticket price cost growth water power "
    "school museum park garden street house family worker visitor tourist season spring summer autumn "
    "winter north south east west old new large small early late public private local national first "
    "second third last next many few more less most least rise fall increase decrease remain change "
    "build open close repair improve reduce expand measure count record describe explain propose risk "
    "remedy flood storm traffic noise demand supply service quality safety access energy waste transport"
).split()


def document(words: int, seed: int = 7) -> str:
    """A long, plain-English-looking report (the "long history" of the session benchmark)."""
    rng = random.Random(seed)
    sentences, count = [], 0
    while count < words:
        length = rng.randint(8, 20)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(length))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        count += length
        if rng.random() < 0.12:
            sentences.append(f"\n\nSection {len(sentences) // 8 + 1}.\n")
    return " ".join(sentences)


def corpus() -> list[str]:
    """Text to train the merges of the synthetic tokenizers on (families without a real vocabulary here)."""
    return [SYSTEM, *USER_TURNS, *FOLLOW_UPS, document(20000, seed=1)]
