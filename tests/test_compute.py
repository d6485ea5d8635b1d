"""Kernel-time functions against hand-computed values."""
import math

import pytest

from planner.cluster import load_cluster
from planner.cost.compute import attention_flops, flash_attention_s, gemm_s, memory_bound_s, unfused_attention_s

A100 = load_cluster("a100-80g").device        # 312 TFLOP/s bf16, 108 SMs, efficiency 0.67,
                                              # tiles 256x128, 128x256, 128x128


def test_gemm_tile_and_wave_quantization():
    m = n = k = 4096
    # 256x128 or 128x256: 512 tiles in ceil(512/108) = 5 waves of 108; 128x128: 1024 in 10 waves
    useful_big = 512 / (5 * 108)
    useful_small = 1024 / (10 * 108)
    expected = 2 * m * n * k / (312e12 * 0.67 * max(useful_big, useful_small))
    assert gemm_s(m, n, k, A100, "bf16") == pytest.approx(expected, rel=1e-12)


def test_gemm_partial_tiles_cost_full_tiles():
    # m = 129 rows need two 128-row tiles: the same time as m = 256 (108 columns of tiles: two
    # full waves, so no split-K)
    n = 128 * 108
    assert gemm_s(129, n, 4096, A100, "bf16") == pytest.approx(gemm_s(256, n, 4096, A100, "bf16"))


def test_gemm_picks_the_least_wasteful_tile():
    # n = 128 fits a 128x128 tile exactly; a 128x256 tile would waste half its columns.
    # 108 tiles of 128 x 128: one full wave on the A100's 108 SMs
    one_wave = 2 * 128 * 128 * 4096 / (312e12 * 0.67 * (1 / 108))
    assert gemm_s(128 * 108, 128, 4096, A100, "bf16") == pytest.approx(one_wave, rel=1e-12)


def test_gemm_with_fewer_tiles_than_sms_splits_k():
    # one 128 x 128 output tile: the inner 4096 is cut into 16 slices of 256 (SPLIT_K_MIN_K), one
    # wave of 16 tiles, plus the fp32 partial sums written and read back (8 bytes x 16 slices)
    math_s = 2 * 256 * 128 * 128 / (312e12 * 0.67 * (1 / 108))
    reduce_s = 8 * 128 * 128 * 16 / (2039e9 * 0.90)
    assert gemm_s(128, 128, 4096, A100, "bf16") == pytest.approx(math_s + reduce_s, rel=1e-12)


def test_gemm_with_tiny_k_is_memory_bound():
    m, n, k = 65536, 65536, 8
    bytes_moved = 2 * (m * k + k * n + m * n)
    assert gemm_s(m, n, k, A100, "bf16") == pytest.approx(bytes_moved / (2039e9 * 0.90), rel=1e-12)


def test_a_measured_gemm_shape_table_sets_the_rate_of_the_nearest_shape():
    # a CPU-like device: one 'SM', 1x1 tiles, 100 GFLOP/s; a head's forward measured at 0.8 of it
    from dataclasses import replace
    cpu = replace(A100, peak_flops=(("fp32", 100e9),), sm_count=1, gemm_tiles=((1, 1),), gemm_efficiency=1.0,
                  hbm_bytes_per_s=1e15, gemm_shapes=((1024, 8192, 512, 0.8), (1024, 512, 512, 1.0)))
    flops = 2 * 1024 * 8192 * 512
    assert gemm_s(1024, 8192, 512, cpu, "fp32") == pytest.approx(flops / 80e9, rel=1e-12)
    # 256 tokens through the same head: log distance ln 4 to the head, ln 4 + ln 16 to the square one
    assert gemm_s(256, 8192, 512, cpu, "fp32") == pytest.approx(flops / 4 / 80e9, rel=1e-12)
    # an MLP product (1024 x 1408 x 512) lies nearer the 512-wide shape: ln(1408/512) < ln(8192/1408)
    assert gemm_s(1024, 1408, 512, cpu, "fp32") == pytest.approx(2 * 1024 * 1408 * 512 / 100e9, rel=1e-12)
    # no table: the peak as before
    assert replace(cpu, gemm_shapes=()).shape_efficiency(1024, 8192, 512) == 1.0


