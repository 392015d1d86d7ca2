"""Where a decode step's time goes beyond reading the weights: ``python -m benchmarks.anatomy [--model NAME]``.

On random weights of a named config (``mlxchat.build_model``, nothing on disk; default Qwen3-0.6B shapes) or
a checkpoint folder (``--model DIR``), after a 128-token prompt, it times in one process, alternating, each a
median of ``--reps``:

- ``step``: one decode step (the model's forward for one token, its logits evaluated);
- ``separate``: the same step with the joined projections (:mod:`mlxchat.layers.fused`) run one by one, as
  before they were joined;
- ``matmuls``: the step's matrix products alone: the same weights (joined ones whole) times a random row,
  one graph;
- ``bandwidth``: one matrix-vector product over as many bytes as the step's weights (the bound);
- ``ops``: how many operations the step's graph holds besides the products, and ``per_op``, the time of a
  graph of as many small elementwise operations on a hidden-size row (what MLX spends per operation).

The differences say what the rest is: ``matmuls - bandwidth`` is what the products lose to the bound
(calls too small to stream at full speed), ``step - matmuls`` the other operations. The profiler
(``MLXCHAT_PROFILE``) says how a step splits between building the graph, evaluating it and sampling;
this says what the evaluation is made of. Timings on a shared machine move with its load: compare rows
of one run only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def graph_ops(outputs: Any) -> tuple[int, int]:
    """(operations, matrix products) in the graph of ``outputs``, counted from MLX's DOT export."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), outputs)
        names = [line.split('label ="')[1].split('"')[0] for line in path.read_text().splitlines()
                 if 'label ="' in line]
    return len(names), sum(1 for name in names
                           if name.startswith(("Matmul", "Quantized", "Gather")) or name.endswith("QuantizedMatmul"))


