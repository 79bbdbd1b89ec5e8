"""Modules that keep state as buffers and change it in place (a KV cache registered as a buffer): the tpu
target keeps those buffers on the device between calls, each call donating them and keeping their new
values (the TPU compiler aliases them in place); programs of one module share them by name. Other
targets refuse such modules by name."""
import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchtpu_export as tte


class Counter(torch.nn.Module):
    """Writes a projection of x into a cache buffer at ``pos``; returns the cache's sum times the step count."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(8, 4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, self.lin(x))
        self.steps.add_(1)
        return self.cache.sum(0) * self.steps


class BufferCacheDecoder(torch.nn.Module):
    """A one-layer decoder whose KV cache is a pair of buffers written at ``input_pos``, as
    transformers' static caches and many hand-written models keep it."""

    def __init__(self, vocab=64, dim=32, heads=2, cache=16):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("k_cache", torch.zeros(1, heads, cache, dim // heads))
        self.register_buffer("v_cache", torch.zeros(1, heads, cache, dim // heads))

    def forward(self, tokens, input_pos):
        b, n = tokens.shape
        q, k, v = self.qkv(self.emb(tokens)).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        visible = torch.arange(self.k_cache.shape[2])[None, :] <= input_pos[:, None]  # [n, cache]
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=visible)
        return self.head(self.out(y.transpose(1, 2).reshape(b, n, -1)))[:, -1]


def test_buffers_changed_in_place_persist_between_calls_on_the_device(tmp_path):
    torch.manual_seed(0)
    model = Counter().eval()
    eager = copy.deepcopy(model)
    prog = tte.export(model, (torch.randn(1, 4), torch.tensor([0])), platforms=("tpu", "cpu"))
    spec = prog.manifest["programs"]["main"]
    assert [s["name"] for s in spec["inputs"]] == ["x", "pos"]  # the state is not the caller's to pass
    assert [(s["name"], s["shape"], s["dtype"]) for s in spec["state"]] == [("cache", [8, 4], "float32"),
                                                                              ("steps", [], "int64")]
    for t in range(3):
        x = torch.randn(1, 4)
        with torch.no_grad():
            want = eager(x, torch.tensor([t])).numpy()
        np.testing.assert_allclose(np.asarray(prog(x, torch.tensor([t]))), want, rtol=1e-5, atol=1e-6)
    assert all(isinstance(v, jax.Array) for v in prog._state.values())  # kept on the device
    assert int(prog.state["steps"]) == 3
    np.testing.assert_allclose(prog.state["cache"], eager.cache.numpy(), rtol=1e-6)
    assert int(model.steps) == 0  # exporting ran nothing on the module
    prog.reset_state()
    assert int(prog.state["steps"]) == 0 and not prog.state["cache"].any()
    path = tmp_path / "counter.tpu"
    prog.save(path)
    loaded = tte.load(path)  # starts from the values the module had at export
    np.testing.assert_allclose(np.asarray(loaded(torch.ones(1, 4), torch.tensor([2]))),
                               (model.lin(torch.ones(1, 4))[0] * 1).detach().numpy(), rtol=1e-5)


def test_a_decoder_with_its_kv_cache_in_buffers_generates_like_eager():
    """Prefill and decode programs of one module share its cache buffers; the compiled decode step
    aliases them in place."""
    torch.manual_seed(0)
    model = BufferCacheDecoder().eval()
    eager = copy.deepcopy(model)
    prompt = torch.randint(0, 64, (1, 5))
    prog = (tte.signature("prefill", model, (prompt, torch.arange(5)))
            .signature("decode", model, (prompt[:, :1], torch.tensor([5])))
            .export(target="tpu", platforms=("tpu", "cpu")))

    def greedy(step):
        out = [int(step("prefill", prompt, torch.arange(5)).argmax(-1))]
        for i in range(8):
            out.append(int(step("decode", torch.tensor([[out[-1]]]), torch.tensor([5 + i])).argmax(-1)))
        return out

    with torch.no_grad():
        want = greedy(lambda sig, *a: eager(*a))
    got = greedy(lambda sig, *a: torch.from_numpy(np.array(prog(*a, signature_name=sig))))
    assert got == want
    np.testing.assert_allclose(prog.state["k_cache"], eager.k_cache.numpy(), rtol=1e-4, atol=1e-5)
    state_bytes = 2 * model.k_cache.numel() * 4
    stats = prog.compiled_stats("v5e", signature_name="decode")
    assert stats["hbm_bytes"]["aliased"] >= state_bytes


def test_targets_without_state_refuse_by_buffer_name(cli, tmp_path):
    model = Counter().eval()
    args = (torch.randn(1, 4), torch.tensor([0]))
    for target in ("litert", "onnx"):
        with pytest.raises(tte.CaptureError, match=r"changes state in place during forward \(cache, steps\)"):
            tte.export(model, args, target=target)
    prog = tte.export(model, args, platforms=("cpu",))
    prog.save(tmp_path / "c.tpu")
    r = cli("inspect", tmp_path / "c.tpu")
    assert r.returncode == 0, r.stderr
    assert "state  cache: float32[8, 4] (a buffer changed in place" in r.stdout


def test_state_of_a_sharded_program_is_split_as_given():
    """State is an input and an output like others: input_shardings names it ("state.<buffer>"), and the
    buffers stay split over the devices between calls."""
    import os
    import subprocess
    import sys
    script = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import copy, numpy as np, torch, torchtpu_export as tte
from test_state import BufferCacheDecoder
torch.manual_seed(0)
m = BufferCacheDecoder().eval(); eager = copy.deepcopy(m)
prompt = torch.randint(0, 64, (1, 5))
split = [None, "model", None, None]
prog = tte.export(m, (prompt, torch.arange(5)), platforms=("cpu",), mesh=(("data", 1), ("model", 2)),
                  input_shardings={"state.k_cache": split, "state.v_cache": split})
for t in range(2):
    with torch.no_grad():
        want = eager(prompt, torch.arange(5)).numpy()
    assert np.abs(np.asarray(prog(prompt, torch.arange(5))) - want).max() < 1e-5
assert all(tuple(v.sharding.spec)[:2] == (None, 'model') for v in prog._state.values()), prog._state
print("ok")
"""
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=here,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=here))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
