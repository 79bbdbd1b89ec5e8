"""``torchtpu-export inspect``: what an artifact holds, as a dict and as text."""
from __future__ import annotations

import os
import zipfile

from .errors import ArtifactError, InputError


def describe(path: str, topologies=None) -> dict:
    """What the artifact at ``path`` holds; for a .tpu with ``topologies``, also what the TPU compiler
    says about each program on them (compiled here with libtpu, nothing written)."""
    from .models import sniff_model
    kind = sniff_model(path)
    if topologies and kind != "tpu":
        raise InputError("--topology applies to .tpu artifacts")
    if kind == "tpu":
        return describe_tpu(path, topologies)
    if kind == "litert":
        from .litert_format import describe
        return describe(path)
    if kind == "onnx":
        return describe_onnx(path)
    raise InputError(f"{path} is a {kind} file, not an artifact; convert it first")


def describe_tpu(path: str, topologies=None) -> dict:
    from . import tpu_compile, tpu_format
    art = tpu_format.read(path)
    for topo in tpu_compile.parse_topologies(topologies) if topologies else ():
        tpu_compile.require_libtpu("--topology")
        tpu_compile.compile_artifact(art, topo, store=False)
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: i.file_size for i in zf.infolist()}
    m = art.manifest
    programs = {}
    for name, spec in m["programs"].items():
        programs[name] = {
            "inputs": spec["inputs"], "outputs": spec["outputs"],
            "platforms": sorted(spec["files"]),
            "weights": len(spec["weights"]),
            "op_histogram": spec.get("op_histogram", {}),
            "kernels": spec.get("kernels", []),
            "narrow_64bit": spec.get("narrow_64bit", False),
            "sharding": spec.get("sharding"),
            "compiled": {topo: per[name] for topo, per in sorted(m.get("compiled", {}).items()) if name in per},
        }
    return {
        "path": path, "kind": "tpu", "size": os.path.getsize(path), "format_version": m["format_version"],
        "versions": m.get("versions", {}), "platforms": m.get("platforms", []), "programs": programs,
        "weights": m.get("weights", {}), "entries": entries, "mesh": m.get("mesh"),
    }


def describe_onnx(path: str) -> dict:
    import onnx
    try:
        model = onnx.load(path)
    except Exception as e:
        raise ArtifactError(f"cannot read {path} as ONNX ({type(e).__name__}: {str(e)[:200]})") from e

    def io(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
            out.append({"name": v.name, "shape": shape,
                        "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else "?"})
        return out

    hist: dict[str, int] = {}
    for node in model.graph.node:
        hist[node.op_type] = hist.get(node.op_type, 0) + 1
    return {"path": path, "kind": "onnx", "size": os.path.getsize(path),
            "programs": {"main": {"inputs": io(model.graph.input), "outputs": io(model.graph.output),
                                  "op_histogram": dict(sorted(hist.items()))}}}


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
    weights = desc.get("weights") or {}
    if weights.get("count") is not None:
        lines.append(f"weights: {weights['count']} tensors, {weights.get('bytes', 0):,} bytes")
    for name, prog in desc.get("programs", {}).items():
        lines.append(f"{'signature' if desc['kind'] == 'litert' else 'program'} {name}:")
        lines += ["  input  " + _io_line(i) for i in prog["inputs"]]
        lines += ["  output " + _io_line(o) for o in prog["outputs"]]
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
            from .tpu_compile import describe_stats
            stored = "executable stored" if entry.get("executable") else entry.get("executable_reason", "not stored")
            lines.append(f"  compiled [{topo}, {entry.get('device_kind')}, libtpu {entry.get('libtpu')}, {stored}]: "
                         + describe_stats(entry["stats"]))
        plan = prog.get("sharding")
        if plan:
            sharded = {w: s for w, s in plan["weights"].items() if any(s)}
            lines.append(f"  sharding {plan['mode']}: {len(plan['column_parallel'])} column-parallel, "
                         f"{len(plan['row_parallel'])} row-parallel, {len(plan['weights']) - len(sharded)} replicated")
            lines += [f"  shard {w}: [{', '.join(a or '-' for a in s)}]" for w, s in sorted(sharded.items())]
            lines += [f"  shard input {i}: [{', '.join(a or '-' for a in s)}]" for i, s in enumerate(plan["inputs"])
                      if any(s)]
    if desc.get("entries"):
        lines.append("entries:")
        lines += [f"  {n}: {s:,} bytes" for n, s in sorted(desc["entries"].items())]
    for extra in desc.get("extra_lines", []):
        lines.append(extra)
    from .untrusted import printable
    return "\n".join(printable(line) for line in lines)  # names come from the file: no terminal controls
