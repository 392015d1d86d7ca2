"""The long-context curves as a table per model, issue 27's goals beside the arithmetic, and the chart.

    python -m benchmarks.context_report benchmarks/results/context.json   # the .md and .png again
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from .context import ENGINES, SESSION, Shape, decode_bound, kv_format, measured, replace_file
from .engines import LABELS

METRICS = (("prefill_tps", "prefill tok/s"), ("decode_tps", "decode tok/s"))
GOAL_DEPTH = 16384
"""Issue 27: decode and prefill of a 16k prompt >= llama.cpp F32's."""


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _gb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e9:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if not a or not b else f"{a / b:.2f}×"


def _label(engine: str) -> str:
    return LABELS.get(engine, engine)


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["context"], ENGINES.index(r["engine"]) if r["engine"] in ENGINES else 99))


def header(results: dict[str, Any]) -> list[str]:
    machine, runtime, limits = results["machine"], results["runtime"], results["limits"]
    bandwidth = (f"Memory read bandwidth {limits['bandwidth_gbs']:.1f} GB/s ({limits['method']})." if "bandwidth_gbs"
                 in limits else f"Memory bandwidth not measured ({limits.get('error')}): no bounds.")
    resumed = f"; resumed, earlier rows from {', '.join(results['resumed'])}" if results.get("resumed") else ""
    return [
        f"# Speed and memory against context length, {results['date']}",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']:.1f} GiB RAM; MLX "
        f"{runtime['mlx']} on {runtime['device']}; mlxchat {runtime['mlxchat']}; mlx-lm {machine['mlx_lm']}. "
        f"{bandwidth}",
        f"- Each row in its own process: a prompt of that many random token ids (the session turn: a user "
        f"message of the benchmark's report text about that long, through the chat template), then "
        f"{results['decode']} greedy tokens at that depth. Prefill tok/s = prompt / time to first token.",
        "- *bound*: the decode tokens/s of a step that reads the weights and the whole KV cache once at the "
        "measured bandwidth (nothing else): the ceiling a KV format leaves. *est. peak*: the harness's estimate "
        "before it started the row (weights as loaded + KV + prefill's attention scratch + runtime).",
        f"- Command: `{results['command']}` ({results.get('duration_s', 0) / 60:.0f} min{resumed}).",
        *engine_notes(results),
        "",
    ]


def engine_notes(results: dict[str, Any]) -> list[str]:
    """What each engine ran on, as its rows report it (every distinct setting: a row whose BLAS differs
    from its engine's others shows here)."""
    notes: dict[str, list[str]] = {}
    for model in results["models"].values():
        for row in ordered([r for r in model["rows"] if measured(r)]):
            note = f"{row.get('dtype')} weights, {row.get('blas')}" + (f" ({row['blas_note']})" if row.get("blas_note")
                                                                       else "")
            if note not in notes.setdefault(row["engine"], []):
                notes[row["engine"]].append(note)
    return [f"- {_label(engine)}: {'; '.join(texts)}." for engine, texts in notes.items()]


def shape_line(shape: Shape, dtype: str, lengths: list[int]) -> str:
    longest = max(lengths)
    formats = []
    for engine in ("mlxchat", "llama.cpp-f32", "mlxchat-kv16", "mlxchat-kv8", "llama.cpp-f32-kv8", "mlxchat-kv4"):
        name = kv_format(engine, dtype)[0]
        formats.append(f"{name}: {shape.kv_bytes(engine, dtype, 1) / 1e3:.1f} KB a token, "
                       f"{shape.kv_bytes(engine, dtype, longest) / 1e9:.2f} GB at {longest}")
    weights = shape.weight_bytes("mlxchat", dtype)
    return (f"KV cache of {shape.attention_layers} growing layers x {shape.kv_heads} KV heads x {shape.head_dim}: "
            f"{'; '.join(formats)}. A decode step reads {weights / 1e9:.2f} GB of {dtype} weights.")


