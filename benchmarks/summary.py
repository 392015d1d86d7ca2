"""From raw worker results to table rows: medians over repetitions, fractions of the hardware bound, and
mlxchat's ratio to each other engine."""

from __future__ import annotations

import statistics
from typing import Any

from .engines import COMPARISONS
from .limits import bounds


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def speed_row(jobs: list[dict[str, Any]], work: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    """One engine on one model: medians over its repetitions."""
    ok = [j for j in jobs if "error" not in j]
    if not ok:
        return {"failed": jobs[-1]["error"], "raw": jobs}
    lengths = sorted({r["prompt"] for j in ok for r in j["runs"]})
    prefill = {}
    for n in lengths:
        runs = [r for j in ok for r in j["runs"] if r["prompt"] == n]
        prefill[str(n)] = {
            "tps": statistics.median(r["prefill_tps"] for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        }
    decode_runs = [r for j in ok for r in j["runs"] if "decode_tps" in r]
    decode = _median([r["decode_tps"] for r in decode_runs])
    limit = bounds(work, limits, ok[0]["dtype"])
    peaks = [max(r["peak_bytes"] or 0 for r in j["runs"]) for j in ok]
    return {
        "dtype": ok[0]["dtype"],
        "blas": ok[0]["blas"],
        "reps": len(ok),
        "prefill": prefill,
        "decode_tps": decode,
        "decode_tokens": decode_runs[0]["generated"] if decode_runs else None,
        "peak_gb": statistics.median(peaks) / 1e9 if any(peaks) else None,
        "rss_gb": statistics.median(j["peak_rss_bytes"] for j in ok) / 1e9,
        "rank_rss_gb": [statistics.median(r) / 1e9 for r in zip(*(j["rank_peak_rss_bytes"] for j in ok), strict=True)]
        if "rank_peak_rss_bytes" in ok[0] else None,
        "traffic": ok[0].get("traffic"),
        "load_s": statistics.median(j["load_s"] for j in ok),
        "bounds": limit,
        "decode_fraction": decode / limit["decode_bound_tps"] if decode else None,
        "prefill_fraction": {n: p["tps"] / limit["prefill_bound_tps"] for n, p in prefill.items()},
        "errors": [j["error"] for j in jobs if "error" in j],
        "raw": jobs,
    }


def ratios(rows: dict[str, Any], mine: str, other: str) -> dict[str, float | None]:
    """One mlxchat row's throughput over another engine's, per metric (above 1: mlxchat is faster)."""
    ours, theirs = rows.get(mine, {}), rows.get(other, {})
    if "prefill" not in ours or "prefill" not in theirs:
        return {}

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out = {f"prefill_{n}": over(p["tps"], theirs["prefill"].get(n, {}).get("tps")) for n, p in ours["prefill"].items()}
    first = next(iter(ours["prefill"]))
    if first in theirs["prefill"]:
        out["ttft_speedup"] = over(theirs["prefill"][first]["ttft_s"], ours["prefill"][first]["ttft_s"])
    out["decode"] = over(ours.get("decode_tps"), theirs.get("decode_tps"))
    return out


def comparisons(rows: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measured (mlxchat row, engine it is held against) pair of COMPARISONS with its ratios."""
    out = []
    for mine, others in COMPARISONS.items():
        for other in others:
            found = ratios(rows, mine, other)
            if found:
                out.append({"engine": mine, "versus": other, **found})
    return out


def session_rows(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The mlxchat job's columns (session, stateless) beside the mlx-lm job's, turn by turn."""
    notes, columns = [], []
    for engine, result in results.items():
        if "unavailable" in result:
            notes.append(result["unavailable"])
        elif "error" in result:
            notes.append(f"{engine}: {result['error']}")
        else:
            columns.append(result["rows"])
    rows = []
    for parts in zip(*columns, strict=True) if columns else ():
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        rows.append(merged)
    return {"notes": notes, "rows": rows, "raw": results}


def vision_row(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's image row: medians over its repetitions."""
    ok = [j for j in jobs if "error" not in j]
    if not ok:
        return {"failed": jobs[-1]["error"], "raw": jobs}
    first = ok[0]
    return {
        "dtype": first["dtype"],
        "blas": first["blas"],
        "reps": len(ok),
        "image": first["image"],
        "prompt_tokens": first["prompt_tokens"],
        "image_tokens": first["image_tokens"],
        "encode_s": statistics.median(j["encode_s"] for j in ok),
        "ttft_s": statistics.median(j["ttft_s"] for j in ok),
        "prefill_tps": statistics.median(j["prefill_tps"] for j in ok),
        "decode_tps": _median([j["decode_tps"] for j in ok]),
        "decode_tokens": first["generated"],
        "tokens": first["tokens"],
        "peak_gb": statistics.median(j["peak_bytes"] for j in ok) / 1e9,
        "rss_gb": statistics.median(j["peak_rss_bytes"] for j in ok) / 1e9,
        "load_s": statistics.median(j["load_s"] for j in ok),
        "errors": [j["error"] for j in jobs if "error" in j],
        "raw": jobs,
    }


def vision_ratios(rows: dict[str, Any]) -> dict[str, Any] | None:
    """mlxchat over mlx-vlm on one image row (above 1: mlxchat is faster), and how many of mlx-vlm's greedy
    tokens equal mlxchat's (the same weights, prompt and picture should give the same tokens)."""
    ours, theirs = rows.get("mlxchat", {}), rows.get("mlx-vlm", {})
    if "ttft_s" not in ours or "ttft_s" not in theirs:
        return None
    agree = 0
    for mine, other in zip(ours["tokens"], theirs["tokens"], strict=False):
        if mine != other:
            break
        agree += 1
    decode = ours["decode_tps"] / theirs["decode_tps"] if ours["decode_tps"] and theirs["decode_tps"] else None
    return {
        "encode_speedup": theirs["encode_s"] / ours["encode_s"],
        "ttft_speedup": theirs["ttft_s"] / ours["ttft_s"],
        "prefill": ours["prefill_tps"] / theirs["prefill_tps"],
        "decode": decode,
        "same_tokens": agree,
        "of_tokens": len(theirs["tokens"]),
    }
