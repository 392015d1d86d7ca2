"""One measurement job in its own process: ``python -m benchmarks.worker '<json job>'``.

The driver (``python -m benchmarks``) spawns one of these per engine, model and repetition, so every
engine starts from a clean process (its own BLAS, allocator and caches) and engines alternate in time.
The result is printed as one JSON line after ``RESULT_MARK``.

Jobs: ``info`` (what mlxchat runs on here), ``limits`` (bandwidth and GEMM), ``speed`` (prefill at
several prompt lengths, decode, peak memory), ``sessions`` (see :mod:`benchmarks.sessions`), ``batching``
(see :mod:`benchmarks.batching`), ``speculative`` (see :mod:`benchmarks.speculative`), ``vision`` (a
prompt with a picture, see :mod:`benchmarks.vision`), ``context`` (one context length, see
:mod:`benchmarks.context`) and ``lora`` (one engine's LoRA training, see :mod:`benchmarks.lora`).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

RESULT_MARK = "BENCHMARK-RESULT "
FIRST_ID, LAST_ID = 256, 30000
"""Prompt ids are drawn from here (capped by the tokenizer's size): ordinary tokens, not control tokens."""


def prompt_ids(length: int, seed: int, tokenizer_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, min(LAST_ID, tokenizer_size)) for _ in range(length)]


def info(_: dict[str, Any]) -> dict[str, Any]:
    import mlxchat
    from mlxchat.runtime import default_dtype, on_gpu

    from .gguf import available

    stored = "stored"
    policy = default_dtype(stored)  # the checkpoint's dtype (returned as given) on a GPU, float32 on a CPU
    return {
        **mlxchat.runtime_info(),
        "model_types": mlxchat.registry().known_model_types(),
        "compute_dtype": None if policy is stored else str(policy).rsplit(".", 1)[-1],
        "gpu": on_gpu(),
        "llama_cpp": available(),
    }


def limits(job: dict[str, Any]) -> dict[str, Any]:
    from .limits import measure

    return measure(job["device"])


def speed(job: dict[str, Any]) -> dict[str, Any]:
    from .engines import SPLIT, Traffic, open_engine, peak_rss_bytes

    start = time.perf_counter()
    engine = open_engine(
        job["engine"],
        Path(job["folder"]),
        blas_path=job.get("blas_path"),
        dtype=job.get("dtype"),
        context=max(job["prefill"]) + job["decode"] + 64,
    )
    load_s = time.perf_counter() - start
    traffic = Traffic() if job["engine"] in SPLIT else None  # after mlxchat is imported (it sets up the BLAS)
    size = job["tokenizer_size"]
    list(engine.stream(prompt_ids(16, 1, size), 2))  # warm-up: first-call allocations and compilation
    runs = []
    for length in job["prefill"]:
        ids = prompt_ids(length, length, size)
        max_tokens = job["decode"] if length == job["decode_at"] else 1
        engine.reset_peak()
        arrivals = []
        begin = time.perf_counter()
        for _ in engine.stream(ids, max_tokens):
            arrivals.append(time.perf_counter())
        ttft = arrivals[0] - begin
        run: dict[str, Any] = {
            "prompt": length,
            "ttft_s": ttft,
            "prefill_tps": length / ttft,
            "peak_bytes": engine.peak_bytes(),
        }
        if max_tokens > 1:
            run["generated"] = len(arrivals)
            span = arrivals[-1] - arrivals[0]
            run["decode_tps"] = (len(arrivals) - 1) / span if span > 0 else None
        runs.append(run)
    result = {**engine.describe(), "load_s": load_s, "runs": runs, "peak_rss_bytes": peak_rss_bytes()}
    if traffic is not None:
        result["traffic"] = per_token_traffic(engine, traffic, size)
    return result


def per_token_traffic(engine: Any, traffic: Any, tokenizer_size: int) -> dict[str, float]:
    """What a decode step hands to the collectives: the counts of a 9-token generation less those of a
    1-token one (same prompt), over the 8 extra steps."""
    ids = prompt_ids(16, 2, tokenizer_size)
    counts = []
    for tokens in (1, 9):
        before = traffic.snapshot()
        list(engine.stream(ids, tokens))
        counts.append({k: v - before[k] for k, v in traffic.snapshot().items()})
    return {k: (counts[1][k] - counts[0][k]) / 8 for k in counts[0]}


