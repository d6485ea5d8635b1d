"""`meshplan whatif`: sweeps parsed as written, a re-planned row per point, CSV and plots."""
import csv
import json

import pytest

from conftest import ROOT
from planner.errors import UserError
from planner.whatif import parse_sweep


def test_sweep_values_and_the_ellipsis():
    assert parse_sweep("gpus=64,128,...,4096") == ("gpus", ["64", "128", "256", "512", "1024", "2048", "4096"])
    assert parse_sweep("seq-len=2048,4096,...,8192") == ("seq_len", ["2048", "4096", "8192"])
    assert parse_sweep("global_batch=256,512,768,...,1280") == ("global_batch", ["256", "512", "768", "1024", "1280"])
    assert parse_sweep("bandwidth=100,200,400") == ("bandwidth", ["100", "200", "400"])
    assert parse_sweep("gpu=a100-80g,h100-80g") == ("gpu", ["a100-80g", "h100-80g"])


@pytest.mark.parametrize("text,says", [("gpus", "KEY=V1,V2"), ("speed=1,2", "unknown sweep 'speed'"),
                                       ("gpus=64,...,1024", "two integers before it"),
                                       ("gpus=64,128,...,1000", "does not reach 1000"),
                                       ("gpus=64,x", "positive integers"),
                                       ("gpu=h100-80g,h101", "gpu value 'h101' is neither a built-in cluster")])
def test_bad_sweeps_name_the_flag(text, says):
    with pytest.raises(UserError) as e:
        parse_sweep(text)
    assert str(e.value).startswith("--sweep: ") and says in str(e.value)


def test_gpu_sweep_replans_each_point(cli, tmp_path):
    out = cli("whatif", "--model", "llama3-8b", "--cluster", "h100-80g", "--sweep", "gpus=8,16", "--out",
              str(tmp_path), "--progress")
    assert out.returncode == 0, out.stderr
    assert "whatif gpus: [" in out.stderr and "2/2" in out.stderr          # the progress bar
    rows = list(csv.DictReader((tmp_path / "whatif.csv").open()))
    assert [r["gpus"] for r in rows] == ["8", "16"]
    assert set(rows[0]) >= {"tokens_per_s", "mfu", "memory_gib", "strategy", "usd_per_million_tokens", "fits"}
    for r in rows:
        assert r["fits"] == "True" and float(r["tokens_per_s"]) > 0 and r["strategy"].startswith("dp ")
        # the h100-80g profile has a price: cost per million tokens from tokens/s and the GPU count
        assert float(r["usd_per_million_tokens"]) == pytest.approx(
            4.916 * int(r["gpus"]) / (float(r["tokens_per_s"]) * 3600) * 1e6, rel=1e-9)
    # twice the GPUs, same global batch (1M tokens rounds up to 128 sequences either way): more tokens/s
    assert float(rows[1]["tokens_per_s"]) > float(rows[0]["tokens_per_s"])
    doc = json.loads((tmp_path / "whatif.json").read_text())
    assert doc["sweep"] == "gpus" and len(doc["points"]) == 2
    for ext in ("png", "svg"):
        assert (tmp_path / f"whatif.{ext}").stat().st_size > 5000
    svg = (tmp_path / "whatif.svg").read_text()
    for text in ("number of GPUs", "tokens per second", "MFU (%)", "memory per GPU (GiB)", "device capacity",
                 "US$ per million tokens"):
        assert text in svg, text


def test_bandwidth_sweep_changes_the_network_only(cli, tmp_path):
    out = cli("whatif", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--sweep",
              "bandwidth=25,400", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader((tmp_path / "whatif.csv").open()))
    assert [r["gpus"] for r in rows] == ["16", "16"] and [r["global_batch"] for r in rows] == ["64", "64"]
    assert float(rows[1]["tokens_per_s"]) >= float(rows[0]["tokens_per_s"])


def test_sweeping_gpus_with_gpus_given_is_an_error(cli, tmp_path):
    out = cli("whatif", "--model", "llama3-8b", "--gpus", "16", "--sweep", "gpus=8,16", "--out", str(tmp_path))
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("meshplan whatif: error: --gpus:")


def test_profile_pricing_is_optional_and_checked(tmp_path):
    from planner.cluster import load_cluster
    text = (ROOT / "profiles" / "h100-80g.toml").read_text()
    assert load_cluster("a100-80g").gpu_hour_usd == 0.0                 # no [pricing]: still loads
    broken = tmp_path / "p.toml"
    broken.write_text(text.replace('source = "AWS EC2 Capacity Blocks', 'where = "AWS EC2 Capacity Blocks'))
    with pytest.raises(UserError) as e:
        load_cluster(str(broken))
    assert "pricing.source" in str(e.value)


