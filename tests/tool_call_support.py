"""Feeding tool-call parsers in pieces, as a stream delivers text (shared by the formats' tests)."""

from __future__ import annotations

from mlxchat.tools.parsing import CallBlock, ToolCallParser


def merge(items: list[str | CallBlock]) -> list[str | CallBlock]:
    """Adjacent text pieces joined (how the text is cut into pieces is not part of the result)."""
    out: list[str | CallBlock] = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] += item
        elif item != "":
            out.append(item)
    return out


def feed_in_pieces(parser: ToolCallParser, text: str, cuts: list[int] | None = None) -> list[str | CallBlock]:
    """Feed ``text`` cut at the given offsets, then finish; adjacent text pieces merged."""
    points = [0, *sorted(cuts or []), len(text)]
    out: list[str | CallBlock] = []
    for a, b in zip(points, points[1:], strict=False):
        out += parser.feed(text[a:b])
    return merge(out + parser.finish())
