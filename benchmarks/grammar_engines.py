"""Grammar engines side by side (issue 24): llguidance, which mlxchat uses (:mod:`mlxchat.constraints`),
and xgrammar, on what constrained decoding here needs, in one run:

- **Speed** at the real Qwen3 (151,936) and Qwen3.5 (248,320) vocabularies (``../shared/tokenizers`` or
  ``$MLXCHAT_BENCH_TOKENIZERS``): the token table built from a ``tokenizers`` vocabulary, compiling the
  50-property schema of :mod:`benchmarks.constrained` (5 variants, each compiled once, no cache), the first
  mask after a compile, and the per-token mask over random walks (median / p90 / max).
- **Triggered (lazy) grammars**: free text until a call's opener, the call's schema inside, free after.
- **JSON Schema coverage**: which of the test suite's 52 schemas (``tests/constraint_schemas.py``) and of a
  list of keywords compile, and whether random walks under each mask validate (``jsonschema``): a keyword
  an engine accepts but does not enforce shows as invalid walks.
- **Wheels** for Linux x86_64 and macOS arm64 (``pip download --only-binary :all: --platform ...``) and
  what each wheel requires.

Each engine runs in a process of its own, with ``--python-llguidance`` / ``--python-xgrammar`` (default:
this interpreter): xgrammar's wheel requires torch and transformers (and triton on Linux x86_64), so it may
live in a venv of its own. The llguidance process also needs mlxchat (it compiles mlxchat's own grammar).
A random walk picks uniformly among the tokens its mask allows (the end of turn among them, where the
grammar may end), so it visits what a model could write. Results go to ``results/grammar_engines.md``.

    python -m benchmarks.grammar_engines --python-xgrammar /path/to/venv-with-xgrammar/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ENGINES = ("llguidance", "xgrammar")
VOCABULARIES = {"qwen3": 151936, "qwen3.5": 248320}
"""The released checkpoints' logits widths (more than their tokenizers' tokens)."""
STOPS = ("<|im_end|>", "<|endoftext|>")
PLATFORMS = {"Linux x86_64 (glibc 2.35+)": [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)]
             + ["manylinux2014_x86_64"], "macOS arm64 (14+)": ["macosx_14_0_arm64"]}
"""The platform tags a machine accepts: pip matches manylinux tags exactly (so every glibc up to 2.35,
Ubuntu 22.04's; Debian 12 has 2.36) and macOS ones as that version or older."""
WEATHER = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
           "additionalProperties": False}