def weight_products(module: Any, joins: list[Any]) -> list[tuple[Any, int, int]]:
    """Each weight product a decode step runs, as (a function of one input row, its input width, the bytes it
    reads): the joined projections whole, every other linear layer, and the output head (a tied embedding's
    ``as_linear``); quantized ones through mlxchat's kernels, counting their scales and biases."""
    import mlx.nn as nn

    from mlxchat.quantized import quantized_matmul

    def packed(params: dict[str, Any], quantization: tuple[int, int, str]) -> tuple[Any, int, int]:
        group_size, bits, mode = quantization
        arrays = [params[k] for k in ("weight", "scales", "biases") if params.get(k) is not None]
        return ((lambda x: quantized_matmul(x, params["weight"], params["scales"], params.get("biases"), group_size,
                                            bits, mode)),
                params["weight"].shape[1] * 32 // bits, sum(a.nbytes for a in arrays))

    def plain(weight: Any) -> tuple[Any, int, int]:
        return (lambda x: x @ weight.T), weight.shape[1], weight.nbytes

    joined = {id(layer) for _, join in joins for layer in join.layers}
    out = [packed(join.joined, join.quantization) if join.quantization else plain(join.joined["weight"])
           for _, join in joins]
    tied = getattr(module.config, "tie_word_embeddings", False)
    for _, layer in module.named_modules():
        if id(layer) in joined or "weight" not in layer or layer["weight"].ndim != 2:
            continue
        embedding = isinstance(layer, nn.Embedding | nn.QuantizedEmbedding)
        if embedding and not tied:  # looked up, not multiplied
            continue
        if "scales" in layer:
            out.append(packed(layer, (layer.group_size, layer.bits, layer.mode)))
        elif isinstance(layer, nn.Linear | nn.Embedding):
            out.append(plain(layer["weight"]))
    return out


def measure(name: str, reps: int, prompt: int) -> dict[str, Any]:
    import mlxchat  # first: it puts OpenBLAS under MLX  # noqa: I001
    import mlx.core as mx

    from mlxchat.layers import Projections

    model = mlxchat.load_model(name) if Path(name).is_dir() else mlxchat.build_model(name)

    def run() -> dict[str, Any]:
        module = model.module
        groups = [v for _, child in module.named_modules() for v in vars(child).values() if isinstance(v, Projections)]
        joins = [(group, group.joined) for group in groups if group.joined is not None]
        matrices = weight_products(module, joins)
        step_bytes = sum(nbytes for _, _, nbytes in matrices)
        rows = {width: mx.random.normal((1, width)) for _, width, _ in matrices}
        big = mx.random.normal((max(1, step_bytes // 4 // 4096), 4096))
        probe = mx.random.normal((1, 4096))
        mx.eval(big, probe, *rows.values())
        cache = model.make_prompt_cache()
        cache.prefill(module, list(range(300, 300 + prompt)), step=512)
        token = mx.array([[7]])
        # each step is undone: KV caches cut back, state caches (a hybrid's) restored from a snapshot, which makes
        # their step copy the state where it would rewrite it in place
        saved = [(layer, layer.snapshot()) for layer in cache.layers if not layer.trimmable]

        def rewind() -> None:
            for layer in cache.layers:
                if layer.trimmable:
                    layer.trim_to(len(cache))
            for layer, snapshot in saved:
                layer.restore(snapshot)

        graph = module.last_logits(token, cache.layers)
        ops, products = graph_ops(graph)
        rewind()
        hidden = mx.random.normal((1, 1, model.config.hidden_size))
        mx.eval(hidden)

        def elementwise() -> mx.array:
            x = hidden
            for _ in range(ops - products):
                x = x * 1.0001 + 0.5
            return x

        def step() -> float:
            start = time.perf_counter()
            mx.eval(module.last_logits(token, cache.layers))
            took = time.perf_counter() - start
            rewind()
            return took

        times: dict[str, list[float]] = {"step": [], "separate": [], "matmuls": [], "bandwidth": [], "per_op": []}
        def separate() -> float:
            for group, _ in joins:
                group.joined = None
            try:
                return step()
            finally:
                for group, join in joins:
                    group.joined = join

        for rep in range(reps):
            for key, run_step in [("step", step), ("separate", separate)][:: 1 if rep % 2 else -1]:
                times[key].append(run_step())
            start = time.perf_counter()
            mx.eval([product(rows[width]) for product, width, _ in matrices])
            times["matmuls"].append(time.perf_counter() - start)
            start = time.perf_counter()
            mx.eval(probe @ big.T)
            times["bandwidth"].append(time.perf_counter() - start)
            start = time.perf_counter()
            mx.eval(elementwise())
            times["per_op"].append((time.perf_counter() - start) / (2 * max(ops - products, 1)))
        medians = {k: statistics.median(v) for k, v in times.items()}
        return {"model": name, "step_bytes": step_bytes, "ops": ops,
                "products": products, "joined": len(joins), "seconds": medians,
                "bandwidth_gbs": big.nbytes / medians["bandwidth"] / 1e9,
                "matmul_gbs": step_bytes / medians["matmuls"] / 1e9}

    try:
        return model.worker.run(run)
    finally:
        model.close()


def describe(r: dict[str, Any]) -> str:
    s = r["seconds"]
    bound = r["step_bytes"] / (r["bandwidth_gbs"] * 1e9)
    others = r["ops"] - r["products"]
    return "\n".join([
        f"{r['model']}: a decode step reads {r['step_bytes'] / 1e9:.2f} GB of weights in {r['products']} products; "
        f"its graph has {others} other operations",
        f"  step              {s['step'] * 1e3:8.1f} ms",
        f"  step, separate    {s['separate'] * 1e3:8.1f} ms  ({r['joined']} joined projections run one by one: "
        f"{s['step'] / s['separate']:.2f}x the time)",
        f"  products alone    {s['matmuls'] * 1e3:8.1f} ms  ({r['matmul_gbs']:.1f} GB/s)",
        f"  bandwidth bound   {bound * 1e3:8.1f} ms  ({r['bandwidth_gbs']:.1f} GB/s, one large product)",
        f"  other operations  {(s['step'] - s['matmuls']) * 1e3:8.1f} ms  (an elementwise op costs "
        f"{s['per_op'] * 1e6:.1f} us here: {others} x that = {others * s['per_op'] * 1e3:.1f} ms)",
        f"  decode at {bound / s['step']:.0%} of the bound; the products lose {(s['matmuls'] - bound) * 1e3:.1f} ms "
        f"to it, the other operations take {(s['step'] - s['matmuls']) * 1e3:.1f} ms",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.anatomy", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b",
                        help="a name from mlxchat.configs (default qwen3-0.6b) or a checkpoint folder")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--prompt", type=int, default=128, help="tokens in the cache before the step")
    args = parser.parse_args()
    print(describe(measure(args.model, args.reps, args.prompt)))


if __name__ == "__main__":
    main()
