"""Elementwise bytes per token of the executor's reference models, as torch runs them eagerly.

Written by `python -m executor.eager_counts --write` (which says how they are counted); checked
by tests/test_eager_counts.py. Do not edit by hand. Per bandwidth class (executor.eager_counts.
kernel_class), block coefficients multiply (h, q, kv, f, 1), head and embedding coefficients
(h, vocab, 1); kernels (elementwise) and ops (every dispatched operator, views and GEMMs included)
are per micro-batch.
"""

TABLE = {
    "layernorm-gelu-bias-learned": {
        "autocast": {
            "block_bwd": {"cast_down": [12.0, 0.0, 0.0, 0.0, 0.0], "cast_up": [24.0, 0.0, 0.0, 0.0, 0.0], "norm": [64.0, 0.0, 0.0, 0.0, 16.0], "reduce": [4.0, 2.0, 4.0, 2.0, 0.0], "stream": [24.0, 0.0, 0.0, 6.0, 0.0]},
            "block_fwd": {"cast_down": [24.0, 0.0, 0.0, 0.0, 0.0], "norm": [16.0, 0.0, 0.0, 0.0, 16.0], "stream": [20.0, 0.0, 0.0, 4.0, 0.0], "strided": [0.0, 8.0, 0.0, 0.0, 0.0]},
            "embed_bwd": {"reduce": [4.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"stream": [8.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "cast_up": [6.0, 0.0, 0.0], "norm": [20.0, 0.016, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_down": [6.0, 0.0, 0.0], "cast_up": [0.0, 6.0, 0.012], "norm": [8.0, 0.016, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 31, "block_fwd": 23, "embed_bwd": 3, "embed_fwd": 4, "head_bwd": 6, "head_fwd": 7},
            "ops": {"block_bwd": 134, "block_fwd": 59, "embed_bwd": 6, "embed_fwd": 5, "head_bwd": 26, "head_fwd": 15},
        },
        "bf16": {
            "block_bwd": {"norm": [32.0, 0.0, 0.0, 0.0, 8.0], "reduce": [4.0, 2.0, 4.0, 2.0, 0.0], "stream": [12.0, 0.0, 0.0, 6.0, 0.0]},
            "block_fwd": {"norm": [8.0, 0.0, 0.0, 0.0, 8.0], "stream": [12.0, 0.0, 0.0, 4.0, 0.0], "strided": [0.0, 8.0, 0.0, 0.0, 0.0]},
            "embed_bwd": {"reduce": [2.0, 0.0, 0.0], "strided": [2.0, 0.016, 0.0]},
            "embed_fwd": {"stream": [4.0, 0.0, 0.0], "strided": [2.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "norm": [10.0, 0.008, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_up": [0.0, 6.0, 0.012], "norm": [4.0, 0.008, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 13, "block_fwd": 7, "embed_bwd": 3, "embed_fwd": 4, "head_bwd": 4, "head_fwd": 5},
            "ops": {"block_bwd": 116, "block_fwd": 43, "embed_bwd": 6, "embed_fwd": 5, "head_bwd": 24, "head_fwd": 13},
        },
        "fp32": {
            "block_bwd": {"norm": [48.0, 0.0, 0.0, 0.0, 16.0], "reduce": [8.0, 4.0, 8.0, 4.0, 0.0], "stream": [24.0, 0.0, 0.0, 12.0, 0.0]},
            "block_fwd": {"norm": [16.0, 0.0, 0.0, 0.0, 16.0], "stream": [24.0, 0.0, 0.0, 8.0, 0.0], "strided": [0.0, 16.0, 0.0, 0.0, 0.0]},
            "embed_bwd": {"reduce": [4.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"stream": [8.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"norm": [12.0, 0.016, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"norm": [8.0, 0.016, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 13, "block_fwd": 7, "embed_bwd": 3, "embed_fwd": 4, "head_bwd": 3, "head_fwd": 4},
            "ops": {"block_bwd": 116, "block_fwd": 43, "embed_bwd": 6, "embed_fwd": 5, "head_bwd": 23, "head_fwd": 12},
        },
    },
    "layernorm-gelu-bias-learned-dropout": {
        "autocast": {
            "block_bwd": {"cast_down": [12.0, 0.0, 0.0, 0.0, 0.0], "cast_up": [24.0, 0.0, 0.0, 0.0, 0.0], "norm": [64.0, 0.0, 0.0, 0.0, 16.0], "reduce": [4.0, 2.0, 4.0, 2.0, 0.0], "stream": [36.0, 0.0, 0.0, 6.0, 0.0]},
            "block_fwd": {"cast_down": [24.0, 0.0, 0.0, 0.0, 0.0], "norm": [16.0, 0.0, 0.0, 0.0, 16.0], "stream": [56.0, 0.0, 0.0, 4.0, 0.0], "strided": [0.0, 8.0, 0.0, 0.0, 0.0]},
            "embed_bwd": {"reduce": [4.0, 0.0, 0.0], "stream": [12.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"stream": [44.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "cast_up": [6.0, 0.0, 0.0], "norm": [20.0, 0.016, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_down": [6.0, 0.0, 0.0], "cast_up": [0.0, 6.0, 0.012], "norm": [8.0, 0.016, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 33, "block_fwd": 31, "embed_bwd": 4, "embed_fwd": 8, "head_bwd": 6, "head_fwd": 7},
            "ops": {"block_bwd": 136, "block_fwd": 67, "embed_bwd": 7, "embed_fwd": 9, "head_bwd": 26, "head_fwd": 15},
        },
        "bf16": {
            "block_bwd": {"norm": [32.0, 0.0, 0.0, 0.0, 8.0], "reduce": [4.0, 2.0, 4.0, 2.0, 0.0], "stream": [24.0, 0.0, 0.0, 6.0, 0.0]},
            "block_fwd": {"norm": [8.0, 0.0, 0.0, 0.0, 8.0], "stream": [48.0, 0.0, 0.0, 4.0, 0.0], "strided": [0.0, 8.0, 0.0, 0.0, 0.0]},
            "embed_bwd": {"reduce": [2.0, 0.0, 0.0], "stream": [6.0, 0.0, 0.0], "strided": [2.0, 0.016, 0.0]},
            "embed_fwd": {"stream": [22.0, 0.0, 0.0], "strided": [2.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "norm": [10.0, 0.008, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_up": [0.0, 6.0, 0.012], "norm": [4.0, 0.008, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 15, "block_fwd": 15, "embed_bwd": 4, "embed_fwd": 8, "head_bwd": 4, "head_fwd": 5},
            "ops": {"block_bwd": 118, "block_fwd": 51, "embed_bwd": 7, "embed_fwd": 9, "head_bwd": 24, "head_fwd": 13},
        },
        "fp32": {
            "block_bwd": {"norm": [48.0, 0.0, 0.0, 0.0, 16.0], "reduce": [8.0, 4.0, 8.0, 4.0, 0.0], "stream": [48.0, 0.0, 0.0, 12.0, 0.0]},
            "block_fwd": {"norm": [16.0, 0.0, 0.0, 0.0, 16.0], "stream": [96.0, 0.0, 0.0, 8.0, 0.0], "strided": [0.0, 16.0, 0.0, 0.0, 0.0]},
            "embed_bwd": {"reduce": [4.0, 0.0, 0.0], "stream": [12.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"stream": [44.0, 0.0, 0.0], "strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"norm": [12.0, 0.016, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"norm": [8.0, 0.016, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 15, "block_fwd": 15, "embed_bwd": 4, "embed_fwd": 8, "head_bwd": 3, "head_fwd": 4},
            "ops": {"block_bwd": 118, "block_fwd": 51, "embed_bwd": 7, "embed_fwd": 9, "head_bwd": 23, "head_fwd": 12},
        },
    },
    "rmsnorm-swiglu-rope": {
        "autocast": {
            "block_bwd": {"cast_down": [12.0, 12.0, 12.0, 0.0, 0.0], "cast_up": [30.0, 6.0, 6.0, 0.0, 0.0], "norm": [40.0, 0.0, 0.0, 0.0, 8.0], "stream": [36.0, 38.0, 38.0, 18.0, 0.0], "strided": [0.0, 12.0, 12.0, 0.0, 0.0]},
            "block_fwd": {"cast_down": [30.0, 6.0, 6.0, 0.0, 0.0], "cast_up": [0.0, 12.0, 12.0, 0.0, 0.0], "norm": [16.0, 0.0, 0.0, 0.0, 8.0], "stream": [20.0, 12.0, 12.0, 10.0, 0.0], "strided": [0.0, 32.0, 24.0, 0.0, 0.0]},
            "embed_bwd": {"strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "cast_up": [6.0, 0.0, 0.0], "norm": [20.0, 0.008, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_down": [6.0, 0.0, 0.0], "cast_up": [0.0, 6.0, 0.012], "norm": [8.0, 0.008, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 50, "block_fwd": 59, "embed_bwd": 1, "embed_fwd": 1, "head_bwd": 7, "head_fwd": 7},
            "ops": {"block_bwd": 166, "block_fwd": 118, "embed_bwd": 2, "embed_fwd": 1, "head_bwd": 30, "head_fwd": 15},
        },
        "bf16": {
            "block_bwd": {"cast_down": [0.0, 12.0, 12.0, 0.0, 0.0], "cast_up": [0.0, 6.0, 6.0, 0.0, 0.0], "norm": [20.0, 0.0, 0.0, 0.0, 8.0], "stream": [18.0, 38.0, 38.0, 18.0, 0.0], "strided": [0.0, 12.0, 12.0, 0.0, 0.0]},
            "block_fwd": {"cast_down": [0.0, 6.0, 6.0, 0.0, 0.0], "cast_up": [0.0, 12.0, 12.0, 0.0, 0.0], "norm": [8.0, 0.0, 0.0, 0.0, 8.0], "stream": [12.0, 12.0, 12.0, 10.0, 0.0], "strided": [0.0, 32.0, 24.0, 0.0, 0.0]},
            "embed_bwd": {"strided": [2.0, 0.016, 0.0]},
            "embed_fwd": {"strided": [2.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "norm": [10.0, 0.008, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_up": [0.0, 6.0, 0.012], "norm": [4.0, 0.008, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 36, "block_fwd": 47, "embed_bwd": 1, "embed_fwd": 1, "head_bwd": 5, "head_fwd": 5},
            "ops": {"block_bwd": 152, "block_fwd": 106, "embed_bwd": 2, "embed_fwd": 1, "head_bwd": 28, "head_fwd": 13},
        },
        "fp32": {
            "block_bwd": {"norm": [208.0, 0.0, 0.0, 0.0, 80.0], "stream": [36.0, 44.0, 44.0, 36.0, 0.0], "strided": [0.0, 12.0, 12.0, 0.0, 0.0]},
            "block_fwd": {"norm": [56.0, 0.0, 0.0, 0.0, 48.0], "stream": [24.0, 12.0, 12.0, 20.0, 0.0], "strided": [0.0, 40.0, 24.0, 0.0, 0.0]},
            "embed_bwd": {"strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"norm": [92.0, 0.078, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"norm": [28.0, 0.047, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 56, "block_fwd": 51, "embed_bwd": 1, "embed_fwd": 1, "head_bwd": 16, "head_fwd": 9},
            "ops": {"block_bwd": 174, "block_fwd": 110, "embed_bwd": 2, "embed_fwd": 1, "head_bwd": 40, "head_fwd": 17},
        },
    },
    "rmsnorm-swiglu-rope-qkvbias": {
        "autocast": {
            "block_bwd": {"cast_down": [12.0, 12.0, 12.0, 0.0, 0.0], "cast_up": [30.0, 6.0, 6.0, 0.0, 0.0], "norm": [40.0, 0.0, 0.0, 0.0, 8.0], "reduce": [0.0, 2.0, 4.0, 0.0, 0.0], "stream": [36.0, 38.0, 38.0, 18.0, 0.0], "strided": [0.0, 12.0, 12.0, 0.0, 0.0]},
            "block_fwd": {"cast_down": [30.0, 6.0, 6.0, 0.0, 0.0], "cast_up": [0.0, 12.0, 12.0, 0.0, 0.0], "norm": [16.0, 0.0, 0.0, 0.0, 8.0], "stream": [20.0, 12.0, 12.0, 10.0, 0.0], "strided": [0.0, 32.0, 24.0, 0.0, 0.0]},
            "embed_bwd": {"strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "cast_up": [6.0, 0.0, 0.0], "norm": [20.0, 0.008, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_down": [6.0, 0.0, 0.0], "cast_up": [0.0, 6.0, 0.012], "norm": [8.0, 0.008, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 56, "block_fwd": 62, "embed_bwd": 1, "embed_fwd": 1, "head_bwd": 7, "head_fwd": 7},
            "ops": {"block_bwd": 178, "block_fwd": 121, "embed_bwd": 2, "embed_fwd": 1, "head_bwd": 30, "head_fwd": 15},
        },
        "bf16": {
            "block_bwd": {"cast_down": [0.0, 12.0, 12.0, 0.0, 0.0], "cast_up": [0.0, 6.0, 6.0, 0.0, 0.0], "norm": [20.0, 0.0, 0.0, 0.0, 8.0], "reduce": [0.0, 2.0, 4.0, 0.0, 0.0], "stream": [18.0, 38.0, 38.0, 18.0, 0.0], "strided": [0.0, 12.0, 12.0, 0.0, 0.0]},
            "block_fwd": {"cast_down": [0.0, 6.0, 6.0, 0.0, 0.0], "cast_up": [0.0, 12.0, 12.0, 0.0, 0.0], "norm": [8.0, 0.0, 0.0, 0.0, 8.0], "stream": [12.0, 12.0, 12.0, 10.0, 0.0], "strided": [0.0, 32.0, 24.0, 0.0, 0.0]},
            "embed_bwd": {"strided": [2.0, 0.016, 0.0]},
            "embed_fwd": {"strided": [2.0, 0.016, 0.0]},
            "head_bwd": {"cast_down": [0.0, 6.0, 0.012], "norm": [10.0, 0.008, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"cast_up": [0.0, 6.0, 0.012], "norm": [4.0, 0.008, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 39, "block_fwd": 47, "embed_bwd": 1, "embed_fwd": 1, "head_bwd": 5, "head_fwd": 5},
            "ops": {"block_bwd": 161, "block_fwd": 106, "embed_bwd": 2, "embed_fwd": 1, "head_bwd": 28, "head_fwd": 13},
        },
        "fp32": {
            "block_bwd": {"norm": [208.0, 0.0, 0.0, 0.0, 80.0], "reduce": [0.0, 4.0, 8.0, 0.0, 0.0], "stream": [36.0, 44.0, 44.0, 36.0, 0.0], "strided": [0.0, 12.0, 12.0, 0.0, 0.0]},
            "block_fwd": {"norm": [56.0, 0.0, 0.0, 0.0, 48.0], "stream": [24.0, 12.0, 12.0, 20.0, 0.0], "strided": [0.0, 40.0, 24.0, 0.0, 0.0]},
            "embed_bwd": {"strided": [4.0, 0.016, 0.0]},
            "embed_fwd": {"strided": [4.0, 0.016, 0.0]},
            "head_bwd": {"norm": [92.0, 0.078, 0.0], "softmax": [0.0, 20.016, 0.039]},
            "head_fwd": {"norm": [28.0, 0.047, 0.0], "softmax": [0.0, 12.016, 0.023]},
            "kernels": {"block_bwd": 59, "block_fwd": 51, "embed_bwd": 1, "embed_fwd": 1, "head_bwd": 16, "head_fwd": 9},
            "ops": {"block_bwd": 183, "block_fwd": 110, "embed_bwd": 2, "embed_fwd": 1, "head_bwd": 40, "head_fwd": 17},
        },
    },
}
