"""benchmarks/fidelity.py --unpublished-vpp: the error of a public case at each number of virtual stages its runtime
allows, the one knob of the pipelined Megatron-Core rows that their source leaves out."""
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import fidelity  # noqa: E402


def _case(case_id, layers, hidden, heads, tp, pp, batch, published):
    """A Megatron-Core H100 row as ../shared/validation/public_cases.json states it (the fields fidelity.py reads;
    CI has no ../shared): 48 replicas, sequences of 4096, a vocabulary of 131072."""
    return {"id": case_id, "source": {"repo": "NVIDIA/Megatron-LM README (937571cfd4)"}, "published": {
        "tflops_per_gpu": published}, "hardware": {"num_gpus": tp * pp * 48},
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": 4096, "vocab": 131072},
        "config": {"tp": tp, "pp": pp, "dp": 48, "global_batch": batch}}


def test_every_divisor_of_a_stage_s_layers_is_tried_and_a_prime_count_leaves_two():
    # MLM24-H100-119B: 92 layers on 4 stages, 23 a stage (a prime): Megatron-Core splits a stage into equal
    # chunks of whole layers, so 1 or 23 virtual stages; one virtual stage is the plain 1F1B schedule, whose
    # bubble of 3 of 16 micro-batches (768 sequences / 48 replicas at micro-batch 1) the interleaved one shrinks
    points = dict(fidelity.vpp_sensitivity(_case("MLM24-H100-119B", 92, 10240, 80, 8, 4, 768, 420.5)))
    assert sorted(points) == [1, 23]
    assert points[1] < points[23]          # predicted throughput over published: lower without interleaving


def test_a_case_without_pipeline_has_no_virtual_stages_to_vary():
    assert fidelity.vpp_sensitivity(_case("MLM24-H100-32B", 48, 7168, 56, 8, 1, 192, 459.6)) == []