def test_a_point_whose_gpu_does_not_run_the_precision_is_reported_and_the_sweep_goes_on(cli, tmp_path):
    # MXFP8 has a tensor-core rate on B200 (its profile's peak_tflops.mxfp8), none on the H100: the H100's point says
    # so, the B200's is planned, and the sweep exits 0
    out = cli("whatif", "--model", "llama3-8b", "--gpus", "8", "--framework", "megatron", "--precision", "mxfp8",
              "--sweep", "gpu=b200,h100-80g", "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader((tmp_path / "whatif.csv").open()))
    assert [r["gpu"] for r in rows] == ["b200", "h100-80g"]
    assert rows[0]["fits"] == "True" and rows[0]["not_run"] == "" and float(rows[0]["tokens_per_s"]) > 0
    assert rows[1]["fits"] == "False" and "no mxfp8 tensor-core rate" in rows[1]["not_run"]
    # the point keeps its job: one node's 8 GPUs, the same batch and sequence as the B200's, the H100's 80 GB
    assert (rows[1]["gpus"], rows[1]["global_batch"], rows[1]["seq_len"]) == \
        (rows[0]["gpus"], rows[0]["global_batch"], rows[0]["seq_len"])
    assert float(rows[1]["capacity_gib"]) < 80
    assert "h100-80g      not run  h100-80g's" in out.stdout


def test_a_bad_precision_for_every_point_still_fails_the_sweep_up_front(cli, tmp_path):
    # an error that is not about the point (here the value itself) stops the sweep with exit code 2
    out = cli("whatif", "--model", "llama3-8b", "--gpus", "8", "--sweep", "precision=bf16,fp9", "--out",
              str(tmp_path))
    assert out.returncode == 2 and "--sweep: precision value 'fp9' is not allowed" in out.stderr


def test_a_gpu_whose_nodes_the_gpus_do_not_fill_is_reported_and_the_sweep_goes_on(cli, tmp_path):
    # 152 GPUs are 19 nodes of 8 H100 but neither whole NVL72 racks of 72 nor equal parts of 36 or more of each (152 =
    # 4 x 38: not whole trays of 4): that point says so and keeps the GPUs given; its batch and sequence, left to the
    # sweep, follow from GPUs it cannot have (empty), its capacity is the GPU's
    out = cli("whatif", "--model", "llama3-8b", "--gpus", "152", "--sweep", "gpu=h100-80g,gb200-nvl72", "--out",
              str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader((tmp_path / "whatif.csv").open()))
    assert rows[0]["fits"] == "True" and rows[0]["gpus"] == "152"
    nvl72 = rows[1]
    assert nvl72["fits"] == "False" and "152 GPUs on gb200-nvl72: use at most 72" in nvl72["not_run"]
    assert (nvl72["gpus"], nvl72["global_batch"], nvl72["seq_len"]) == ("152", "", "")
    assert float(nvl72["capacity_gib"]) > 150          # a B200-class GPU of the rack (186 GB HBM3e)


def test_points_on_different_gpu_counts_are_compared_per_gpu():
    """A gpu= sweep without --gpus plans one node of each profile (8 GPUs; an NVL72 rack is 72): the table then
    names each point's GPUs and batch and gives throughput per GPU, so the rack does not read 9x faster."""
    from planner.cli.whatif import format_points
    from planner.whatif import Point

    def point(value, gpus, batch, tokens):
        return Point(value=value, gpus=gpus, global_batch=batch, seq_len=4096, fits=True, strategy="dp", layout="dp",
                     tokens_per_s=tokens, mfu=0.4, memory_gib=50.0, capacity_gib=80.0)
    table = format_points([point("b200", 8, 128, 12_000.0), point("gb200-nvl72", 72, 144, 144_000.0)], "gpu")
    head, b200, rack = table.splitlines()
    assert head.split()[:5] == ["gpu", "GPUs", "batch", "tokens/s", "per"]
    assert b200.split()[:5] == ["b200", "8", "128", "12,000", "1,500"]
    assert rack.split()[:5] == ["gb200-nvl72", "72", "144", "144,000", "2,000"]
    # a gpus= sweep names the GPUs in its own column already; equal batches get no column
    table = format_points([point("8", 8, 128, 8_000.0), point("16", 16, 128, 15_000.0)], "gpus")
    head, first, second = table.splitlines()
    assert "GPUs" not in head and "batch" not in head
    assert first.split()[:3] == ["8", "8,000", "1,000"] and second.split()[:3] == ["16", "15,000", "938"]
