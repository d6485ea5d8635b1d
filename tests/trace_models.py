"""Plain nn.Modules the trace tests use, each with a factory as `--model tests/trace_models.py:NAME` takes.

Every factory returns (module, example_inputs) with parameters on the CPU (real,
small) unless it says otherwise.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, SEQ = 96, 64, 4, 32


class MLP(nn.Module):
    def __init__(self, width=WIDTH, hidden=4 * WIDTH, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):                       # x: (B, width)
        return self.head(self.fc2(self.act(self.fc1(x))))


class SmallCNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):                       # x: (B, 3, H, W)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))     # (B, 16, H/2, W/2)
        return self.fc(x.mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, width=WIDTH, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def project(self, x):                       # x: (B, T, C) -> q, k, v, each (B, T, C)
        return self.qkv(x).split(x.shape[-1], dim=-1)

    def forward(self, x):                       # x: (B, T, C)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.project(x))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, c))

    def out_proj(self, y):
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, width=WIDTH, heads=HEADS):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """A nanoGPT-like decoder: token + position embeddings, blocks, final norm, untied head."""

    def __init__(self, layers=3, block=Block):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = nn.ModuleList([block() for _ in range(layers)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):                     # ids: (B, T)
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class DataDependentGate(nn.Module):
    """Control flow on values: fake tensors cannot say which branch runs."""

    def __init__(self, width=WIDTH):
        super().__init__()
        self.scale = nn.Linear(width, width)

    def forward(self, x):
        if x.sum() > 0:                         # needs the data
            return self.scale(x)
        return x


class GatedBlock(Block):
    def __init__(self, width=WIDTH, heads=HEADS):
        super().__init__(width, heads)
        self.gate = DataDependentGate(width)

    def forward(self, x):
        return self.gate(super().forward(x))


class TopKMoE(nn.Module):
    """A mixture of experts routed with torch.where on the router's choice (data-dependent shapes)."""

    def __init__(self, width=WIDTH, experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                    nn.Linear(2 * width, width)) for _ in range(experts)])

    def forward(self, x):                       # x: (B, T, C)
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)     # (N, k)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class MoEBlock(Block):
    def __init__(self, width=WIDTH, heads=HEADS):
        super().__init__(width, heads)
        del self.fc, self.out
        self.moe = TopKMoE(width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


HF_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def tiny_hf_config(name):
    """A two-block transformers config of ``name`` (gpt2, bert, vit, llama, mistral, qwen2, qwen3, mixtral):
    small widths, vocabulary 100, nothing downloaded."""
    import transformers     # the [hf] extra: only the tests that build these need it
    if name == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    if name == "bert":
        return transformers.BertConfig(vocab_size=100, **HF_SMALL)
    if name == "vit":
        return transformers.ViTConfig(image_size=32, patch_size=8, num_labels=10, **HF_SMALL)
    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "mixtral": "MixtralConfig"}
    extra = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}, "mistral": {"sliding_window": 16}}
    return getattr(transformers, cls[name])(vocab_size=100, num_key_value_heads=2, **HF_SMALL, **extra.get(name, {}))


def ids(batch=2):
    return torch.randint(0, VOCAB, (batch, SEQ))


def mlp():
    return MLP(), torch.randn(8, WIDTH)


def cnn():
    return SmallCNN(), torch.randn(4, 3, 16, 16)


def tiny_transformer():
    return TinyTransformer(), ids()


def tiny_transformer_module_only():
    return TinyTransformer()


def untraceable():
    return TinyTransformer(layers=2, block=GatedBlock), ids()


def custom_moe():
    return TinyTransformer(layers=2, block=MoEBlock), ids()


def tiny_mixtral():
    """transformers' Mixtral at ``tiny_hf_config`` widths: 4 grouped experts a layer, top 2."""
    import transformers
    return transformers.MixtralForCausalLM(tiny_hf_config("mixtral")), ids()


class StackedExperts(nn.Module):
    """Four experts as one stacked weight, a grouped GEMM over a fixed quarter of the rows each: experts, but called
    the module's own way (no router, no top-k ids)."""

    def __init__(self, width=WIDTH, experts=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, width, width) / width)

    def forward(self, x):                       # x: (N, C), N divisible by the experts
        experts = self.weight.shape[0]
        offs = torch.arange(1, experts + 1, dtype=torch.int32) * (x.shape[0] // experts)
        return torch._grouped_mm(x, self.weight, offs=offs)


class StackedExpertsBlock(nn.Module):
    def __init__(self, width=WIDTH):
        super().__init__()
        self.norm, self.experts = nn.LayerNorm(width), StackedExperts(width)

    def forward(self, x):
        return x + self.experts(self.norm(x))


def stacked_experts():
    return nn.Sequential(StackedExpertsBlock(), StackedExpertsBlock()), torch.randn(8, WIDTH)


def not_a_module():
    return 42


def frozen_transformer():
    """TinyTransformer with its token and position embeddings and each block's qkv and fc linears frozen
    (``requires_grad_(False)``), as a fine-tuning script leaves it."""
    model, example = tiny_transformer()
    model.tok.requires_grad_(False)
    model.pos.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv.requires_grad_(False)
        block.fc.requires_grad_(False)
    return model, example


class NamedAttention(Attention):
    """Attention with Llama's projection names (q_proj ... o_proj, no biases), which LoRA targets
    (planner/finetune.py)."""

    def __init__(self, width=WIDTH, heads=HEADS):
        super().__init__(width, heads)
        del self.qkv, self.proj
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))

    def project(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def out_proj(self, y):
        return self.o_proj(y)


class NamedBlock(Block):
    """An attention-only block whose attention has Llama's projection names."""

    def __init__(self, width=WIDTH, heads=HEADS):
        super().__init__(width, heads)
        del self.ln2, self.fc, self.out
        self.attn = NamedAttention(width, heads)

    def forward(self, x):
        return x + self.attn(self.ln1(x))


def lora_named(frozen=False):
    """A two-block TinyTransformer of attention-only blocks with Llama's projection names; ``frozen``: its
    embedding and first block frozen."""
    model = TinyTransformer(layers=2, block=NamedBlock)
    if frozen:
        model.tok.requires_grad_(False)
        model.blocks[0].requires_grad_(False)
    return model, ids()


def lora_named_frozen():
    return lora_named(frozen=True)
