"""Multi-turn cost: what each turn prefills and how long its first token takes.

Three ways to hold a conversation, all rendering the whole history through the checkpoint's chat
template every turn:

- ``session``: an mlxchat ChatSession (cuts its cache back to the common prefix, prefills the rest);
- ``stateless``: the session's visible history rendered and fed to ``model.generate`` with a fresh cache,
  as a stateless server (or mlx-lm's ``stream_generate`` without a prompt cache) does; its greedy reply
  must equal the session's (``same_reply``);
- ``mlx-lm cache``: mlx-lm holding its own copy of the conversation (its replies as decoded text) with the
  prompt cache its HTTP server keeps (see :func:`run_mlx_lm`).

Scenarios: a 10-turn chat; a long first message (a ~4k-token report) and follow-up questions; for models
with layer state that cannot be cut back (hybrids) also regenerating the last reply and rewinding two
turns. Time to first token is counted from just after the render (cache lookup included) to the first
generated token, after a warm-up generation. Replies are greedy and short: only prefill differs between
the three ways. mlx-lm renders through its own tokenizer wrapper, as its server does (which, for instance,
turns thinking on where the vocabulary has think tokens), so its prompts may differ by a few tokens.
"""

from __future__ import annotations

import time
from typing import Any

from .texts import FOLLOW_UPS, SYSTEM, USER_TURNS, document

REWIND_MESSAGE = "Let us start over from there: what else is worth seeing nearby?"


def script(chat_turns: int, document_words: int, follow_ups: int, hybrid: bool) -> list[dict[str, Any]]:
    """The scenarios as steps: ("send", text) / ("regenerate",) / ("rewind", turns, text) / ("reset",)."""
    chat: list[dict[str, Any]] = [{"scenario": "chat", "op": "send", "text": text} for text in USER_TURNS]
    del chat[chat_turns:]
    if hybrid:
        chat += [
            {"scenario": "chat", "op": "regenerate"},
            {"scenario": "chat", "op": "rewind", "turns": 2, "text": REWIND_MESSAGE},
        ]
    history: list[dict[str, Any]] = []
    if document_words:
        report = document(document_words) + "\n\nThat is the whole report; questions follow."
        history = [
            {"scenario": "history", "op": "reset"},
            {"scenario": "history", "op": "send", "text": report},
        ]
        history += [{"scenario": "history", "op": "send", "text": t} for t in FOLLOW_UPS[:follow_ups]]
    return chat + history


class Conversation:
    """The visible history (OpenAI-style messages) that every way renders."""

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]

    def apply(self, step: dict[str, Any]) -> None:
        """Changes the history for a step, before the reply (which :meth:`reply` appends)."""
        if step["op"] == "send":
            self.messages.append({"role": "user", "content": step["text"]})
        elif step["op"] == "regenerate":
            self.messages.pop()
        elif step["op"] == "rewind":
            del self.messages[len(self.messages) - 2 * step["turns"] :]
            self.messages.append({"role": "user", "content": step["text"]})
        elif step["op"] == "reset":
            del self.messages[1:]

    def reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def run_mlxchat(folder: str, steps: list[dict[str, Any]], reply_tokens: int) -> list[dict[str, Any]]:
    """The ChatSession, and after each of its turns the same visible history re-rendered and generated
    from a fresh cache (the stateless cost, and a check that the session replied as a stateless run does)."""
    import mlxchat
    from mlxchat import GenerationConfig

    model = mlxchat.load_model(folder)
    config = GenerationConfig(max_tokens=reply_tokens, temperature=0.0)
    model.generate(model.encode(SYSTEM), config.merged({"max_tokens": 2}))  # warm-up, fresh cache
    session = model.chat_session(system=SYSTEM, default_config=config)
    rows = []
    for step in steps:
        if step["op"] == "reset":
            session.reset()
            continue
        row: dict[str, Any] = {"scenario": step["scenario"], "op": step["op"]}
        row["session"] = _session_turn(session, step, config)
        if "error" in row["session"]:
            row["stateless"] = {"error": "no session turn to compare with"}
            rows.append(row)
            continue
        ids = model.apply_chat_template(session.messages[:-1], add_generation_prompt=True)
        start = time.perf_counter()
        result = model.generate(ids, config)
        row["stateless"] = _report(result.report, time.perf_counter() - start, list(result.tokens))
        if "tokens" in row["session"]:
            row["same_reply"] = row["session"].pop("tokens") == row["stateless"].pop("tokens")
        rows.append(row)
    return rows


def _session_turn(session: Any, step: dict[str, Any], config: Any) -> dict[str, Any]:
    op = step["op"]
    method = {"send": "send", "regenerate": "regenerate", "rewind": "rewind"}[op]
    if not hasattr(session, method):
        return {"error": f"ChatSession has no {method}()"}
    start = time.perf_counter()
    try:
        if op == "send":
            result = session.send(step["text"], config=config)
        elif op == "regenerate":
            result = session.regenerate(config=config)
        else:
            session.rewind(len(session.messages) - 2 * step["turns"])
            result = session.send(step["text"], config=config)
    except Exception as exc:  # an API difference is reported in the table, not fatal to the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    tokens = getattr(result, "tokens", None)
    return _report(result.report, time.perf_counter() - start, list(tokens) if tokens is not None else None)


