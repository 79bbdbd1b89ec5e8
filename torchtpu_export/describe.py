"""``torchtpu-export inspect``: what an artifact holds, as a dict (each target's describer) and as text."""
from __future__ import annotations

from . import targets
from .errors import InputError


def describe(path: str, topologies=None) -> dict:
    """What the artifact at ``path`` holds; for a .tpu with ``topologies``, also what the TPU compiler
    says about each program on them (compiled here with libtpu, nothing written)."""
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
    own = targets.get(desc["kind"]).describe_lines if desc.get("kind") in targets.NAMES else None
    if own is not None:
        lines += own(desc, None)
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
        if own is not None:
            lines += own(desc, name)
    if desc.get("entries"):
        lines.append("entries:")
        lines += [f"  {n}: {s:,} bytes" for n, s in sorted(desc["entries"].items())]
    for extra in desc.get("extra_lines", []):
        lines.append(extra)
    from .untrusted import printable
    return "\n".join(printable(line) for line in lines)  # names come from the file: no terminal controls
