"""Constrained decoding on random weights with the real Qwen3 and Qwen3.5 vocabularies: a random model
writes whatever the mask leaves it, so a reply that parses and validates is the mask's doing. Sampling at
temperature 1 over every schema of tests/constraint_schemas.py, a seed per row, several rows; regexes and grammars;
batched rows mixing constrained and free ones; schemas the engine refuses; a budget too small."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from mlxchat import GenerationConfig
from mlxchat.batching import DecodeRow
from mlxchat.constraints import Constraint, GrammarError, RowMatcher, fill_masks, format_grammar
from mlxchat.errors import InvalidInputError

from conftest import fixture_path, hold_worker_until_queued
from constraint_schemas import SCHEMAS
from real_vocab import real_vocab_model

SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 300}


@pytest.fixture(scope="module")
def qwen3_real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = real_vocab_model(fixture_path("qwen3"), "qwen3", request, tmp_path_factory)
    yield model
    model.close()


@pytest.fixture(scope="module")
def qwen35_real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = real_vocab_model(fixture_path("qwen3_5"), "qwen3.5", request, tmp_path_factory)
    yield model
    model.close()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def assert_valid(result, schema: dict) -> None:
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), schema)


def seeded_rows(model, prompts: list[str], schema: dict, first_seed: int) -> list:
    """One reply per prompt, decoded together, each row sampled with its own seed."""
    fmt = schema_format(schema)
    configs = [{**SAMPLED, "response_format": fmt, "seed": first_seed + i} for i in range(len(prompts))]
    return model.generate_batch(prompts, configs)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_reply_validates_qwen3_vocabulary(qwen3_real, index: int) -> None:
    schema = SCHEMAS[index]
    for result in seeded_rows(qwen3_real, ["Write JSON.", "Reply now:", "{"], schema, 3 * index):
        assert_valid(result, schema)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_reply_validates_qwen35_vocabulary(qwen35_real, index: int) -> None:
    schema = SCHEMAS[index]
    for result in seeded_rows(qwen35_real, ["Write JSON.", "Reply now:"], schema, 1000 + 2 * index):
        assert_valid(result, schema)


def test_json_object_regex_and_grammar_formats(qwen3_real) -> None:
    result = qwen3_real.generate("Hi", {**SAMPLED, "max_tokens": 400, "seed": 3,
                                        "response_format": {"type": "json_object"}})
    if result.finish_reason == "stop":  # any object: random keys may run long, but it is JSON throughout
        assert isinstance(json.loads(result.text), dict)
    else:
        assert result.text.startswith("{")
    result = qwen3_real.generate("Hi", {**SAMPLED, "seed": 4, "response_format": {
        "type": "regex", "pattern": "[A-Z]{2}-[0-9]{3}"}})
    assert result.finish_reason == "stop" and re.fullmatch("[A-Z]{2}-[0-9]{3}", result.text)
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,2}/\n'
    result = qwen3_real.generate("Hi", {**SAMPLED, "seed": 5, "response_format": {"type": "grammar",
                                                                                  "grammar": grammar}})
    assert result.finish_reason == "stop" and re.fullmatch(r"yes|no|maybe [0-9]{1,2}", result.text)


def test_batched_constrained_and_free_rows_equal_each_alone(qwen3_real, monkeypatch: pytest.MonkeyPatch) -> None:
    """One matcher per row: constrained rows decoded in one step with free ones give what each gives alone
    (greedy)."""
    schema = SCHEMAS[-4]
    formats = [schema_format(schema), None, {"type": "regex", "pattern": "[a-z]{3,8}"}, None]
    configs = [{"temperature": 0.0, "max_tokens": 24, "response_format": f} for f in formats]
    alone = [qwen3_real.generate(f"prompt {i}", c) for i, c in enumerate(configs)]
    steps: list[list[bool]] = []
    real = DecodeRow.run_together.__func__  # type: ignore[attr-defined]

    def spy(cls, rows):
        steps.append([row.constraint is not None for row in rows])
        return real(cls, rows)

    monkeypatch.setattr(DecodeRow, "run_together", classmethod(spy))
    hold_worker_until_queued(qwen3_real, len(configs), monkeypatch)
    with ThreadPoolExecutor(len(configs)) as pool:
        together = list(pool.map(lambda ic: qwen3_real.generate(f"prompt {ic[0]}", ic[1]), enumerate(configs)))
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert any(True in step and False in step for step in steps)  # mixed rows did share a step
    assert_valid(alone[0], schema)
    assert re.fullmatch("[a-z]{3,8}", alone[2].text)


def test_a_row_whose_constraint_fails_fails_alone_and_the_step_goes_on(qwen3_real,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A constraint that fails in the middle of a batched step (its engine in error) fails its own generation
    only: the rows decoding beside it finish as each would alone."""
    configs = [{"temperature": 0.0, "max_tokens": 16, "response_format": f}
               for f in (None, {"type": "regex", "pattern": "[a-z]{20,30}"}, {"type": "regex", "pattern": "[0-9]{9}"})]
    alone = [qwen3_real.generate(f"prompt {i}", c) for i, c in enumerate(configs)]
    real = RowMatcher.advance
    seen: dict[int, int] = {}

    def failing(self: RowMatcher, token: int) -> None:  # the second row's matcher breaks at its fourth token
        seen[id(self)] = seen.get(id(self), 0) + 1
        if "[a-z]" in self.constraint.grammar and seen[id(self)] == 4:
            raise GrammarError("the engine broke")
        real(self, token)

    monkeypatch.setattr(RowMatcher, "advance", failing)
    sizes: list[int] = []
    together = DecodeRow.run_together.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(DecodeRow, "run_together", classmethod(lambda cls, rows: sizes.append(len(rows))
                                                                or together(cls, rows)))

    def run(index: int) -> Any:
        try:
            return qwen3_real.generate(f"prompt {index}", configs[index])
        except GrammarError as exc:
            return exc

    hold_worker_until_queued(qwen3_real, len(configs), monkeypatch)  # they start together: their rows share steps
    with ThreadPoolExecutor(len(configs)) as pool:
        results = list(pool.map(run, range(len(configs))))
    assert max(sizes) == len(configs)  # (the rows did share steps)
    assert isinstance(results[1], GrammarError) and "the engine broke" in str(results[1])
    assert [results[0].tokens, results[2].tokens] == [alone[0].tokens, alone[2].tokens]


