"""How long tracing a large model takes and how much memory it needs (the target: under 60 s, 4 GB).

    python benchmarks/trace_speed.py                       # Llama-3 70B, one 8192-token sequence
    python benchmarks/trace_speed.py --model gpt3-175b --seq-len 2048

Builds the transformers module from the zoo config on the meta device (no
weights), traces one training step on fake tensors and prints wall time and the
process's peak resident memory (getrusage ru_maxrss), plus what the trace found
against the analytical layer graph. Prints, does not assert.
"""
import argparse
import resource
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--seq-len", type=int, help="default: the model's")
    args = p.parse_args()
    t0 = time.perf_counter()
    import torch  # noqa: F401  (counted in the import time below)

    from planner.layers import build_layer_graph
    from planner.model import load_model
    from planner.trace import trace_module
    from planner.trace.zoo import build_hf_module
    t_import = time.perf_counter() - t0
    spec = load_model(args.model, seq_len=args.seq_len)
    t1 = time.perf_counter()
    module, ids = build_hf_module(spec)
    t_build = time.perf_counter() - t1
    t2 = time.perf_counter()
    result = trace_module(module, ids, name=spec.name)
    t_trace = time.perf_counter() - t2
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30     # Linux: KiB
    graph, analytical = result.graph, build_layer_graph(spec)
    flops = graph.model_flops_per_token(spec.seq_len) / analytical.model_flops_per_token(spec.seq_len)
    print(f"model            {spec.name}: {graph.num_params / 1e9:.2f}B parameters "
          f"(analytical {analytical.num_params / 1e9:.2f}B), {spec.num_layers} blocks, 1 x {spec.seq_len} tokens")
    print(f"operators        {len(result.capture.records):,} recorded (forward and backward), "
          f"{len({layer.signature for layer in graph.layers})} distinct layers")
    print(f"model FLOPs      traced / analytical = {flops:.4f}")
    print(f"import torch     {t_import:6.1f} s")
    print(f"build (meta)     {t_build:6.1f} s")
    print(f"trace            {t_trace:6.1f} s")
    print(f"total            {time.perf_counter() - t0:6.1f} s")
    print(f"peak RSS         {peak_gib:6.2f} GiB")


if __name__ == "__main__":
    main()