def table(model: dict[str, Any], results: dict[str, Any]) -> list[str]:
    shape, dtype = Shape(**model["shape"]), results["runtime"]["compute_dtype"] or "bfloat16"
    bandwidth = results["limits"].get("bandwidth_gbs")
    lines = ["| engine | KV cache | context | prefill tok/s | TTFT s | decode tok/s | bound tok/s | of bound | "
             "peak MLX GB | peak RSS GB | est. peak GB | row s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in ordered(model["rows"]):
        engine, length = row["engine"], row["context"]
        bound = decode_bound(shape, engine, dtype, length, bandwidth)
        first = f"| {_label(engine)} | {kv_format(engine, dtype)[0]} | {length} |"
        if not measured(row):
            why = row.get("skipped") or row.get("error", "?")
            lines.append(f"{first} {why} | | | {_num(bound, 2)} | | | | {_gb(row.get('estimated_peak_bytes'))} "
                         f"| {_num(row.get('duration_s'), 0)} |")
            continue
        decode = row.get("decode_tps")
        share = "—" if decode is None else f"{100 * decode / bound:.0f}%"
        lines.append(f"{first} {_num(row['prefill_tps'])} | {_num(row['ttft_s'], 2)} | {_num(decode, 2)} | "
                     f"{_num(bound, 2)} | {share} | {_gb(row.get('peak_bytes'))} | {_gb(row.get('peak_rss_bytes'))} | "
                     f"{_gb(row.get('estimated_peak_bytes'))} | {_num(row.get('duration_s'), 0)} |")
    return lines


def goals(model: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """Issue 27's goals, as far as this model's rows reach."""
    rows = {(r["engine"], r["context"]): r for r in model["rows"] if measured(r)}
    shape, dtype = Shape(**model["shape"]), results["runtime"]["compute_dtype"] or "bfloat16"
    bandwidth = results["limits"].get("bandwidth_gbs")
    lengths = sorted({length for _, length in rows})

    def value(engine: str, length: int, metric: str) -> float | None:
        row = rows.get((engine, length))
        return None if row is None else row.get(metric)

    def ratio(metric: str, engine: str, other: str, length: int) -> str:
        return _ratio(value(engine, length, metric), value(other, length, metric))

    lines = ["Against llama.cpp F32 (goals: decode >= 1.00x at every depth; at 16384 also prefill >= 1.00x):", "",
             "| context | decode: mlxchat ÷ llama.cpp F32 | prefill: mlxchat ÷ llama.cpp F32 | decode: mlxchat "
             "float16 KV ÷ llama.cpp F32 (F16 KV) | decode: mlxchat 8-bit KV ÷ llama.cpp q8_0 KV | decode: mlxchat "
             "8-bit KV ÷ mlxchat |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in lengths:
        mark = " (goal depth)" if n == GOAL_DEPTH else ""
        lines.append(f"| {n}{mark} | {ratio('decode_tps', 'mlxchat', 'llama.cpp-f32', n)} | "
                     f"{ratio('prefill_tps', 'mlxchat', 'llama.cpp-f32', n)} | "
                     f"{ratio('decode_tps', 'mlxchat-kv16', 'llama.cpp-f32', n)} | "
                     f"{ratio('decode_tps', 'mlxchat-kv8', 'llama.cpp-f32-kv8', n)} | "
                     f"{ratio('decode_tps', 'mlxchat-kv8', 'mlxchat', n)} |")
    if len(lengths) >= 2:
        short, long = lengths[0], lengths[-1]
        lines += ["", f"Decode at {short} over decode at {long} tokens (goal, at 1024 and 32768 on Qwen3-0.6B shapes: "
                  "at most 2.00x), beside the same ratio for a step bound by bandwidth (weights + KV read once):", "",
                  "| engine | KV cache | measured slow-down | bandwidth-bound slow-down |",
                  "| --- | --- | ---: | ---: |"]
        for engine in ENGINES:
            slow = _ratio(value(engine, short, "decode_tps"), value(engine, long, "decode_tps"))
            if slow == "—":
                continue
            bound = _ratio(decode_bound(shape, engine, dtype, short, bandwidth),
                           decode_bound(shape, engine, dtype, long, bandwidth))
            lines.append(f"| {_label(engine)} | {kv_format(engine, dtype)[0]} | {slow} | {bound} |")
        longest = ("mlxchat-kv8", long), ("mlxchat", long)
        if all(key in rows for key in longest):
            kv8, flt = (rows[key] for key in longest)
            lines += ["", f"8-bit KV at {long} tokens (goals at 32768: peak memory <= 0.60x float KV, decode >= "
                      f"1.00x): peak RSS {_ratio(kv8.get('peak_rss_bytes'), flt.get('peak_rss_bytes'))}, peak MLX "
                      f"{_ratio(kv8.get('peak_bytes'), flt.get('peak_bytes'))}, decode "
                      f"{_ratio(kv8.get('decode_tps'), flt.get('decode_tps'))}."]
    turns = [r for r in ordered(model["rows"]) if r["engine"] == SESSION]
    for turn in turns:
        if measured(turn):
            lines += ["", f"Session turn (goal on Qwen3.5-0.8B shapes: a 32k-token turn runs): a turn of "
                      f"{turn['prompt_tokens']} prompt tokens ran, peak RSS {_gb(turn.get('peak_rss_bytes'))} GB, "
                      f"decode {_num(turn.get('decode_tps'), 2)} tok/s."]
        else:
            lines += ["", f"Session turn at {turn['context']} tokens: did not run "
                      f"({turn.get('skipped') or turn.get('error')})."]
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = header(results)
    dtype = results["runtime"]["compute_dtype"] or "bfloat16"
    for title, model in results["models"].items():
        shape = Shape(**model["shape"])
        lines += [f"## {title}", "", shape_line(shape, dtype, results["lengths"]), "", *table(model, results), "",
                  *goals(model, results), ""]
    lines += [f"- not measured: {reason}" for reason in results["not_measured"]]
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> None:
    """Tokens/s against context length, one line per engine: prefill and decode for each model; decode's
    dotted lines are each engine's bandwidth bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = list(results["models"].items())
    if not models:
        return
    dtype, bandwidth = results["runtime"]["compute_dtype"] or "bfloat16", results["limits"].get("bandwidth_gbs")
    colours = {engine: f"C{index}" for index, engine in enumerate(ENGINES)}
    figure, axes = plt.subplots(len(models), len(METRICS), figsize=(12, 4.5 * len(models)), squeeze=False)
    for row_axes, (title, model) in zip(axes, models, strict=True):
        rows, shape = [r for r in model["rows"] if measured(r)], Shape(**model["shape"])
        lengths = sorted({r["context"] for r in model["rows"]})
        for axis, (metric, label) in zip(row_axes, METRICS, strict=True):
            for engine in (e for e in ENGINES if any(r["engine"] == e for r in rows)):
                points = sorted((r["context"], r[metric]) for r in rows if r["engine"] == engine and r.get(metric))
                if points:
                    axis.plot(*zip(*points, strict=True), marker="o", color=colours[engine], label=_label(engine))
                if metric == "decode_tps" and engine != SESSION:
                    bound = [decode_bound(shape, engine, dtype, n, bandwidth) for n in lengths]
                    if None not in bound:
                        axis.plot(lengths, bound, linestyle=":", linewidth=1, color=colours[engine])
            note = " (dotted: bandwidth bound)" if metric == "decode_tps" else ""
            axis.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel=label,
                     title=f"{title}: {label}{note}")
            axis.set_xticks(lengths, [str(n) for n in lengths])
            axis.minorticks_off()
            axis.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            axis.grid(True, alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize=8)
    figure.tight_layout()
    partial = path.with_suffix(".tmp.png")
    figure.savefig(partial, dpi=110)
    plt.close(figure)
    partial.replace(path)


def write(results: dict[str, Any], out: Path) -> None:
    """``out``.md, and ``out``.png where matplotlib is installed."""
    replace_file(out.with_suffix(".md"), markdown(results) + "\n")
    if importlib.util.find_spec("matplotlib") is not None:
        chart(results, out.with_suffix(".png"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    source = Path(sys.argv[1])
    write(json.loads(source.read_text()), source.with_suffix(""))
