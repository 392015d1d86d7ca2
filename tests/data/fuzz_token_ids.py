"""Random token ids, inside and outside the vocabulary, through every API that takes ids: each call must
either run or raise InvalidInputError. Run as a child process by test_input_checks.py (a crash there fails
that test instead of killing the test run). Prints a JSON summary on its last line."""

from __future__ import annotations

import json
import random
import sys

import mlxchat
from mlxchat import InvalidInputError


def random_id(rng: random.Random, vocab: int) -> int:
    return rng.choice([rng.randrange(vocab), vocab, vocab + rng.randrange(1, 10**6), -rng.randrange(1, 10**6),
                       rng.randrange(2**31, 2**63), 2**63 + rng.randrange(10**6), vocab - 1, 0])


def main(folder: str, cases: int) -> None:
    rng = random.Random(20261201)
    model = mlxchat.load_model(folder, dtype="float32")
    vocab = model.config.vocab_size
    session = model.chat_session()
    counts = {"ran": 0, "refused": 0, "other_errors": []}
    apis = {
        "generate": lambda ids: model.generate(ids, {"max_tokens": 2}),
        "logits": lambda ids: model.logits(ids),
        "stream": lambda ids: list(model.stream(ids, {"max_tokens": 1})),
        "logit_bias": lambda ids: model.generate([1, 2], {"max_tokens": 2, "logit_bias": {i: 3.0 for i in ids}}),
        "session_bias": lambda ids: session.send("hi", config={"max_tokens": 2, "logit_bias": {i: 1.0 for i in ids}}),
    }
    for case in range(cases):
        name = rng.choice(sorted(apis))
        ids = [random_id(rng, vocab) for _ in range(rng.randint(1, 6))]
        try:
            apis[name](ids)
            counts["ran"] += 1
        except InvalidInputError:
            counts["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - reported, and fails the test
            counts["other_errors"].append(f"case {case} {name} {ids}: {type(exc).__name__}: {exc}")
        if session.messages and session.messages[-1].role == "user":
            session.reset()
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
