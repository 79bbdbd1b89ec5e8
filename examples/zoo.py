"""Models built from code with seeded weights: the examples, tests and benchmarks use them.

Every factory returns ``(module, sample_args)`` and works as a CLI model spec::

    torchtpu-export examples/zoo.py:resnet18 --target tpu --check

No downloads: architectures are written here, weights are random (seeded).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["resnet18", "resnet50", "mobilenet_v2", "gpt", "llama", "qwen3", "dlrm", "unet", "bert_encoder",
           "small_cnn", "ZOO"]


def _seeded(seed: int = 0):
    torch.manual_seed(seed)


def _randomize_norms(model: nn.Module) -> nn.Module:
    """Non-trivial batch-norm statistics and affine weights, so folding and numerics are really tested."""
    g = torch.Generator().manual_seed(1234)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


# ---- CNNs ----------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, block, layers, width=64, num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], width
        for i, n in enumerate(layers):
            w = width * 2 ** i
            for j in range(n):
                blocks.append(block(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w * block.expansion
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def resnet18(batch: int = 1, size: int = 224):
    """ResNet-18 (11.7M parameters), the torchvision architecture."""
    _seeded(0)
    return _randomize_norms(ResNet(BasicBlock, [2, 2, 2, 2])), (torch.randn(batch, 3, size, size),)


def resnet50(batch: int = 1, size: int = 64, width: int = 16):
    """A ResNet-50-style CNN (bottleneck blocks [3, 4, 6, 3]) at reduced width for tests."""
    _seeded(0)
    return _randomize_norms(ResNet(Bottleneck, [3, 4, 6, 3], width=width, num_classes=100)), \
        (torch.randn(batch, 3, size, size),)


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        layers = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                   nn.ReLU6(), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=1000, width_mult=1.0):
        super().__init__()
        cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
               (6, 320, 1, 1)]
        cin = int(32 * width_mult)
        layers = [nn.Conv2d(3, cin, 3, 2, 1, bias=False), nn.BatchNorm2d(cin), nn.ReLU6()]
        for t, c, n, s in cfg:
            cout = int(c * width_mult)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        last = int(1280 * max(1.0, width_mult))
        layers += [nn.Conv2d(cin, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x):
        x = self.features(x)
        return self.classifier(x.mean((2, 3)))


def mobilenet_v2(batch: int = 1, size: int = 224):
    """MobileNetV2 (3.5M parameters): depthwise convs, ReLU6, inverted residuals."""
    _seeded(0)
    return _randomize_norms(MobileNetV2()), (torch.randn(batch, 3, size, size),)


class SmallCNN(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def small_cnn(batch: int = 1, size: int = 32):
    """A tiny CNN for quick tests."""
    _seeded(0)
    return _randomize_norms(SmallCNN()), (torch.randn(batch, 3, size, size),)


# ---- transformers --------------------------------------------------------------------------

class GPTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """minGPT: learned positions, pre-LN blocks, causal attention, tied LM head."""

    def __init__(self, vocab=512, dim=128, heads=4, layers=2, max_seq=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def gpt(batch: int = 1, seq: int = 32, **config):
    """A minGPT-style decoder (GELU, LayerNorm, causal SDPA, tied embeddings)."""
    _seeded(0)
    model = GPT(**config).eval()
    return model, (torch.randint(0, model.tok.num_embeddings, (batch, seq)),)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq: int, theta: float = 10000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ang = torch.outer(torch.arange(max_seq).float(), inv)
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x, cos, sin):
    # x: (b, h, t, d); cos/sin: (t, d/2); rotate-half convention (Llama/HF)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, qk_norm=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim) if qk_norm else None
        self.k_norm = RMSNorm(head_dim) if qk_norm else None

    def project(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask=None, causal=False):
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        b, _, t, _ = y.shape
        return self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, hidden, qk_norm=False):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = LlamaAttention(dim, heads, kv_heads, head_dim, qk_norm)
        self.mlp_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def mlp(self, x):
        h = self.mlp_norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A Llama-3-style decoder: RMSNorm, RoPE, GQA, SwiGLU (``qk_norm=True`` gives Qwen3-style q/k norms).

    ``forward(tokens)`` is a full causal pass. ``prefill`` and ``decode`` use an explicit
    KV cache of ``max_seq`` positions, passed in and returned, so both are stateless programs.
    """

    def __init__(self, vocab=512, dim=128, layers=2, heads=4, kv_heads=2, head_dim=None, hidden=256,
                 max_seq=64, qk_norm=False, tie_embeddings=False):
        super().__init__()
        self.head_dim = head_dim or dim // heads
        self.kv_heads, self.max_seq, self.layers_n = kv_heads, max_seq, layers
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, self.head_dim, hidden, qk_norm)
                                    for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(self.head_dim, max_seq)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.cos[:t], self.sin[:t]
        for blk in self.layers:
            q, k, v = blk.attn.project(blk.attn_norm(x), cos, sin)
            x = x + blk.attn.attend(q, k, v, causal=True)
            x = x + blk.mlp(x)
        return self.lm_head(self.norm(x))

    def empty_cache(self, batch=1):
        shape = (self.layers_n, batch, self.kv_heads, self.max_seq, self.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    def prefill(self, tokens):
        """Logits of every position and the KV cache filled for positions [0, t)."""
        b, t = tokens.shape
        x = self.embed(tokens)
        cos, sin = self.cos[:t], self.sin[:t]
        ks, vs = [], []
        pad = (0, 0, 0, self.max_seq - t)
        for blk in self.layers:
            q, k, v = blk.attn.project(blk.attn_norm(x), cos, sin)
            ks.append(F.pad(k, pad))
            vs.append(F.pad(v, pad))
            x = x + blk.attn.attend(q, k, v, causal=True)
            x = x + blk.mlp(x)
        return self.lm_head(self.norm(x)), torch.stack(ks), torch.stack(vs)

    def decode(self, token, pos, k_cache, v_cache):
        """One step: ``token`` (b, 1) at position ``pos`` (an int64 tensor of shape (1,))."""
        x = self.embed(token)
        cos, sin = self.cos[pos], self.sin[pos]
        valid = torch.arange(self.max_seq) <= pos  # (max_seq,)
        mask = torch.where(valid, 0.0, float("-inf")).view(1, 1, 1, self.max_seq)
        new_k, new_v = [], []
        for i, blk in enumerate(self.layers):
            q, k, v = blk.attn.project(blk.attn_norm(x), cos, sin)
            kc = k_cache[i].index_copy(2, pos, k)
            vc = v_cache[i].index_copy(2, pos, v)
            new_k.append(kc)
            new_v.append(vc)
            x = x + blk.attn.attend(q, kc, vc, mask=mask)
            x = x + blk.mlp(x)
        return self.lm_head(self.norm(x)), torch.stack(new_k), torch.stack(new_v)


class Prefill(nn.Module):
    """``model.prefill`` as a module, for export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model.prefill(tokens)


class Decode(nn.Module):
    """``model.decode`` as a module, for export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, token, pos, k_cache, v_cache):
        return self.model.decode(token, pos, k_cache, v_cache)


