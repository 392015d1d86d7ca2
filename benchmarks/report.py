"""The markdown the driver prints and writes to results/latest.md (the README's table)."""

from __future__ import annotations

from typing import Any

from .batching import table as batching_table
from .constrained import table as constrained_table
from .engines import LABELS
from .speculative import table as speculative_table


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _gb(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def header(results: dict[str, Any]) -> list[str]:
    machine, runtime, limits = results["machine"], results["runtime"], results["limits"]
    lines = [
        f"## mlxchat benchmarks, {results['date']}",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']:.1f} GiB RAM, "
        f"{machine['os']}; MLX {runtime['mlx']} on {runtime['device']}; mlxchat {runtime['mlxchat']}; "
        f"mlx-lm {machine['mlx_lm']}.",
        f"- Limits (measured in this run): memory read {limits['bandwidth_gbs']:.1f} GB/s, float32 GEMM "
        f"{limits['gemm_gflops']:.0f} GFLOP/s"
        + (f", bfloat16 GEMM {limits['gemm_gflops_bfloat16']:.0f} GFLOP/s" if "gemm_gflops_bfloat16" in limits else "")
        + f" ({limits['method']}). Decode is compared with bandwidth / "
        f"weight bytes a token reads, prefill with GEMM FLOP/s / (2 × parameters a prompt token multiplies).",
    ]
    lines += [f"- {LABELS[engine]}: {text}." for engine, text in results["engine_notes"].items()]
    lines.append(
        f"- Medians of up to {results['settings']['reps']} runs per row, each run in its own process, "
        f"engines alternating; random-weight checkpoints with released shapes; random prompt ids; greedy "
        f"decoding. Command: `{results['command']}` ({results['duration_s'] / 60:.1f} min)."
    )
    return lines


def speed_table(model: dict[str, Any], prefill: list[int], decode: int) -> list[str]:
    work = model["work"]
    experts = f" ({work['top_k']} of {work['experts']} experts active)" if work["experts"] else ""
    lines = [
        f"### {model['title']}",
        "",
        f"{work['total_params'] / 1e9:.2f} B parameters; a decode step reads "
        f"{work['decode_params'] / 1e9:.2f} B, a prompt token multiplies {work['prefill_params'] / 1e9:.2f} B"
        f"{experts}.",
        "",
    ]
    if not model["engines"]:
        return lines + ["No row measured (see the list below the tables).", ""]
    lengths = [str(n) for n in prefill]
    middle = lengths[len(lengths) // 2]
    head = [
        "engine",
        "dtype",
        *(f"prefill {n} tok/s" for n in lengths),
        f"TTFT {lengths[0]} (s)",
        f"decode tok/s ({decode})",
        "decode / BW bound",
        f"prefill {middle} / GEMM bound",
        "MLX peak GB",
        "RSS peak GB",
        "runs",
    ]
    lines += [_row(head), "|" + "---|" * len(head)]
    for name, row in model["engines"].items():
        if "failed" in row:
            lines.append(_row([LABELS[name], f"failed: {row['failed']}"] + [""] * (len(head) - 2)))
            continue
        decode_cell = _num(row["decode_tps"])
        if row["decode_tokens"] and row["decode_tokens"] != decode:
            decode_cell += f" ({row['decode_tokens']} tok)"
        cells = [
            LABELS[name],
            row["dtype"],
            *(_num(row["prefill"].get(n, {}).get("tps")) for n in lengths),
            _num(row["prefill"].get(lengths[0], {}).get("ttft_s")),
            decode_cell,
            _pct(row["decode_fraction"]),
            _pct(row["prefill_fraction"].get(middle)),
            _gb(row["peak_gb"]),
            " / ".join(_gb(r) for r in row["rank_rss_gb"]) if row.get("rank_rss_gb") else _gb(row["rss_gb"]),
            str(row["reps"]),
        ]
        lines.append(_row(cells))
    for ratios in model["ratios"]:
        cells = [
            f"**{LABELS[ratios['engine']]} ÷ {LABELS[ratios['versus']]}**",
            "",
            *(_ratio(ratios.get(f"prefill_{n}")) for n in lengths),
            _ratio(ratios.get("ttft_speedup")),
            _ratio(ratios.get("decode")),
        ]
        lines.append(_row(cells + [""] * (len(head) - len(cells))))
    lines += [""] + [traffic_note(LABELS[name], row) for name, row in model["engines"].items() if row.get("traffic")]
    return lines + [""]


def traffic_note(label: str, row: dict[str, Any]) -> str:
    """What a decode step of a split model hands to the collectives (rows of split models show each rank's
    RSS, rank 0 first)."""
    traffic = row["traffic"]
    parts = [f"{traffic[f'{kind}_calls']:.0f} {kind} of {traffic[f'{kind}_bytes'] / 1024:.1f} KiB"
             for kind in ("all_sum", "all_gather", "send") if traffic.get(f"{kind}_calls")]
    return f"- {label}, per decode step and rank: {', '.join(parts)} (payload bytes; RSS per rank in the table)."


_WAYS = (
    ("session", "ChatSession"),
    ("stateless", "stateless re-render"),
    ("mlx-lm cache", "mlx-lm prompt cache"),
)


def sessions_table(model: dict[str, Any]) -> list[str]:
    """Per turn: what each way prefilled (of the prompt) and its time to first token."""
    sessions = model["sessions"]
    if not sessions:
        return []
    lines = [f"#### Sessions: {model['title']}"]
    if sessions["notes"]:
        lines += [""] + [f"- {note}" for note in sessions["notes"]]
    if not sessions["rows"]:
        return lines + [""]
    head = ["scenario", "turn", "prompt tokens"]
    for _, label in _WAYS:
        head += [f"{label}: prefilled", f"{label}: TTFT s"]
    head.append("session reply = stateless")
    lines += ["", _row(head), "|" + "---|" * len(head)]
    totals = {way: [0, 0.0] for way, _ in _WAYS}
    for index, row in enumerate(sessions["rows"], 1):
        prompts = [row[w]["prompt_tokens"] for w, _ in _WAYS if "prompt_tokens" in row.get(w, {})]
        cells = [row["scenario"], f"{index} {row['op']}", str(prompts[0]) if prompts else "—"]
        for way, _ in _WAYS:
            entry = row.get(way)
            if entry is None or "error" in entry:
                cells += [entry["error"] if entry else "—", ""]
                continue
            own = "" if entry["prompt_tokens"] == prompts[0] else f" of {entry['prompt_tokens']}"
            cells += [f"{entry['prefilled']}{own}", f"{entry['ttft_s']:.2f}"]
            totals[way][0] += entry["prefilled"]
            totals[way][1] += entry["ttft_s"]
        cells.append({True: "yes", False: "no"}.get(row.get("same_reply"), "—"))
        lines.append(_row(cells))
    cells = ["**total**", "", ""]
    for way, _ in _WAYS:
        cells += [str(totals[way][0]), f"{totals[way][1]:.1f}"]
    return lines + [_row(cells + [""]), ""]


def vision_table(model: dict[str, Any], decode: int) -> list[str]:
    """One vision-language checkpoint: the picture's tower time, the whole prompt's prefill, decode."""
    rows = model["engines"]
    sizes = {row["image"] for row in rows.values() if "image" in row}
    lines = [f"### Image: {model['title']}" + (f", a {sizes.pop()} picture" if len(sizes) == 1 else ""), ""]
    if not rows:
        return lines + ["No row measured (see the list below the tables).", ""]
    head = [
        "engine",
        "dtype",
        "prompt tokens (image)",
        "vision encode (s)",
        "TTFT (s)",
        "prefill tok/s",
        f"decode tok/s ({decode})",
        "greedy tokens = mlxchat's",
        "MLX peak GB",
        "RSS peak GB",
        "runs",
    ]
    lines += [_row(head), "|" + "---|" * len(head)]
    ratios = model["ratios"]
    for name, row in rows.items():
        if "failed" in row:
            lines.append(_row([LABELS[name], f"failed: {row['failed']}"] + [""] * (len(head) - 2)))
            continue
        decode_cell = _num(row["decode_tps"])
        if row["decode_tokens"] != decode:
            decode_cell += f" ({row['decode_tokens']} tok)"
        same = "—"
        if name != "mlxchat" and ratios:
            same = f"{ratios['same_tokens']} of {ratios['of_tokens']}"
        cells = [
            LABELS[name],
            row["dtype"],
            f"{row['prompt_tokens']} ({row['image_tokens']})",
            _num(row["encode_s"]),
            _num(row["ttft_s"]),
            _num(row["prefill_tps"]),
            decode_cell,
            same,
            _gb(row["peak_gb"]),
            _gb(row["rss_gb"]),
            str(row["reps"]),
        ]
        lines.append(_row(cells))
    if ratios:
        cells = [
            f"**{LABELS['mlxchat']} ÷ {LABELS['mlx-vlm']}**",
            "",
            "",
            _ratio(ratios["encode_speedup"]),
            _ratio(ratios["ttft_speedup"]),
            _ratio(ratios["prefill"]),
            _ratio(ratios["decode"]),
        ]
        lines.append(_row(cells + [""] * (len(head) - len(cells))))
    return lines + [""]


def markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = header(results) + [""]
    for model in results["models"].values():
        lines += speed_table(model, settings["prefill"], settings["decode"])
        lines += sessions_table(model)
    lines += batching_table({f"{model['title']}{label}": model[field] for model in results["models"].values()
                             for field, label in (("batching", ""), ("batching_4bit", " 4-bit"),
                                                  ("batching_4bit_x8", " 4-bit, 8-bit x")) if model.get(field)})
    lines += constrained_table({model["title"]: model["constrained"] for model in results["models"].values()
                                if model.get("constrained")})
    lines += speculative_table(results.get("speculative") or {})
    vision = results.get("vision") or {}
    if vision:
        lines += [
            "Image rows: one picture (a PNG file) and a one-sentence question, greedy. Vision encode: the tower "
            "and its projection alone on the preprocessed picture; TTFT: from the chat message and the file to "
            "the first token (rendering, preprocessing, the tower, the prefill); prefill tok/s: the whole "
            "prompt's tokens over TTFT.",
            "",
        ]
    for model in vision.values():
        lines += vision_table(model, settings["decode"])
    if results["not_measured"]:
        lines += ["Not measured:", ""] + [f"- {item}" for item in results["not_measured"]] + [""]
    return "\n".join(lines)