def test_a_grammar_that_compiles_but_cannot_be_followed_is_refused_before_any_work(qwen3_real) -> None:
    """A schema that refers to itself without end compiles, then fails at its first mask: the request is refused
    there (never in a step shared with others), and the engine's internal state stays out of the message."""
    with pytest.raises(GrammarError, match="cannot be followed") as caught:
        RowMatcher(qwen3_real.token_table, Constraint(format_grammar(schema_format({"$ref": "#"}))))
    assert "<state>" not in str(caught.value) and len(str(caught.value)) < 400
    with pytest.raises(GrammarError, match="cannot be followed"):
        qwen3_real.generate("Hi", {"response_format": schema_format({"$ref": "#"})})


def test_masks_computed_together_equal_each_rows_own(qwen3_real) -> None:
    """Rows' masks computed at once on llguidance's threads (what a batched step does) equal the masks each
    row computes alone, step after step."""
    grammars = [format_grammar(schema_format(SCHEMAS[i])) for i in (-1, -4, -9)]
    together = [RowMatcher(qwen3_real.token_table, Constraint(g)) for g in grammars]
    alone = [RowMatcher(qwen3_real.token_table, Constraint(g)) for g in grammars]
    for step in range(12):
        fill_masks(together)
        for shared, own in zip(together, alone, strict=True):
            mask = shared.mask()
            assert (mask == own.mask()).all()
            token = int(mask.nonzero()[0][step % int(mask.sum())])
            shared.advance(token)
            own.advance(token)


def test_a_false_subschema_does_not_hide_where_a_schema_fails() -> None:
    from mlxchat.constraints import failing_path

    schema = {"type": "object", "properties": {"b": False, "a": {"type": "string", "pattern": "("}}}
    assert failing_path(schema) == "$.properties.a"


def test_an_invalid_schema_names_where_it_fails(qwen3_real) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "strng"}}}}}
    with pytest.raises(GrammarError, match=r"\$\.properties\.a\.properties\.b") as caught:
        qwen3_real.generate("Hi", {"response_format": schema_format(bad)})
    assert caught.value.path == "$.properties.a.properties.b"


def test_an_unsupported_keyword_is_a_clear_error(qwen3_real) -> None:
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(InvalidInputError, match="no-such-format"):
        qwen3_real.generate("Hi", {"response_format": schema_format(schema)})


def test_a_malformed_response_format_is_refused() -> None:
    for bad in ({"type": "xml"}, {"type": "regex"}, {"type": "json_schema"}, "json"):
        with pytest.raises(ValueError, match="response_format"):
            GenerationConfig(response_format=bad)
    assert GenerationConfig(response_format={"type": "text"}).response_format is None


def test_too_few_tokens_end_with_length_and_keep_the_text(qwen3_real) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40, "maxLength": 60}},
              "required": ["s"], "additionalProperties": False}
    result = qwen3_real.generate("Hi", {**SAMPLED, "seed": 1, "max_tokens": 5,
                                        "response_format": schema_format(schema)})
    assert result.finish_reason == "length" and result.text.startswith('{"s": "') and len(result.tokens) == 5


def test_reasoning_comes_first_then_is_closed_within_its_budget(qwen3_real) -> None:
    """A reply that may reason reasons freely, is closed after ``reasoning_budget`` tokens, then follows the
    grammar; an opener the model does not write starts the grammar at once."""
    tokenizer = qwen3_real.tokenizer
    table = qwen3_real.token_table
    schema = {"enum": ["done"]}
    matcher = RowMatcher(table, Constraint(format_grammar(schema_format(schema)), ("", "</think>"), 3))
    for token in tokenizer.encode("one two three"):
        mask = matcher.mask()
        assert mask is not None and not mask[sorted(qwen3_real.eos_ids)].any()
        assert not mask[tokenizer.token_id("<tool_call>")] and mask[tokenizer.token_id("</think>")]
        matcher.advance(token)
    closing = tokenizer.encode("</think>")
    for token in closing:
        mask = matcher.mask()
        assert mask is not None and mask.sum() == 1 and mask[token]
        matcher.advance(token)
    mask = matcher.mask()
    assert mask is not None and mask[tokenizer.encode('"')[0]] and not mask[tokenizer.encode("x")[0]]
    may = RowMatcher(table, Constraint(format_grammar(schema_format(schema)), ("<think>", "</think>"), 8))
    first = may.mask()
    assert first is not None and first[tokenizer.token_id("<think>")] and first[tokenizer.encode('"')[0]]
