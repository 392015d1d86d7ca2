"""What each rank of test_lost_rank.py runs: the qwen3 fixture split tensor-parallel over the group, rank 0
waiting at most ARGV[1] seconds for a step of the others.

Rank 1 follows. Rank 0 streams a long greedy generation, stops reading after a few tokens (the worker
then waits for it, one token ahead) and prints ``streaming``; the test stops or kills rank 1 and writes a
line to rank 0's stdin; rank 0 reads on and prints, as one JSON line, the error the stream ended with and
the seconds from that line to it, then the error a new generation gets at once, and closes the model.
"""

# mlxchat before mlx.core: it puts OpenBLAS under MLX.
import mlxchat  # noqa: I001

import json
import sys
import time
from pathlib import Path

from mlxchat.errors import DistributedError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3"
PROMPT = list(range(1, 21))


def main() -> None:
    model = mlxchat.load_model(FIXTURE, dtype="float32", distributed="tensor", distributed_timeout=float(sys.argv[1]))
    if model.rank != 0:  # type: ignore[attr-defined]
        model.follow()  # type: ignore[attr-defined]
        return
    endless = {"max_tokens": 2000, "temperature": 0.0, "logit_bias": {e: -100.0 for e in model.eos_ids}}
    stream = model.stream(PROMPT, endless)
    for _ in range(3):
        next(stream)
    print("streaming", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    record: dict[str, object] = {"error": None}
    try:
        for _ in stream:
            pass
    except DistributedError as exc:
        record = {"error": str(exc), "seconds": time.monotonic() - started}
    try:
        model.generate(PROMPT, {"max_tokens": 2})
    except DistributedError as exc:
        record["later"] = str(exc)
    model.close()
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
