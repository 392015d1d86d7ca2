"""JSON Schemas the constrained-decoding tests sweep: objects, nesting, arrays with bounds, enums, const,
anyOf, nullable, integer and number bounds, string length and pattern. Every string is bounded (a length,
an enum or a pattern) and every object closed, so that random weights, which write whatever the mask
leaves them, finish within a few hundred tokens."""

from __future__ import annotations

from typing import Any


def word(most: int = 6, least: int = 0) -> dict[str, Any]:
    return {"type": "string", "minLength": least, "maxLength": most}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCALARS: list[dict[str, Any]] = [
    word(),
    word(3, 3),
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "string", "pattern": "^[A-Z][0-9]{3}$"},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": [1, 2, 3]},
    {"enum": ["x", 4, None, True]},
    {"const": "fixed"},
    {"const": 42},
    {"type": "integer"},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    {"type": "number"},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["string", "null"], "maxLength": 4},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]},
    {"anyOf": [word(3), {"type": "boolean"}]},
    {"anyOf": [{"const": "a"}, {"type": "integer", "minimum": 100, "maximum": 200}]},
]

ARRAYS: list[dict[str, Any]] = [
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": word(3), "minItems": 1, "maxItems": 2},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "maxItems": 3},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "maxItems": 2},
    {"type": "array", "items": obj({"k": word(2)}), "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "integer"}, word(3)], "items": False},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
                                "maxItems": 2}, "maxItems": 2},
]

OBJECTS: list[dict[str, Any]] = [
    obj({"name": word(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": word(8), "country": {"enum": ["FR", "IT", "JP"]}}),
    obj({"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 3}}),
    obj({"a": word(2), "b": word(2), "c": word(2)}, required=["a"]),
    obj({"x": {"type": "number"}, "y": {"type": "number"}}, required=[]),
    obj({"id": {"type": "string", "pattern": "^[0-9]{4}$"}, "kind": {"const": "user"}}),
    obj({"tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]}, "maxItems": 3}}),
    obj({"note": {"type": ["string", "null"], "maxLength": 5}, "score": {"type": ["number", "null"]}}),
    obj({"inner": obj({"v": {"type": "integer", "minimum": 1, "maximum": 5}})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}}),
         "label": word(4)}),
    obj({"items": {"type": "array", "items": obj({"sku": word(3), "qty": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}}), "maxItems": 2}}),
    obj({"choice": {"anyOf": [obj({"kind": {"const": "a"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}),
                              obj({"kind": {"const": "b"}, "s": word(3)})]}}),
    obj({"when": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}, "all_day": {"type": "boolean"}}),
    obj({"level": {"enum": ["low", "mid", "high"]}, "value": {"type": "number", "minimum": 0, "maximum": 100}}),
    obj({"maybe": {"anyOf": [obj({"z": {"type": "null"}}), {"type": "null"}]}}),
    obj({"name": word(5, 1), "aliases": {"type": "array", "items": word(4, 1), "maxItems": 2},
         "active": {"type": "boolean"}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                               "maxItems": 2}, "minItems": 1, "maxItems": 2}}),
    {"type": "object", "properties": {"ref": {"$ref": "#/$defs/leaf"}}, "required": ["ref"],
     "additionalProperties": False, "$defs": {"leaf": obj({"leaf": {"type": "integer", "minimum": 0, "maximum": 9}})}},
    obj({"count": {"type": "integer", "minimum": 0, "maximum": 1000}, "unit": {"const": "ms"},
         "ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"first": word(3), "second": {"type": "integer", "minimum": 0, "maximum": 9}, "third": {"type": "boolean"},
         "fourth": {"enum": [None, "x"]}, "fifth": {"type": "array", "items": {"type": "null"}, "maxItems": 2}},
        required=["first", "third"]),
    obj({"empty": obj({})}),
]

SCHEMAS: list[dict[str, Any]] = [*SCALARS, *ARRAYS, *OBJECTS]
