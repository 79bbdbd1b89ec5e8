"""The onnx target: a peer column of the coverage matrix, and a deployment target of its own.

- converter: ``converters/onnx`` (``torch.onnx.export(dynamo=True)`` of the captured program);
- artifact: ``.onnx`` (``onnx_format``: the model, with the call structure as metadata);
- runtime: ``runtimes/onnx`` (ONNX Runtime, CPU execution provider);
- runnable: :class:`OnnxProgram`; describer: :func:`describe`.
"""
from __future__ import annotations

import os

import numpy as np

from . import artifact as onnx_format
from ...errors import ArtifactError
from ..base import Runnable, Target, no_topologies


class OnnxProgram(Runnable):
    """An ``.onnx`` artifact: ``prog(*args)`` runs it on ONNX Runtime and returns numpy arrays in the
    model's output structure (flat for ONNX files made elsewhere); ``save`` writes it atomically."""

    def __init__(self, artifact: onnx_format.OnnxArtifact):
        self.artifact = artifact
        self._runner = None

    @property
    def signatures(self) -> list[str]:
        return ["main"]

    def _call_metadata(self, sig: str) -> dict | None:
        art = self.artifact
        if art.in_spec is None:
            return None
        return {"inputs": [s.to_json() for s in art.inputs], "outputs": [s.to_json() for s in art.outputs],
                "in_spec": art.in_spec, "out_spec": art.out_spec, "constant_inputs": art.constant_inputs}

    def _io(self, sig: str):
        return self.artifact.inputs, self.artifact.outputs

    def _run(self, sig: str, inputs: list) -> list[np.ndarray]:
        if self._runner is None:
            from ...runtimes.onnx import OnnxRunner
            # from its file when it has one, so that external data resolves beside it (checked on read)
            art = self.artifact
            self._runner = OnnxRunner(art.path if art.path is not None else art.model, art.inputs, art.outputs)
        return self._runner.run(inputs)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the ``.onnx`` file atomically."""
        self.artifact.save(path)

    def __repr__(self) -> str:
        return f"OnnxProgram(inputs={[str(s) for s in self.artifact.inputs]})"


def build(captures: dict, options: dict) -> OnnxProgram:
    from ... import converters
    return OnnxProgram(converters.converter(TARGET.converter).convert(captures, **options))


def load(path) -> OnnxProgram:
    return OnnxProgram(onnx_format.read(path))


def describe(path: str, topologies=None) -> dict:
    import onnx
    no_topologies(topologies)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:
        raise ArtifactError(f"cannot read {path} as ONNX ({type(e).__name__}: {str(e)[:200]})") from e

    def io(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
            try:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else "?"
            except (KeyError, ValueError, TypeError):
                dtype = f"onnx type {t.elem_type}"
            out.append({"name": v.name, "shape": shape, "dtype": dtype})
        return out

    hist: dict[str, int] = {}
    for node in model.graph.node:
        hist[node.op_type] = hist.get(node.op_type, 0) + 1
    return {"path": path, "kind": "onnx", "size": os.path.getsize(path),
            "programs": {"main": {"inputs": io(model.graph.input), "outputs": io(model.graph.output),
                                  "op_histogram": dict(sorted(hist.items()))}}}


def cli_options(args, sample_args, sample_kwargs) -> dict:
    return {}


TARGET = Target(
    name="onnx", summary="ONNX models (.onnx), run on ONNX Runtime: the peer column of the coverage matrix",
    converter="onnx", runtime="onnx", suffix=".onnx", runnable=OnnxProgram, signature="main",
    build=build, load=load, describe=describe, cli_options=cli_options,
    multi_signature=False, debuggable=False,
)
