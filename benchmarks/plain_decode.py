"""A plain JAX decode step, written by hand, to hold the exported one against.

The straightforward step a JAX user would write for a Llama/Qwen3-shaped decoder: embedding
lookup, per layer RMSNorm, q/k/v projections (Qwen3's per-head q/k norms), rotary embedding,
the new token's k and v written into the cache in place (a scatter at each row's position,
the cache donated), einsum attention over the whole cache under the additive mask, SwiGLU MLP,
final norm and LM head. Same inputs as the exported ``decode`` / ``decode_batch`` (tokens
``[B, 1]``, ``input_pos [B]``, mask ``[B, 1, 1, S]``, caches ``[B, Hkv, S, D]`` per layer), same
dtypes, abstract weights: it is only compiled, never run, so no weights are needed.

    compiled = compile_plain_decode(config, batch=16, cache=256, topology="v5e:2x2", dtype="float32")
    stats(compiled, generation("v5e:2x2"))["bytes_accessed"]
"""
from __future__ import annotations


def _get(config, name, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def plain_decode_step(config):
    """The step as a function of (params, tokens, input_pos, mask, caches) -> (logits, caches)."""
    import jax
    import jax.numpy as jnp

    heads = config.num_attention_heads
    kv_heads = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "head_dim", config.hidden_size // heads)
    eps = _get(config, "rms_norm_eps", 1e-6)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", _get(config, "rope_theta", 10000.0)))
    qk_norm = config.model_type == "qwen3"

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype) * w

    def rotate(x, cos, sin):  # x [B, H, D]; cos/sin [B, 1, D/2]
        a, b = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)

    def step(params, tokens, input_pos, mask, caches):
        batch = tokens.shape[0]
        x = params["embed"][tokens[:, 0]]                                       # [B, hidden]
        inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
        angle = input_pos.astype(jnp.float32)[:, None, None] * inv              # [B, 1, D/2]
        cos, sin = jnp.cos(angle), jnp.sin(angle)
        rows = jnp.arange(batch)
        new_caches = []
        for layer, (k_cache, v_cache) in zip(params["layers"], caches):
            h = rms(x, layer["input_norm"])
            q = (h @ layer["q"].T).reshape(batch, heads, head_dim)
            k = (h @ layer["k"].T).reshape(batch, kv_heads, head_dim)
            v = (h @ layer["v"].T).reshape(batch, kv_heads, head_dim)
            if qk_norm:
                q, k = rms(q, layer["q_norm"]), rms(k, layer["k_norm"])
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k_cache = k_cache.at[rows, :, input_pos].set(k.astype(k_cache.dtype))
            v_cache = v_cache.at[rows, :, input_pos].set(v.astype(v_cache.dtype))
            new_caches.append((k_cache, v_cache))
            qg = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
            scores = jnp.einsum("bgrd,bgsd->bgrs", qg, k_cache, preferred_element_type=jnp.float32)
            scores = scores * head_dim ** -0.5 + mask[:, :, 0, :][:, :, None, :].astype(jnp.float32)
            probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
            out = jnp.einsum("bgrs,bgsd->bgrd", probs, v_cache).reshape(batch, heads * head_dim).astype(x.dtype)
            x = x + out @ layer["o"].T
            h = rms(x, layer["post_norm"])
            x = x + (jax.nn.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T
        logits = rms(x, params["norm"]) @ params["lm_head"].T
        return logits[:, None, :], new_caches

    return step


def abstract_params(config, dtype):
    """The step's parameters as ShapeDtypeStructs (HF's [out, in] layout)."""
    import jax
    heads = config.num_attention_heads
    kv_heads = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "head_dim", config.hidden_size // heads)
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size

    def w(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = dict(input_norm=w(hidden), post_norm=w(hidden), q=w(heads * head_dim, hidden),
                 k=w(kv_heads * head_dim, hidden), v=w(kv_heads * head_dim, hidden), o=w(hidden, heads * head_dim),
                 gate=w(inter, hidden), up=w(inter, hidden), down=w(hidden, inter))
    if config.model_type == "qwen3":
        layer.update(q_norm=w(head_dim), k_norm=w(head_dim))
    embed = w(vocab, hidden)
    return dict(embed=embed, norm=w(hidden), layers=[dict(layer) for _ in range(config.num_hidden_layers)],
                lm_head=embed if getattr(config, "tie_word_embeddings", False) else w(vocab, hidden))


def compile_plain_decode(config, *, batch: int, cache: int, topology: str, dtype: str = "float32",
                         cache_dtype: str | None = None):
    """The plain step compiled by libtpu for one chip of ``topology``, ahead of time, caches donated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from torchtpu_export.targets.tpu import aot

    aot.require_libtpu("compiling the plain JAX decode step")
    device = SingleDeviceSharding(aot.devices_for(topology, 1)[0])
    heads = config.num_attention_heads
    kv_heads = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "head_dim", config.hidden_size // heads)

    def on_chip(s):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device)

    params = jax.tree.map(on_chip, abstract_params(config, jnp.dtype(dtype)))
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:
        params.pop("lm_head")
    kv = jax.ShapeDtypeStruct((batch, kv_heads, cache, head_dim), jnp.dtype(cache_dtype or dtype), sharding=device)
    caches = [(kv, kv) for _ in range(config.num_hidden_layers)]
    tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=device)
    pos = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=device)
    mask = jax.ShapeDtypeStruct((batch, 1, 1, cache), jnp.float32, sharding=device)
    step = plain_decode_step(config)

    def run(params, tokens, input_pos, mask, caches):
        if tied:
            params = dict(params, lm_head=params["embed"])
        return step(params, tokens, input_pos, mask, caches)

    with jax.enable_x64(False):
        return jax.jit(run, donate_argnums=(4,)).trace(params, tokens, pos, mask, caches).lower(
            lowering_platforms=("tpu",)).compile()


# ---- the table: kernels vs XLA per program, and the decode steps vs the plain step ---------------------

CONFIGS = {  # name -> (family, HF config, slots, cache, prefill lengths, abstract weights)
    "llama-30m": ("llama", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024),
                  16, 256, (16, 64), False),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960, tie_word_embeddings=True),
                   8, 1024, (128,), True),
}


def _model(family: str, config: dict, abstract: bool):
    import torch
    import transformers

    import torchtpu_export as tte
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    if abstract:
        with tte.abstract_weights():
            return cls[1](cls[0](**config)).eval()
    return cls[1](cls[0](**config)).eval()


def measure(name: str, topologies: list[str]) -> dict:
    import time

    import torchtpu_export as tte
    from torchtpu_export.llm.plan import DECODE, DECODE_BATCH
    from torchtpu_export.targets.tpu import aot
    family, config, slots, cache, lengths, abstract = CONFIGS[name]
    model = _model(family, config, abstract)
    t0 = time.perf_counter()
    prog = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache, batch_size=slots,
                          platforms=("tpu",), check=False)
    export_s = time.perf_counter() - t0
    programs = {sig: prog.manifest["programs"][sig].get("kernel_cost") for sig in prog.signatures}
    steps = []
    for sig, batch in ((DECODE, 1), (DECODE_BATCH, slots)):
        row = dict(program=sig, batch=batch)
        for topology in topologies:
            ours = prog.compiled_stats(topology, signature_name=sig)["bytes_accessed"]
            plain = aot.stats(compile_plain_decode(model.config, batch=batch, cache=cache, topology=topology),
                              aot.generation(topology))["bytes_accessed"]
            row[topology] = (ours, plain)
        steps.append(row)
        print(name, row, flush=True)
    return dict(name=name, slots=slots, cache=cache, abstract=abstract, export_s=export_s, programs=programs,
                steps=steps, layers=config["num_hidden_layers"])


def text(results: list[dict], topologies: list[str], args) -> str:
    import datetime
    import os
    lines = [f"# Kernels vs XLA, and the decode step vs a plain JAX step ({datetime.date.today()}, compiled ahead "
             f"of time by libtpu on {os.cpu_count()} CPU cores, float32)", "",
             f"`python -m benchmarks.plain_decode --configs {args.configs} --topologies {args.topologies}`", "",
             "Bytes accessed per call, from libtpu's cost analysis (it counts staging through on-chip memory "
             "too: a comparison between programs of one model, not HBM traffic). `kernels` / `XLA`: each "
             "program compiled whole with its Pallas kernels and lowered by XLA alone, as `export` "
             "compares them (kernels=\"auto\", v5e); `kept`: what the artifact holds. `plain JAX`: "
             "benchmarks/plain_decode.py, the straightforward step (in-place cache scatter, einsum attention).", ""]
    for r in results:
        lines += [f"## {r['name']} ({r['layers']} layers, {r['slots']} slots, cache {r['cache']}"
                  f"{', abstract weights' if r['abstract'] else ''}; export {r['export_s']:.0f} s)", "",
                  "| program | kernels (MB) | XLA (MB) | kept |", "|---|---:|---:|---|"]
        for sig, cost in r["programs"].items():
            if not cost or cost.get("not_compared"):
                lines.append(f"| {sig} | - | - | {'no kernel fits' if not cost else cost['not_compared']} |")
                continue
            t = next(iter(cost["pallas"]))
            lines.append(f"| {sig} | {cost['pallas'][t] / 1e6:.1f} | {cost['xla'][t] / 1e6:.1f} | {cost['kept']} |")
        lines += ["", "| step | batch | " + " | ".join(f"{t} ours (MB) | {t} plain JAX (MB) | {t} ours / plain"
                                                       for t in topologies) + " |",
                  "|---|---:|" + "---:|---:|---:|" * len(topologies)]
        for s in r["steps"]:
            cells = [f"{s[t][0] / 1e6:.1f} | {s[t][1] / 1e6:.1f} | {s[t][0] / s[t][1]:.3f}" for t in topologies]
            lines.append(f"| {s['program']} | {s['batch']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    import argparse
    import sys

    from benchmarks import publish
    p = argparse.ArgumentParser(description="kernels vs XLA per program, and the decode step vs a plain JAX step")
    p.add_argument("--configs", default="llama-30m,qwen3-0.6b")
    p.add_argument("--topologies", default="v5e:2x2,v6e:2x2")
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    topologies = [t for t in args.topologies.split(",") if t]
    results = [measure(name, topologies) for name in args.configs.split(",") if name]
    sys.stdout.flush()
    return publish(text(results, topologies, args), args.output)


if __name__ == "__main__":
    raise SystemExit(main())