def llama(batch: int = 1, seq: int = 16, **config):
    """A Llama-3-style decoder (RMSNorm, RoPE, GQA 4:2, SwiGLU)."""
    _seeded(0)
    model = Llama(**config).eval()
    return model, (torch.randint(0, model.embed.num_embeddings, (batch, seq)),)


def qwen3(batch: int = 1, seq: int = 16, **config):
    """A Qwen3-style decoder: Llama plus RMSNorm on q and k per head, GQA, tied embeddings."""
    _seeded(0)
    config = {"qk_norm": True, "tie_embeddings": True, "heads": 4, "kv_heads": 1, **config}
    model = Llama(**config).eval()
    return model, (torch.randint(0, model.embed.num_embeddings, (batch, seq)),)


def generate(prefill, decode, prompt, steps: int, max_seq: int):
    """Greedy decoding with callables ``prefill(tokens)`` and ``decode(token, pos, k, v)``; returns token ids."""
    import numpy as np
    logits, k, v = prefill(prompt)
    tokens = [int(t) for t in np.asarray(prompt)[0]]
    nxt = int(np.asarray(logits)[0, -1].argmax())
    for step in range(steps):
        tokens.append(nxt)
        pos = len(tokens) - 1
        if step == steps - 1 or pos >= max_seq:
            break
        logits, k, v = decode(torch.tensor([[nxt]]), torch.tensor([pos]), _owned(k), _owned(v))
        nxt = int(np.asarray(logits)[0, -1].argmax())
    return tokens


def _owned(x) -> torch.Tensor:
    """A tensor of its own: runtimes give read-only numpy arrays, eager modules tensors."""
    import numpy as np
    return x.clone() if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, hidden)
        self.ff2 = nn.Linear(hidden, dim)
        self.ln2 = nn.LayerNorm(dim)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.ln1(x + self.o(y.transpose(1, 2).reshape(b, t, c)))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class BertEncoder(nn.Module):
    """A BERT-style encoder: token + position embeddings, post-LN blocks, padding mask, pooled output."""

    def __init__(self, vocab=1000, dim=128, heads=4, layers=2, hidden=256, max_seq=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.ln = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, hidden) for _ in range(layers))
        self.pool = nn.Linear(dim, dim)

    def forward(self, tokens, attention_mask):
        t = tokens.shape[1]
        x = self.ln(self.tok(tokens) + self.pos(torch.arange(t)))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e9
        for layer in self.layers:
            x = layer(x, mask)
        return x, torch.tanh(self.pool(x[:, 0]))


