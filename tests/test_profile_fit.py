"""Kernel-model parameters fitted to a GPU's sweeps (executor/profile/fit.py): the fit recovers
known parameters from sweeps generated with them, and a stored profile derives again (--from)."""
import json
from dataclasses import replace

import pytest

from conftest import run_cli
from planner.cluster import load_cluster
from planner.cost.compute import gemm_s
from executor.profile.fit import eager_bandwidths, fit_attention, fit_device, fit_gemm


def _sweep(dev):
    rows = []
    for m in (2048, 8192):
        for k, n in ((768, 768), (2048, 8192), (4096, 4096), (768, 50257)):
            for kind in ("fwd", "dgrad", "wgrad"):
                row = {"kind": kind, "m": m, "n": n, "k": k, "dtype": "bf16"}
                dims = {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[kind]
                row["seconds"] = gemm_s(*dims, dev, "bf16")
                rows.append(row)
    return rows


def test_fit_gemm_recovers_the_parameters_it_was_generated_with():
    dev = fit_device(132, 3e12, peak_flops=(("bf16", 800e12),), gemm_latency_s=4e-6, gemm_wave_latency_s=1e-6,
                  gemm_unaligned_efficiency=0.25)
    got = fit_gemm(_sweep(dev), sm_count=132, hbm_bytes_per_s=3e12)
    assert got["rate_flops"] == 800e12 and got["latency_s"] == pytest.approx(4e-6)
    assert got["wave_latency_s"] == pytest.approx(1e-6) and got["error"] < 1e-9
    assert got["unaligned_efficiency"] == pytest.approx(0.25, rel=1e-6)


def test_fit_attention_takes_the_largest_call():
    rows = [{"backend": "default", "batch": 1, "heads": 8, "kv_heads": 8, "seq": 1024, "head_dim": 64,
             "fwd_bwd_s": 1e-3},
            {"backend": "default", "batch": 2, "heads": 8, "kv_heads": 8, "seq": 4096, "head_dim": 64,
             "fwd_bwd_s": 4e-3},
            {"backend": "math", "batch": 4, "heads": 8, "kv_heads": 8, "seq": 8192, "head_dim": 64,
             "fwd_bwd_s": 1.0}]
    got = fit_attention(rows, peak_flops=1e15)
    flops = 4 * 2 * 8 * 4096 * 4096 * 64 / 2
    assert got["rate_flops"] == pytest.approx(3.5 * flops / 4e-3)
    assert got["efficiency"] == pytest.approx(3.5 * flops / 4e-3 / 1e15)


def test_eager_bandwidths_take_the_median_of_each_class():
    rows = [{"kernel": "add_fp32", "GBps": 100.0}, {"kernel": "mul_bf16", "GBps": 300.0},
            {"kernel": "gelu_bf16", "GBps": 200.0}, {"kernel": "cast_up", "GBps": 50.0},
            {"kernel": "stack", "error": "refused"}]
    assert eager_bandwidths(rows) == {"stream": 200e9, "cast_up": 50e9}


@pytest.mark.parametrize("name", ["h100-sxm5", "h200"])
def test_a_stored_profile_derives_again(tmp_path, name):
    out = tmp_path / "again.toml"
    proc = run_cli("profile", "--from", f"profiles/measured/{name}.kernels.json", "--name", f"measured-{name}",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == open(f"profiles/measured/{name}.toml").read()
    dev = load_cluster(str(out), 1).device
    assert dev.kernel_gap_s > 0 and dict(dev.eager_bytes_per_s)["cast_up"] < dev.hbm_bytes_per_s
    # both raw files hold the executor's host probe (the H100's added in round 3), every regime of it
    assert {regime for regime, *_ in dev.host_us} == {"eager", "op", "full", "fsdp", "moe"}


def test_profile_from_a_bad_file_is_one_line(tmp_path):
    bad = tmp_path / "x.kernels.json"
    bad.write_text(json.dumps({"command": "c"}))
    proc = run_cli("profile", "--from", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "date" in proc.stderr


def test_rederive_takes_and_returns_values(tmp_path):
    """The call under `meshplan profile --from`: the stored measurements' path in, the profile's out."""
    from executor.profile import rederive
    out = rederive("profiles/measured/h100-sxm5.kernels.json", out=tmp_path / "again.toml", name="measured-h100-sxm5")
    assert out == tmp_path / "again.toml"
    assert out.read_text() == open("profiles/measured/h100-sxm5.toml").read()


def test_a_profile_names_nccls_tuning_row_and_the_hosts_cpu_vendor():
    """`meshplan profile` writes [gpu] nccl_arch from the device's compute capability (NCCL's tuning.cc rows: 10 and
    up Blackwell, 9 Hopper, 8 Ampere, 7 Volta) and [host] cpu_vendor from the OS, which NCCL's LL cap reads."""
    from executor.profile.device import cpu_vendor, nccl_arch
    assert [nccl_arch(cc) for cc in ((7, 0), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0))] == \
        ["volta", "ampere", "ampere", "hopper", "blackwell", "blackwell"]
    assert nccl_arch(None) == ""
    assert cpu_vendor() in ("intel", "amd", "arm", "")