KEYWORDS: dict[str, dict[str, Any]] = {
    "minLength / maxLength": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
    "format: date": {"type": "string", "format": "date"},
    "format: email": {"type": "string", "format": "email", "maxLength": 12},
    "format: uuid": {"type": "string", "format": "uuid"},
    "minimum / maximum": {"type": "integer", "minimum": 3, "maximum": 7},
    "exclusiveMinimum / Maximum": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100},
    "enum": {"enum": ["a", 1, None]},
    "const": {"const": {"k": [1, 2]}},
    "type list (nullable)": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    "minItems / maxItems": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": 1}], "items": False},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3},
    "contains": {"type": "array", "items": {"enum": [1, 2]}, "contains": {"const": 2}, "maxItems": 3},
    "required": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
                 "required": ["b"], "additionalProperties": False},
    "additionalProperties: schema": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                     "additionalProperties": {"type": "boolean"}},
    "patternProperties": {"type": "object", "patternProperties": {"^[a-z]{1,2}$": {"type": "boolean"}},
                          "additionalProperties": False, "maxProperties": 2},
    "propertyNames": {"type": "object", "propertyNames": {"enum": ["x", "y"]},
                      "additionalProperties": {"type": "boolean"}},
    "minProperties / maxProperties": {"type": "object", "properties": {k: {"type": "boolean"} for k in "abc"},
                                      "minProperties": 2, "maxProperties": 2, "additionalProperties": False},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
                          "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
    "anyOf": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 3}]},
    "oneOf": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "integer", "minimum": 3,
                                                                          "maximum": 8}]},
    "allOf": {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
    "not": {"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}},
    "if / then / else": {"type": "integer", "minimum": 0, "maximum": 9, "if": {"minimum": 5},
                         "then": {"multipleOf": 2}, "else": {"multipleOf": 3}},
    "$ref / $defs": {"$defs": {"leaf": {"type": "integer", "minimum": 0, "maximum": 9}}, "type": "array",
                     "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3},
    "recursive $ref": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "boolean"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "unevaluatedProperties": {"type": "object", "properties": {"a": {"type": "boolean"}},
                              "unevaluatedProperties": False},
}
"""JSON Schema keywords, each in a small schema whose valid values are short (so a random walk ends)."""


def stop_ids(backend: Any) -> list[int]:
    ids = [backend.token_to_id(stop) for stop in STOPS]
    if None in ids:
        raise SystemExit(f"the vocabulary lacks one of {STOPS}")
    return ids


def tokenizers_folder() -> Path:
    return Path(os.environ.get("MLXCHAT_BENCH_TOKENIZERS", HERE.parent.parent / "shared" / "tokenizers"))


def bench_schema(salt: int) -> dict[str, Any]:
    from benchmarks.constrained import schema

    return schema(salt=salt)


def test_schemas() -> list[dict[str, Any]]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from constraint_schemas import SCHEMAS

    return SCHEMAS


# -- the engines, behind one small interface (run in the engine's own process) --------------------------

class Llguidance:
    """What mlxchat runs: its token table (``LLTokenizer`` from the ``tokenizers`` JSON) and its grammar
    (``mlxchat.constraints.json_rule``: ``%json`` with mlxchat's layout, objects closed as mlxchat closes
    them)."""

    def __init__(self, backend: Any, vocab_size: int, stops: list[int]):
        import llguidance
        import llguidance.numpy as llnp

        from mlxchat.constraints import closed, json_rule

        self.llguidance, self.llnp, self.rule = llguidance, llnp, lambda schema: json_rule(closed(schema))
        self.version = llguidance.__version__ if hasattr(llguidance, "__version__") else _version("llguidance")
        began = time.perf_counter()
        self.table = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=stops)
        self.table_s = time.perf_counter() - began
        self.bits = llnp.allocate_token_bitmask(1, vocab_size)

    def matcher(self, grammar: str) -> Any:
        m = self.llguidance.LLMatcher(self.table, self.llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.matcher(f"start: {self.rule(schema)}\n")

    def triggered(self, trigger: str, begin: str, schema: dict[str, Any], end: str) -> Any:
        from llguidance import StructTag

        tag = StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
        return self.matcher(StructTag.to_grammar([tag], assume_special=False))

    def fill(self, matcher: Any) -> np.ndarray:
        self.llnp.fill_next_token_bitmask(matcher, self.bits)
        return self.bits[0]

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def ended(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


class Xgrammar:
    """xgrammar's token table from the same ``tokenizers`` vocabulary (through transformers'
    ``PreTrainedTokenizerFast``, as ``TokenizerInfo.from_huggingface`` takes it), JSON laid out as mlxchat's
    (no free whitespace, ``json.dumps``'s separators), closed objects (``strict_mode``), no compile cache."""

    def __init__(self, backend: Any, vocab_size: int, stops: list[int]):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        self.version = _version("xgrammar")
        began = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(transformers.PreTrainedTokenizerFast(tokenizer_object=backend),
                                                       vocab_size=vocab_size, stop_token_ids=stops)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.table_s = time.perf_counter() - began
        self.bits = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.words = self.bits.numpy()

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(", ", ": "), strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def triggered(self, trigger: str, begin: str, schema: dict[str, Any], end: str) -> Any:
        from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TriggeredTagsFormat

        tag = StructuralTag(format=TriggeredTagsFormat(triggers=[trigger], tags=[
            TagFormat(begin=begin, content=JSONSchemaFormat(json_schema=schema), end=end)]))
        return self.xgr.GrammarMatcher(self.compiler.compile_structural_tag(tag))

    def fill(self, matcher: Any) -> np.ndarray:
        matcher.fill_next_token_bitmask(self.bits)
        return self.words[0]

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def ended(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def allowed(words: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])


def walk(engine: Any, matcher: Any, rng: np.random.Generator, vocab_size: int, stops: list[int],
         cap: int) -> dict[str, Any]:
    """Tokens picked uniformly among those each mask allows, until an end of turn or the grammar's end:
    the mask times (s) and the tokens."""
    times, tokens, how = [], [], "cap"
    for _ in range(cap):
        began = time.perf_counter()
        words = engine.fill(matcher)
        times.append(time.perf_counter() - began)
        choices = allowed(words, vocab_size)
        if not len(choices):
            how = "dead end"
            break
        token = int(rng.choice(choices))
        if token in stops:
            how = "end"
            break
        if not engine.consume(matcher, token):
            how = "refused its own token"
            break
        tokens.append(token)
        if engine.ended(matcher):
            how = "end"
            break
    return {"times": times, "tokens": tokens, "how": how}


def speed(engine_class: Callable[..., Any], folder: Path, vocab_size: int, quick: bool) -> dict[str, Any]:
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    stops = stop_ids(backend)
    engine = engine_class(backend, vocab_size, stops)
    compiles, firsts, masks, steps, ends = [], [], [], [], []
    for salt in range(1 if quick else 5):
        body = bench_schema(salt)
        began = time.perf_counter()
        matcher = engine.compile(body)
        compiles.append(time.perf_counter() - began)
        walked = walk(engine, matcher, np.random.default_rng(salt), vocab_size, stops, 60 if quick else 3000)
        firsts.append(walked["times"][0])
        masks += walked["times"][1:]
        steps.append(len(walked["tokens"]))
        ends.append(walked["how"])
    return {"version": engine.version, "table_s": engine.table_s, "compile_s": compiles, "first_mask_s": firsts,
            "mask_s": masks, "steps": steps, "ends": ends}


def triggered_check(engine: Any, backend: Any, vocab_size: int) -> dict[str, Any]:
    """Free text, a call's opener (the trigger, written as plain text), a valid call: how many tokens the
    mask allows at the start, after the free text, inside the call and after it."""
    counts = []
    try:
        matcher = engine.triggered("<tool_call>", "<tool_call>\n", WEATHER, "\n</tool_call>")
        for pieces in (["Let me check. "], ["<tool", "_call>\n"], ['{"zone": "UTC"}', "\n</tool", "_call>"]):
            counts.append(len(allowed(engine.fill(matcher), vocab_size)))
            for piece in pieces:
                for token in backend.encode(piece, add_special_tokens=False).ids:
                    if not engine.consume(matcher, token):
                        return {"ok": False, "counts": counts, "error": f"refused a token of {piece!r}"}
        counts.append(len(allowed(engine.fill(matcher), vocab_size)))
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is the finding
        return {"ok": False, "counts": counts, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    free, inside, after = counts[1], counts[2], counts[3]
    return {"ok": free > vocab_size // 2 and inside < vocab_size // 100 and after > vocab_size // 2,
            "counts": counts}


def coverage(engine: Any, backend: Any, vocab_size: int, stops: list[int], schemas: dict[str, Any],
             walks: int) -> dict[str, Any]:
    """Per schema: whether it compiles (or why not), and how many of ``walks`` random walks end on JSON
    that validates against it."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    out = {}
    for name, body in schemas.items():
        try:
            engine.compile(body)
        except Exception as exc:  # noqa: BLE001 - the engine's refusal is the finding
            out[name] = {"compiles": False, "error": f"{str(exc).strip().splitlines()[0][:140]}"}
            continue
        valid = unfinished = 0
        for seed in range(walks):
            walked = walk(engine, engine.compile(body), np.random.default_rng(seed), vocab_size, stops, 1000)
            if walked["how"] != "end":
                unfinished += 1
                continue
            try:
                value = json.loads(backend.decode(walked["tokens"]))
                if jsonschema is not None:
                    jsonschema.validate(value, body)
                valid += 1
            except (ValueError, Exception):  # noqa: BLE001 - json's or jsonschema's: not valid
                pass
        out[name] = {"compiles": True, "valid": valid, "unfinished": unfinished, "walks": walks,
                     "checked": jsonschema is not None}
    return out


def child(engine_name: str, quick: bool) -> dict[str, Any]:
    """One engine's measurements (this process has the engine installed)."""
    import tokenizers

    engine_class = {"llguidance": Llguidance, "xgrammar": Xgrammar}[engine_name]
    folder = tokenizers_folder()
    if not (folder / "qwen3" / "tokenizer.json").exists():
        raise SystemExit(f"no Qwen vocabularies in {folder} (set MLXCHAT_BENCH_TOKENIZERS)")
    result: dict[str, Any] = {"python": sys.version.split()[0], "speed": {}}
    for name, vocab_size in list(VOCABULARIES.items())[: 1 if quick else None]:
        result["speed"][name] = speed(engine_class, folder / name, vocab_size, quick)
    backend = tokenizers.Tokenizer.from_file(str(folder / "qwen3" / "tokenizer.json"))
    stops = stop_ids(backend)
    engine: Any = engine_class(backend, VOCABULARIES["qwen3"], stops)
    result["version"] = engine.version
    result["triggered"] = triggered_check(engine, backend, VOCABULARIES["qwen3"])
    schemas = test_schemas()[: 4 if quick else None]
    result["schemas"] = coverage(engine, backend, VOCABULARIES["qwen3"], stops,
                                 {str(i): s for i, s in enumerate(schemas)}, 1)
    keywords = dict(list(KEYWORDS.items())[: 4 if quick else None])
    result["keywords"] = coverage(engine, backend, VOCABULARIES["qwen3"], stops, keywords, 1 if quick else 3)
    return result


# -- the parent: each engine in its own process, wheels, the report -------------------------------------

def run_engine(engine_name: str, python: str, quick: bool) -> dict[str, Any]:
    command = [python, "-m", "benchmarks.grammar_engines", "--child", engine_name] + (["--quick"] if quick else [])
    done = subprocess.run(command, cwd=HERE.parent, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1], "python": python}
    return json.loads(done.stdout.strip().splitlines()[-1])


def wheels(packages: dict[str, str]) -> dict[str, Any]:
    """For each package (at the version measured) and platform: the wheel pip finds, and what it requires
    (its Requires-Dist without extras)."""
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    out: dict[str, Any] = {}
    for package, version in packages.items():
        for where, tags in PLATFORMS.items():
            with tempfile.TemporaryDirectory() as folder:
                platforms = [arg for tag in tags for arg in ("--platform", tag)]
                done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary",
                                       ":all:", *platforms, "--python-version", python_version, "-d", folder,
                                       f"{package}=={version}" if version else package],
                                      capture_output=True, text=True)
                found = sorted(Path(folder).glob("*.whl"))
                if done.returncode != 0 or not found:
                    out[f"{package} {where}"] = {"wheel": None, "error": done.stderr.strip().splitlines()[-1:]}
                    continue
                with zipfile.ZipFile(found[0]) as wheel:
                    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
                    lines = wheel.read(meta).decode().splitlines()
                requires = [line.split(":", 1)[1].strip() for line in lines
                            if line.startswith("Requires-Dist:") and "extra ==" not in line]
                out[f"{package} {where}"] = {"wheel": found[0].name, "requires": requires}
    return out


def stats_us(seconds: list[float]) -> str:
    if not seconds:
        return "—"
    ordered = sorted(seconds)
    n = len(ordered)
    return (f"{ordered[n // 2] * 1e6:.0f} / {ordered[min(n - 1, int(n * 0.9))] * 1e6:.0f} / "
            f"{ordered[-1] * 1e6:.0f}")


def report(results: dict[str, Any], wheel_results: dict[str, Any], conditions: str) -> list[str]:
    lines = ["# Grammar engines: llguidance and xgrammar", "",
             "Written by `python -m benchmarks.grammar_engines` (benchmarks/grammar_engines.py, whose docstring "
             "says what each figure is).", "", f"Conditions: {conditions}", ""]
    for name, r in results.items():
        where = f" (Python {r['python']})" if "python" in r else ""
        lines.append(f"- {name}: {r.get('version', 'not measured: ' + str(r.get('error')))}{where}")
    lines += ["", "## Speed", "",
              "Token table: built once per model from the `tokenizers` vocabulary. Compile: the 50-property schema "
              "of benchmarks/constrained.py, 5 variants, each once: the first after the table apart (it may pay "
              "for what the engine builds on first use), then the median (min-max) of the other 4. Mask: one "
              "token's mask into a preallocated bitmask, over random walks through the 5 variants (the first mask "
              "after each compile apart, median).", "",
              "| vocabulary | engine | token table s | first compile ms | compile ms median (min-max) | first mask "
              "ms | mask µs median / p90 / max | masks | walks ended (tokens) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for vocab, width in VOCABULARIES.items():
        for name, r in results.items():
            s = r.get("speed", {}).get(vocab)
            if s is None:
                continue
            compiles = sorted(c * 1e3 for c in s["compile_s"][1:]) or [float("nan")]
            firsts = sorted(f * 1e3 for f in s["first_mask_s"])
            lines.append(f"| {vocab} ({width:,}) | {name} | {s['table_s']:.2f} | {s['compile_s'][0] * 1e3:.1f} | "
                         f"{compiles[len(compiles) // 2]:.1f} ({compiles[0]:.1f}-{compiles[-1]:.1f}) | "
                         f"{firsts[len(firsts) // 2]:.2f} | "
                         f"{stats_us(s['mask_s'])} | {len(s['mask_s'])} | "
                         f"{', '.join(f'{h} ({n})' for h, n in zip(s['ends'], s['steps'], strict=True))} |")
    lines += ["", "## Triggered (lazy) grammars", "",
              "One tool's call, `<tool_call>\\n{schema}\\n</tool_call>`, triggered by `<tool_call>` written as text "
              "(llguidance: `StructTag`, lazy lexemes; xgrammar: `TriggeredTagsFormat`). Allowed tokens (Qwen3 "
              "vocabulary) at the start, after some free text, just inside the call, and after it.", "",
              "| engine | works | allowed: start / free text / inside the call / after it |", "|---|---|---|"]
    for name, r in results.items():
        t = r.get("triggered")
        if t is not None:
            lines.append(f"| {name} | {'yes' if t['ok'] else 'no'} | {' / '.join(f'{c:,}' for c in t['counts'])}"
                         f"{'; ' + t['error'] if t.get('error') else ''} |")
    lines += ["", "## JSON Schema coverage", "",
              "Compiled on the Qwen3 vocabulary; a compiled schema then gets random walks whose JSON is validated "
              "with `jsonschema` (valid / walks; unfinished: no end within 1000 tokens).", ""]
    for name, r in results.items():
        if "schemas" not in r:
            continue
        compiled = [k for k, v in r["schemas"].items() if v["compiles"]]
        valid = [k for k in compiled if r["schemas"][k]["valid"] == r["schemas"][k]["walks"]]
        failing = [f"{k}: {v['error']}" for k, v in r["schemas"].items() if not v["compiles"]]
        invalid = [k for k in compiled if k not in valid]
        lines.append(f"- {name}: tests/constraint_schemas.py: {len(compiled)}/{len(r['schemas'])} compile, "
                     f"{len(valid)} walks valid" + (f"; not compiled: {'; '.join(failing)}" if failing else "")
                     + (f"; walks not valid: {', '.join(invalid)}" if invalid else ""))
    names = [n for n, r in results.items() if "keywords" in r]
    lines += ["", "| keyword | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for keyword in KEYWORDS:
        cells = []
        for name in names:
            k = results[name]["keywords"].get(keyword)
            if k is None:
                cells.append("")
            elif not k["compiles"]:
                cells.append(f"refused: {k['error'][:90]}")
            else:
                verdict = "enforced" if k["valid"] == k["walks"] else "**not enforced**" if k["valid"] + k[
                    "unfinished"] < k["walks"] else "unfinished"
                cells.append(f"{verdict} ({k['valid']}/{k['walks']} valid)")
        if any(cells):
            lines.append(f"| {keyword} | " + " | ".join(cells) + " |")
    lines += ["", "## Wheels", "", "`pip download --only-binary :all: --no-deps --platform TAG... "
              f"--python-version {sys.version_info.major}.{sys.version_info.minor}` of the version measured; "
              "requires: the wheel's Requires-Dist without extras.", "", "| package, platform | wheel | requires |",
              "|---|---|---|"]
    for key, w in wheel_results.items():
        lines.append(f"| {key} | {w['wheel'] or 'none: ' + ' '.join(w.get('error') or [])} | "
                     f"{', '.join(w.get('requires') or []) or 'nothing'} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-llguidance", default=sys.executable)
    parser.add_argument("--python-xgrammar", default=sys.executable)
    parser.add_argument("--quick", action="store_true", help="smoke test: one vocabulary, short walks, few schemas, "
                        "no wheels; writes results/grammar_engines-quick.md")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="what else the machine was doing (written with the conditions)")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quick)))
        return
    load = os.getloadavg()[0]
    began = time.perf_counter()
    results = {name: run_engine(name, getattr(args, f"python_{name}"), args.quick) for name in ENGINES}
    wheel_results = {} if args.quick else wheels({name: r.get("version", "") for name, r in results.items()})
    conditions = (f"{platform.platform()}, {os.cpu_count()} CPUs; load average {load:.1f} at the start, "
                  f"{os.getloadavg()[0]:.1f} at the end ({time.perf_counter() - began:.0f} s); "
                  f"{time.strftime('%Y-%m-%d %H:%M')}. {args.note}").strip()
    lines = report(results, wheel_results, conditions)
    out = args.out or HERE / "results" / ("grammar_engines-quick.md" if args.quick else "grammar_engines.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
