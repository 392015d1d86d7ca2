"""Turns the driver's results into the markdown tables it prints and writes (the README's table)."""

from __future__ import annotations

from typing import Any

from .engines import LABELS


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _gb(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def header(results: dict[str, Any]) -> list[str]:
    machine, runtime, limits = results["machine"], results["runtime"], results["limits"]
    settings = results["settings"]
    lines = [
        f"## mlxchat benchmarks, {results['date']}",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']:.1f} GiB RAM, "
        f"{machine['os']}; MLX {runtime.get('mlx')} on {runtime.get('device')}; "
        f"mlxchat {runtime.get('mlxchat')}; mlx-lm {machine.get('mlx_lm')}.",
        f"- Limits (measured this run): memory read {limits['bandwidth_gbs']:.1f} GB/s, float32 GEMM "
        f"{limits['gemm_gflops']:.0f} GFLOP/s ({limits['method']}).",
    ]
    for engine, text in results["engine_notes"].items():
        lines.append(f"- {LABELS[engine]}: {text}.")
    lines.append(
        f"- Medians of up to {settings['reps']} runs per row, each run in its own process, engines "
        f"alternating; random prompt ids; greedy decoding. Command: `{results['command']}` "
        f"({results['duration_s'] / 60:.1f} min)."
    )
    return lines


def speed_table(model: dict[str, Any], prefill: list[int], decode: int) -> list[str]:
    work = model["work"]
    lines = [
        f"### {model['title']}",
        "",
        f"{work['total_params'] / 1e9:.2f} B parameters; a decode step reads "
        f"{work['decode_params'] / 1e9:.2f} B, a prompt token multiplies {work['prefill_params'] / 1e9:.2f} B"
        + (f" ({work['top_k']} of {work['experts']} experts active)" if work["experts"] else "")
        + ".",
        "",
    ]
    lengths = [str(n) for n in prefill]
    middle = lengths[len(lengths) // 2] if lengths else None
    head = (
        ["engine", "dtype"]
        + [f"prefill {n} tok/s" for n in lengths]
        + [
            f"TTFT {lengths[0]} (s)",
            f"decode tok/s ({decode})",
            "decode / BW bound",
            f"prefill {middle} / GEMM bound",
            "MLX peak GB",
            "RSS peak GB",
            "runs",
        ]
    )
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in model["engines"].items():
        if "skipped" in row or "failed" in row:
            why = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['failed']}"
            lines.append(f"| {LABELS[name]} | {why} |" + " |" * (len(head) - 2))
            continue
        cells = [LABELS[name], row["dtype"]]
        cells += [_num(row["prefill"].get(n, {}).get("tps")) for n in lengths]
        cells.append(_num(row["prefill"].get(lengths[0], {}).get("ttft_s")))
        decode_cell = _num(row.get("decode_tps"))
        if row.get("decode_tokens") and row["decode_tokens"] != decode:
            decode_cell += f" ({row['decode_tokens']} tok)"
        cells += [
            decode_cell,
            _pct(row.get("decode_fraction")),
            _pct(row.get("prefill_fraction", {}).get(middle)),
            _gb(row.get("peak_gb")),
            _gb(row.get("rss_gb")),
            str(row["reps"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for other, ratios in model.get("ratios", {}).items():
        cells = [f"**mlxchat ÷ {LABELS[other]}**", ""]
        cells += [_ratio(ratios.get(f"prefill_{n}")) for n in lengths]
        cells += [_ratio(ratios.get("ttft_speedup")), _ratio(ratios.get("decode")), "", "", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


_WAYS = (
    ("session", "ChatSession"),
    ("stateless", "stateless re-render"),
    ("mlx-lm cache", "mlx-lm prompt cache"),
)


def sessions_table(model: dict[str, Any]) -> list[str]:
    sessions = model.get("sessions")
    if not sessions:
        return []
    lines = [f"#### Sessions: {model['title']}", ""]
    for note in sessions.get("notes", []):
        lines += [f"- {note}"]
    rows = sessions.get("rows", [])
    if not rows:
        return lines + [""]
    head = ["scenario", "turn", "prompt tokens"]
    for _, label in _WAYS:
        head += [f"{label}: prefilled", f"{label}: TTFT s"]
    lines += ["" if sessions.get("notes") else "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals = {way: [0, 0.0] for way, _ in _WAYS}
    for index, row in enumerate(rows, 1):
        prompt = next((row[w]["prompt_tokens"] for w, _ in _WAYS if "prompt_tokens" in row.get(w, {})), None)
        cells = [row["scenario"], f"{index} {row['op']}", str(prompt) if prompt is not None else "—"]
        for way, _ in _WAYS:
            entry = row.get(way)
            if entry is None:
                cells += ["—", "—"]
            elif "error" in entry:
                cells += [entry["error"], ""]
            else:
                cells += [str(entry["prefilled"]), f"{entry['ttft_s']:.2f}"]
                totals[way][0] += entry["prefilled"]
                totals[way][1] += entry["ttft_s"]
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["**total**", "", ""]
    for way, _ in _WAYS:
        cells += [str(totals[way][0]), f"{totals[way][1]:.1f}"]
    lines += ["| " + " | ".join(cells) + " |", ""]
    return lines


def markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = header(results) + [""]
    for model in results["models"].values():
        lines += speed_table(model, settings["prefill"], settings["decode"])
        lines += sessions_table(model)
    if results["skipped"]:
        lines += ["Not measured:", ""] + [f"- {item}" for item in results["skipped"]] + [""]
    return "\n".join(lines)