def bert_encoder(batch: int = 2, seq: int = 32, **config):
    """A BERT-style transformer encoder with a padding mask."""
    _seeded(0)
    model = BertEncoder(**config).eval()
    tokens = torch.randint(0, 1000, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq // 2:] = 0
    return model, (tokens, mask)


# ---- recommender ---------------------------------------------------------------------------

class DLRM(nn.Module):
    """DLRM: bottom MLP on dense features, embedding bags on sparse ones, pairwise dot interactions."""

    def __init__(self, dense=13, tables=(1000, 500, 200, 100), dim=16, bottom=(64, 16), top=(64, 32, 1)):
        super().__init__()
        layers, cin = [], dense
        for h in bottom:
            layers += [nn.Linear(cin, h), nn.ReLU()]
            cin = h
        self.bottom = nn.Sequential(*layers)
        self.embs = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in tables)
        n = len(tables) + 1
        cin = dim + n * (n - 1) // 2
        layers = []
        for i, h in enumerate(top):
            layers.append(nn.Linear(cin, h))
            if i < len(top) - 1:
                layers.append(nn.ReLU())
            cin = h
        self.top = nn.Sequential(*layers)
        iu = torch.triu_indices(n, n, offset=1)
        self.register_buffer("iu0", iu[0], persistent=False)
        self.register_buffer("iu1", iu[1], persistent=False)

    def forward(self, dense, indices, offsets):
        x = self.bottom(dense)
        feats = [x] + [emb(indices[i], offsets[i]) for i, emb in enumerate(self.embs)]
        t = torch.stack(feats, dim=1)  # (b, n, d)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.iu0, self.iu1]
        return torch.sigmoid(self.top(torch.cat([x, z], dim=1)))


def dlrm(batch: int = 8, per_bag: int = 3):
    """A DLRM-style recommender (embedding bags, MLPs, pairwise interactions)."""
    _seeded(0)
    model = DLRM().eval()
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, 13)
    indices = torch.stack([torch.randint(0, emb.num_embeddings, (batch * per_bag,), generator=g)
                           for emb in model.embs])
    offsets = torch.arange(0, batch * per_bag, per_bag).expand(len(model.embs), batch).contiguous()
    return model, (dense, indices, offsets)


# ---- diffusion UNet ------------------------------------------------------------------------

def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    ang = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.n1 = nn.GroupNorm(8, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2 = nn.GroupNorm(8, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(F.silu(temb))[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        return h + self.skip(x)


class AttnBlock(nn.Module):
    def __init__(self, c, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(8, c)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        y = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.proj(y.transpose(-1, -2).reshape(b, c, h, w))


class UNet(nn.Module):
    """A diffusion-style UNet: timestep embedding, ResBlocks, a mid attention block, skips,
    strided-conv downsampling, ConvTranspose2d and nearest upsampling."""

    def __init__(self, cin=3, base=32, tdim=64):
        super().__init__()
        self.tdim = tdim
        self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(cin, base, 3, padding=1)
        self.d1 = ResBlock(base, base, tdim)
        self.down1 = nn.Conv2d(base, base, 3, stride=2, padding=1)
        self.d2 = ResBlock(base, 2 * base, tdim)
        self.down2 = nn.Conv2d(2 * base, 2 * base, 3, stride=2, padding=1)
        self.mid = ResBlock(2 * base, 2 * base, tdim)
        self.attn = AttnBlock(2 * base)
        self.up2 = nn.ConvTranspose2d(2 * base, 2 * base, 4, stride=2, padding=1)
        self.u2 = ResBlock(4 * base, base, tdim)
        self.u1 = ResBlock(2 * base, base, tdim)
        self.out_norm = nn.GroupNorm(8, base)
        self.out = nn.Conv2d(base, cin, 3, padding=1)

    def forward(self, x, t):
        temb = self.temb(timestep_embedding(t, self.tdim))
        h0 = self.d1(self.inp(x), temb)
        h1 = self.d2(self.down1(h0), temb)
        h = self.attn(self.mid(self.down2(h1), temb))
        h = self.u2(torch.cat([self.up2(h), h1], 1), temb)
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = self.u1(torch.cat([h, h0], 1), temb)
        return self.out(F.silu(self.out_norm(h)))


def unet(batch: int = 1, size: int = 32):
    """A small diffusion UNet on 32x32 images."""
    _seeded(0)
    return UNet().eval(), (torch.randn(batch, 3, size, size), torch.tensor([10] * batch, dtype=torch.int64))


ZOO = {
    "resnet18": resnet18, "resnet50": resnet50, "mobilenet_v2": mobilenet_v2, "small_cnn": small_cnn,
    "gpt": gpt, "llama": llama, "qwen3": qwen3, "bert_encoder": bert_encoder, "dlrm": dlrm, "unet": unet,
}