def _report(report: Any, wall: float, tokens: list[int] | None) -> dict[str, Any]:
    row = {
        "prompt_tokens": report.prompt_tokens,
        "prefilled": report.prompt_tokens - report.cached_prompt_tokens,
        "ttft_s": report.ttft_s,
        "wall_s": wall,
    }
    if tokens is not None:
        row["tokens"] = tokens
    return row


def run_mlx_lm(engine: Any, steps: list[dict[str, Any]], reply_tokens: int) -> list[dict[str, Any]]:
    """mlx-lm with its server's prompt cache, on an engine loaded by :mod:`benchmarks.engines`.

    As mlx-lm 0.32.2's server does for a chat request: fetch the nearest stored cache (copied, and trimmed
    to the common prefix where the cache allows), prefill the rest, store copies at the segment ends
    inside the prompt (after the system prompt; before a thinking tail) and, after the reply, the cache
    under prompt + reply tokens.
    """
    import copy

    from mlx_lm import stream_generate
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    model, tokenizer = engine.model, engine.tokenizer
    list(stream_generate(model, tokenizer, tokenizer.encode(SYSTEM), max_tokens=2))  # warm-up, fresh cache
    eos = set(tokenizer.eos_token_ids)
    store = LRUPromptCache(max_size=10)
    conversation = Conversation()
    stored: list[int] = []
    rows = []
    for step in steps:
        conversation.apply(step)
        if step["op"] == "reset":
            continue
        prompt = _ids(tokenizer.apply_chat_template(conversation.messages, add_generation_prompt=True))
        segments = _segment_ends(tokenizer, conversation.messages, prompt)
        start = time.perf_counter()
        cache, rest = store.fetch_nearest_cache("model", prompt)
        done = len(prompt) - len(rest)
        cache = cache if cache is not None else make_prompt_cache(model)
        for end, kind in segments:
            if done < end < len(prompt):
                _prefill(model, cache, prompt[done:end])
                store.insert_cache("model", prompt[:end], copy.deepcopy(cache), cache_type=kind)
                done = end
        first, tokens = None, []
        rest_ids = prompt[done:]
        replies = stream_generate(model, tokenizer, rest_ids, max_tokens=reply_tokens, prompt_cache=cache)
        for response in replies:
            first = first or time.perf_counter()
            tokens.append(response.token)
        wall = time.perf_counter() - start
        entry = {
            "prompt_tokens": len(prompt),
            "prefilled": len(rest),
            "ttft_s": (first or start) - start,
            "wall_s": wall,
            "last_reply_reused": bool(stored) and prompt[: len(stored)] == stored,
        }
        stored = prompt + tokens
        store.insert_cache("model", stored, cache)
        conversation.reply(tokenizer.decode([t for t in tokens if t not in eos]))
        rows.append({"scenario": step["scenario"], "op": step["op"], "mlx-lm cache": entry})
    return rows


def _segment_ends(tokenizer: Any, messages: list[dict[str, str]], prompt: list[int]) -> list[tuple[int, str]]:
    """Where mlx-lm's server stores caches inside a chat prompt (``ResponseGenerator._tokenize``): at the
    end of the system prompt, and before a thinking tail within the prompt's last 11 tokens."""
    if messages[-1]["role"] != "user":
        return []
    ends = []
    systems = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if systems:
        blank = [*messages[:systems], {"role": "user", "content": ""}]
        head = _ids(tokenizer.apply_chat_template(blank, add_generation_prompt=False))
        end = next((i for i, (a, b) in enumerate(zip(head, prompt, strict=False)) if a != b), 0)
        if 0 < end < len(prompt):
            ends.append((end, "system"))
    if tokenizer.has_thinking:
        tail = tokenizer.rfind_think_start(prompt, start=len(prompt) - 11)
        if tail >= 0 and tail > (ends[-1][0] if ends else 0):
            ends.append((tail, "user"))
    return ends


def _prefill(model: Any, cache: list[Any], tokens: list[int]) -> None:
    """mlx-lm's own prefill loop (``generate_step``): 2048-token chunks, caches evaluated after each."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        for begin in range(0, len(tokens), 2048):
            model(mx.array(tokens[begin : begin + 2048])[None], cache=cache)
            mx.eval([c.state for c in cache])


def _ids(rendered: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding where 4.x returned a list."""
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(t) for t in ids]


def document_words(tokenizer_json: str, target_tokens: int) -> int:
    """How many words of :func:`benchmarks.texts.document` make about ``target_tokens`` tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    words = target_tokens
    for _ in range(4):
        count = len(tok.encode(document(words)).ids)
        words = max(1, round(words * target_tokens / count))
    return words