def sessions(job: dict[str, Any]) -> dict[str, Any]:
    from . import sessions as scenarios
    from .engines import open_engine, peak_rss_bytes

    steps = scenarios.script(job["chat_turns"], job["document_words"], job["follow_ups"], job["hybrid"])
    if job["engine"] == "mlxchat":
        try:
            import mlxchat.session  # noqa: F401
        except ImportError:
            return {
                "engine": "mlxchat",
                "unavailable": "sessions not available: mlxchat has no ChatSession yet",
            }
        rows = scenarios.run_mlxchat(job["folder"], steps, job["reply_tokens"])
        return {"engine": "mlxchat", "rows": rows, "peak_rss_bytes": peak_rss_bytes()}
    engine = open_engine(
        "mlx-lm", Path(job["folder"]), blas_path=job.get("blas_path"), dtype=job.get("dtype"), context=0
    )
    rows = scenarios.run_mlx_lm(engine, steps, job["reply_tokens"])
    return {**engine.describe(), "rows": rows, "peak_rss_bytes": peak_rss_bytes()}


def batching(job: dict[str, Any]) -> dict[str, Any]:
    from . import batching as together

    return together.run(job)


def constrained(job: dict[str, Any]) -> dict[str, Any]:
    from . import constrained as held

    return held.run(job)


def speculative(job: dict[str, Any]) -> dict[str, Any]:
    from . import speculative as pairs

    return pairs.run(job)


def context(job: dict[str, Any]) -> dict[str, Any]:
    """One engine at one context length (see :mod:`benchmarks.context`): a prompt that long, then
    ``decode`` tokens at that depth."""
    from .engines import open_engine, peak_rss_bytes

    if job["engine"] == "mlxchat-session":
        return session_turn(job)
    length, size = job["length"], job["tokenizer_size"]
    engine = open_engine(job["engine"], Path(job["folder"]), blas_path=job.get("blas_path"), dtype=job.get("dtype"),
                         context=length + job["decode"] + 64)
    list(engine.stream(prompt_ids(16, 1, size), 2))  # warm-up: first-call allocations and compilation
    engine.reset_peak()
    arrivals = []
    begin = time.perf_counter()
    for _ in engine.stream(prompt_ids(length, length, size), job["decode"] + 1):
        arrivals.append(time.perf_counter())
    span = arrivals[-1] - arrivals[0]
    return {**engine.describe(), "prompt_tokens": length, "ttft_s": arrivals[0] - begin,
            "prefill_tps": length / (arrivals[0] - begin), "generated": len(arrivals) - 1,
            "decode_tps": (len(arrivals) - 1) / span if span > 0 else None, "peak_bytes": engine.peak_bytes(),
            "peak_rss_bytes": peak_rss_bytes()}


def session_turn(job: dict[str, Any]) -> dict[str, Any]:
    """A ChatSession turn whose user message is about ``length`` tokens of the benchmark's report text
    (rendered through the chat template; the session's cache, snapshots and prefix pool as in use)."""
    import mlxchat  # before mlx.core, always: it puts OpenBLAS under MLX (see benchmarks.engines)

    from .engines import Mlxchat, peak_rss_bytes
    from .sessions import document_words
    from .texts import SYSTEM, document

    folder = Path(job["folder"])
    engine = Mlxchat(folder, "mlxchat-session")
    model: mlxchat.GenerativeModel = engine.model
    config = mlxchat.GenerationConfig(max_tokens=job["decode"] + 1, temperature=0.0)
    empty = model.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ""}])
    message = document(document_words(str(folder / "tokenizer.json"), max(1, job["length"] - len(empty))))
    model.generate(model.encode(SYSTEM), config.merged({"max_tokens": 2}))  # warm-up, fresh cache
    session = model.chat_session(system=SYSTEM, default_config=config)
    engine.reset_peak()
    report = session.send(message).report
    return {**engine.describe(), "prompt_tokens": report.prompt_tokens, "ttft_s": report.ttft_s,
            "prefill_tps": report.prompt_tokens / report.ttft_s, "generated": report.generated_tokens - 1,
            "decode_tps": report.decode_tps or None, "peak_bytes": engine.peak_bytes(),
            "peak_rss_bytes": peak_rss_bytes()}


def vision(job: dict[str, Any]) -> dict[str, Any]:
    from .engines import peak_rss_bytes
    from .vision import measure, open_images, picture

    with tempfile.TemporaryDirectory() as scratch:
        image = picture(Path(scratch) / "picture.png")
        start = time.perf_counter()
        images = open_images(job["engine"], Path(job["folder"]), image, blas_path=job.get("blas_path"),
                             dtype=job["dtype"])
        load_s = time.perf_counter() - start
        result = measure(images, job["decode"])
    return {**images.engine.describe(), "load_s": load_s, **result, "peak_rss_bytes": peak_rss_bytes()}


def lora(job: dict[str, Any]) -> dict[str, Any]:
    """One engine's LoRA training run (see :mod:`benchmarks.lora`)."""
    from .lora import train_one

    return train_one(job)


JOBS = {"info": info, "limits": limits, "speed": speed, "sessions": sessions, "batching": batching,
        "constrained": constrained, "speculative": speculative, "vision": vision, "context": context, "lora": lora}


def main() -> None:
    job = json.loads(sys.argv[1])
    try:
        result = JOBS[job["job"]](job)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
