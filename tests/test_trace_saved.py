"""Saved-activation bytes: the trace against what autograd really keeps, counted with saved-tensor hooks.

The real run uses real weights on the CPU and counts each storage autograd saves
once, leaving out the module's own parameters and buffers; the trace runs the
same module on fake tensors. Both use the same loss (written here).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import trace_models as tm
from planner.cluster import load_cluster
from planner.cost.layer import Context, layer_cost
from planner.trace import trace_module

import transformers  # the [hf] extra, which CI installs: missing, it fails, never skips


def lm_loss(output, inputs):
    logits = output.logits if hasattr(output, "logits") else output
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


def really_saved_bytes(module, ids) -> int:
    own = {StorageWeakRef(t.untyped_storage()) for t in [*module.parameters(), *module.buffers()]}
    kept = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in own:
            kept[ref] = (t.untyped_storage().nbytes(), t)      # hold it: the storage stays unique
        return t
    module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(module(ids), None)
    loss.backward()
    return sum(n for n, _ in kept.values())


def _llama():
    return transformers.LlamaForCausalLM(tm.tiny_hf_config("llama"))


def _gpt2():                                    # dropout on: the unfused attention path with masks
    return transformers.GPT2LMHeadModel(tm.tiny_hf_config("gpt2"))


@pytest.mark.parametrize("build", [_llama, _gpt2, lambda: tm.TinyTransformer()], ids=["llama", "gpt2", "tiny"])
def test_traced_saved_bytes_match_a_real_run(build):
    torch.manual_seed(0)
    module = build()
    ids = torch.randint(0, 90, (2, 32))
    real = really_saved_bytes(module, ids)
    traced = trace_module(module, ids, loss_fn=lm_loss).saved_activation_bytes
    assert abs(traced - real) / real < 0.05, (traced, real)


def test_layer_graph_activations_through_the_cost_model():
    """What the cost model charges for the traced Llama (no recompute, fp32, this runtime's flash kernel)
    against the real run: the layer graph keeps everything but the kernel's log-sum-exp, which the
    cost model adds itself."""
    torch.manual_seed(0)
    module = _llama()
    ids = torch.randint(0, 90, (2, 32))
    real = really_saved_bytes(module, ids)
    graph = trace_module(module, ids, loss_fn=lm_loss).graph
    ctx = Context(micro_batch=2, seq_len=32, tp=1, cp=1, sequence_parallel=False, precision="fp32",
                  attention="flash", framework="torch", tp_comm_overlap=False)
    cluster = load_cluster("cpu-gloo")
    charged = sum(layer_cost(layer, ctx, cluster).policy("none").act_bytes for layer in graph.layers)
    assert abs(charged - real) / real < 0.05, (charged, real)