def test_memory_bound_kernel():
    assert memory_bound_s(1e9, A100) == pytest.approx(1e9 / (2039e9 * 0.9))


def test_causal_attention_flops_are_half():
    full = 4 * 2 * 16 * 1024 * 1024 * 128
    assert attention_flops(2, 16, 1024, 1024, 128, causal=False) == full
    assert attention_flops(2, 16, 1024, 1024, 128, causal=True) == full / 2


def test_sliding_window_attention_flops():
    # each query sees w keys, minus the triangle at the start: 4 b a s d w (1 - w / 2s)
    assert attention_flops(1, 8, 8192, 8192, 128, causal=True, window=4096) == pytest.approx(
        4 * 8 * 8192 * 128 * 4096 * (1 - 4096 / (2 * 8192)))


def test_flash_attention_backward_is_two_and_a_half_forward():
    fwd, bwd = flash_attention_s(1, 32, 4096, 4096, 128, A100, "bf16")
    assert fwd == pytest.approx(4 * 32 * 4096 * 4096 * 128 / 2 / (312e12 * 0.60))
    assert bwd == pytest.approx(2.5 * fwd)


def test_unfused_attention_pays_for_the_scores():
    fwd, bwd = unfused_attention_s(1, 16, 2048, 2048, 128, A100, "fp16", dropout=True)
    scores = 16 * 2048 * 2048
    gemm = gemm_s(2048, 2048, 128, A100, "fp16", 16)
    # two batched GEMMs of equal FLOPs and the softmax + dropout traffic: 9 bytes per score
    assert fwd > 2 * gemm * 0.99
    assert fwd - gemm - gemm_s(2048, 128, 2048, A100, "fp16", 16) == pytest.approx(
        scores * 9 / (2039e9 * 0.9))


H100 = load_cluster("h100-80g").device        # 989.4 TFLOP/s bf16; cuDNN's fused flash kernels: matmuls at 0.682
                                              # of it, 3.0 key tiles a row, exp2 at 3.865 T/s, dropout 0.91/0.90 ps


def test_fused_attention_is_matmuls_exponentials_and_the_rows_fixed_work():
    # one head, 4096 causal tokens at head dim 128: 4096^2 / 2 score elements; a query meets 2048 keys on average,
    # 16 key tiles of 128, and each row of query tiles pays 3 more
    elements = 4096 * 4096 / 2
    matmul, exp = 0.682 * 989.4e12, 3.865e12
    stretch = (16 + 3.0) / 16
    fwd, bwd = flash_attention_s(1, 1, 4096, 4096, 128, H100, "bf16", fused=True)
    assert fwd == pytest.approx(elements * (4 * 128 / matmul + 1 / exp) * stretch, rel=1e-12)
    assert bwd == pytest.approx(elements * (10 * 128 / matmul + 1 / exp) * stretch, rel=1e-12)
    # dropout: a random number drawn per score element forward and again backward
    fwd_d, bwd_d = flash_attention_s(1, 1, 4096, 4096, 128, H100, "bf16", fused=True, dropout=True)
    assert fwd_d - fwd == pytest.approx(elements * 0.91e-12, rel=1e-9)
    assert bwd_d - bwd == pytest.approx(elements * 0.90e-12, rel=1e-9)


