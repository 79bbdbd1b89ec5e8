"""``torchtpu-export inspect``: what an artifact holds, as a dict (each target's describer) and as text."""
from __future__ import annotations

from .errors import InputError


def describe(path: str, topologies=None) -> dict:
    """What the artifact at ``path`` holds; for a .tpu with ``topologies``, also what the TPU compiler
    says about each program on them (compiled here with libtpu, nothing written)."""
    from . import targets
    target = targets.for_file(path)
    if target is None:
        raise InputError(f"{path} is a model file, not an artifact; convert it first")
    return target.describe(path, topologies)


def _io_line(d: dict) -> str:
    return f"{d['name']}: {d['dtype']}[{', '.join(str(x) for x in d['shape'])}]"


def format_description(desc: dict) -> str:
    lines = [f"{desc['path']}: {desc['kind']} artifact, {desc['size']:,} bytes"]
    if desc.get("versions"):
        lines.append("made with " + ", ".join(f"{k} {v}" for k, v in sorted(desc["versions"].items())))
    if desc.get("platforms"):
        lines.append("platforms: " + ", ".join(desc["platforms"]))
    if desc.get("mesh"):
        axes = desc["mesh"]["axes"]
        lines.append(f"mesh: {', '.join(f'{a}={n}' for a, n in axes)} ({desc['mesh']['devices']} devices)")
    for topo, size in (desc.get("topologies") or {}).items():
        lines.append(f"topology {topo}: {size['chips']} chip{'s' if size['chips'] != 1 else ''} on {size['hosts']} "
                     f"host{'s' if size['hosts'] != 1 else ''}")
    llm = desc.get("llm")
    if llm:  # an export_llm .tpu: what the serving engine and server read
        lines.append(f"llm {llm.get('name', '?')}: cache {llm['cache_length']} positions, prefill lengths "
                     f"{', '.join(map(str, llm['prefill_lengths']))}, {llm.get('slots', 1)} decode slot(s), "
                     + (f"tokenizer (stop ids {llm.get('stop_ids', [])}, chat template "
                        f"{'yes' if llm.get('chat_template') else 'no'})" if llm.get("tokenizer") else "no tokenizer"))
    weights = desc.get("weights") or {}
    if weights.get("count") is not None:
        lines.append(f"weights: {weights['count']} tensors, {weights.get('bytes', 0):,} bytes"
                     + (f" ({weights['abstract']} abstract: shapes only, values bound at load with bind_weights)"
                        if weights.get("abstract") else ""))
    for name, prog in desc.get("programs", {}).items():
        lines.append(f"{desc.get('unit', 'program')} {name}:")
        lines += ["  input  " + _io_line(i) for i in prog["inputs"]]
        lines += ["  output " + _io_line(o) for o in prog["outputs"]]
        lines += ["  state  " + _io_line(st) + " (a buffer changed in place: kept on the device between calls)"
                  for st in prog.get("state") or []]
        hist = prog.get("op_histogram") or {}
        if hist:
            lines.append(f"  ops ({sum(hist.values())}): " + ", ".join(f"{k} {v}" for k, v in
                                                                   sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))))
        for k in prog.get("kernels") or []:
            what = k.get("kernel") or f"xla ({k.get('reason', 'no kernel')})"
            if k.get("kernel") and k.get("detail"):
                what += f" ({k['detail']})"
            lines.append(f"  kernel [{k.get('platform', '?')}] {k.get('node', '?')} ({k.get('op', '?')}): {what}")
        for topo, entry in (prog.get("compiled") or {}).items():
            from .targets.tpu.aot import describe_stats
            stored = "executable stored" if entry.get("executable") else entry.get("executable_reason", "not stored")
            lines.append(f"  compiled [{topo}, {entry.get('device_kind')}, libtpu {entry.get('libtpu')}, {stored}]: "
                         + describe_stats(entry["stats"]))
        plan = prog.get("sharding")
        if plan:
            sharded = {w: s for w, s in plan["weights"].items() if any(s)}
            lines.append(f"  sharding {plan['mode']}: {len(plan['column_parallel'])} column-parallel, "
                         f"{len(plan['row_parallel'])} row-parallel, {len(plan['weights']) - len(sharded)} replicated")
            lines += [f"  shard {w}: [{', '.join(a or '-' for a in s)}]" for w, s in sorted(sharded.items())]
            names = [i["name"] for i in prog.get("inputs", [])]
            lines += [f"  shard input {names[i] if i < len(names) else i}: [{', '.join(a or '-' for a in s)}]"
                      for i, s in enumerate(plan["inputs"]) if any(s)]
            lines += [f"  shard output {i}: [{', '.join(a or '-' for a in s)}]"
                      for i, s in enumerate(plan.get("outputs", [])) if any(s)]
    if desc.get("entries"):
        lines.append("entries:")
        lines += [f"  {n}: {s:,} bytes" for n, s in sorted(desc["entries"].items())]
    for extra in desc.get("extra_lines", []):
        lines.append(extra)
    from .untrusted import printable
    return "\n".join(printable(line) for line in lines)  # names come from the file: no terminal controls
