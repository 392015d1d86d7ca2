"""The README's examples run as written: the first streaming example (the Sessions section, on the demo
model shipped in the package) prints the reasoning and the answer apart, each under its heading."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_first_streaming_example_prints_reasoning_and_answer_apart() -> None:
    block = next(b for b in python_blocks() if "send_stream" in b)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    output = printed.getvalue()
    thinking, answer = re.search(r"\n\[thinking\] (.*)\n\[answer\] (.*)\n$", output).groups()  # type: ignore[union-attr]
    assert thinking.strip() and "Paris" in answer, output  # the demo model reasons, then answers
    assert answer not in thinking and thinking not in answer, output  # not run together