def test_blackwell_runs_cudnns_attention_with_hoppers_exponential_units_per_sm():
    # B200: the H100's fitted matmul fraction of a 2,250 TFLOP/s peak, but exp2 at 16 a clock on each of 148 SMs at the
    # 1.856 GHz that peak implies at 8,192 bf16 FLOPs a clock per SM (FlashAttention-4: the SFUs unchanged from Hopper):
    # the exponential, not the matmuls, is most of a forward element's time at head dimension 64
    b200 = load_cluster("b200").device
    sfu = 148 * 16 * 2250e12 / (148 * 8192)
    assert b200.sfu_ops_per_s == pytest.approx(sfu, rel=1e-3)
    elements = 4096 * 4096 / 2
    fwd, _ = flash_attention_s(1, 1, 4096, 4096, 64, b200, "bf16", fused=True)
    assert fwd == pytest.approx(elements * (4 * 64 / (0.682 * 2250e12) + 1 / b200.sfu_ops_per_s) * (16 + 3.0) / 16,
                                rel=1e-12)
    assert b200.sfu_ops_per_s < 0.682 * 2250e12 / (4 * 64)     # the exponential takes longer than the matmuls
    # Megatron-LM (TransformerEngine prefers cuDNN from compute capability 9.0) prices it there
    from planner.runtimes import RUNTIMES
    assert RUNTIMES["megatron"].attention_kernel == "fused"


def test_fused_attention_pads_the_head_dimension_and_needs_the_profiles_numbers():
    # head dim 96 runs the 128 kernels (cuDNN tiles the head dimension by 64): the time of 128, 3/4 of its FLOPs
    assert flash_attention_s(2, 8, 2048, 2048, 96, H100, "bf16", fused=True) == pytest.approx(
        flash_attention_s(2, 8, 2048, 2048, 128, H100, "bf16", fused=True), rel=1e-12)
    # short sequences pay the rows' fixed work: at 1024 tokens a query meets 4 key tiles, (4 + 3) / 4 of the work
    per_element = flash_attention_s(1, 1, 1024, 1024, 64, H100, "bf16", fused=True)[0] / (1024 * 1024 / 2)
    assert per_element == pytest.approx((4 * 64 / (0.682 * 989.4e12) + 1 / 3.865e12) * 7 / 4, rel=1e-12)
    # a profile that does not characterise cuDNN's kernels (A100's) prices them at attention_efficiency
    assert flash_attention_s(1, 32, 4096, 4096, 128, A100, "bf16", fused=True) == flash_attention_s(
        1, 32, 4096, 4096, 128, A100, "bf16")


def test_the_profile_reads_cudnns_fused_kernels_all_or_none_and_says_which_field_is_wrong():
    import tomllib
    from pathlib import Path

    from planner.cluster import parse_cluster
    from planner.errors import UserError

    text = (Path(__file__).resolve().parents[1] / "profiles" / "h100-80g.toml").read_text()
    assert parse_cluster(tomllib.loads(text), "h100-80g.toml").device.fused_attention_row_tiles == 3.0
    for old, new, field in (
            ("fused_attention_row_tiles = 3.0", "", "gpu.kernels.fused_attention_row_tiles"),
            ("fused_attention_dropout_ps = [0.91, 0.90]", "fused_attention_dropout_ps = [0.91]",
             "gpu.kernels.fused_attention_dropout_ps"),
            ("fused_attention_efficiency = 0.682", "fused_attention_efficiency = 1.5",
             "gpu.kernels.fused_attention_efficiency"),
            ("sfu_Tops = 3.865", "", "gpu.sfu_Tops")):
        assert old in text
        with pytest.raises(UserError) as err:
            parse_cluster(tomllib.loads(text.replace(old, new)), "p.toml")
        assert err.value.field == field
    # none of them: every flash kernel at attention_efficiency
    bare = text
    for key in ("fused_attention_efficiency", "fused_attention_row_tiles", "fused_attention_dropout_ps"):
        bare = "\n".join(line for line in bare.splitlines() if not line.startswith(key))
    assert parse_cluster(tomllib.loads(bare), "p.toml").device.fused_attention_efficiency == 0.0
