"""The ``.onnx`` artifact: an ONNX model plus what torchtpu-export needs to call it like the module.

The model is what ``torch.onnx.export`` (dynamo) makes of the captured program. The call
structure (pytree specs, specialised non-tensor inputs) and the torch-side input/output specs
travel inside the model, as the metadata property ``torchtpu_export``, so ``tte.load("m.onnx")``
takes the module's own arguments. ONNX files from elsewhere load too: their graph inputs and
outputs are then the flat call signature.
"""
from __future__ import annotations

import dataclasses
import json
import os

from .errors import ArtifactError
from .fileio import write_bytes_atomic
from .specs import TensorSpec

METADATA_KEY = "torchtpu_export"


@dataclasses.dataclass
class OnnxArtifact:
    """A serialized ONNX model, its torch-side I/O specs and call structure."""

    model: bytes
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    in_spec: str | None = None
    out_spec: str | None = None
    constant_inputs: dict = dataclasses.field(default_factory=dict)
    op_histogram: dict = dataclasses.field(default_factory=dict)

    def metadata(self) -> dict:
        return {"inputs": [s.to_json() for s in self.inputs], "outputs": [s.to_json() for s in self.outputs],
                "in_spec": self.in_spec, "out_spec": self.out_spec,
                "constant_inputs": {str(k): v for k, v in self.constant_inputs.items()},
                "op_histogram": self.op_histogram}

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model (metadata included) atomically."""
        write_bytes_atomic(path, self.model)


def with_metadata(model_bytes: bytes, artifact_metadata: dict) -> bytes:
    """The model with the ``torchtpu_export`` metadata property set."""
    import onnx
    model = onnx.load_from_string(model_bytes)
    for prop in list(model.metadata_props):
        if prop.key == METADATA_KEY:
            model.metadata_props.remove(prop)
    model.metadata_props.add(key=METADATA_KEY, value=json.dumps(artifact_metadata))
    return model.SerializeToString()


def _graph_specs(values) -> list[TensorSpec]:
    import onnx
    specs = []
    for v in values:
        t = v.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else "float32"
        specs.append(TensorSpec(v.name, shape, dtype))
    return specs


def read(path: str | os.PathLike) -> OnnxArtifact:
    import onnx
    try:
        with open(path, "rb") as f:
            data = f.read()
        model = onnx.load_from_string(data)
    except OSError as e:
        raise ArtifactError(f"cannot read {os.fspath(path)}: {e.strerror}") from e
    except Exception as e:  # protobuf's DecodeError and friends
        raise ArtifactError(f"{os.fspath(path)} is not a valid ONNX model ({type(e).__name__})") from e
    meta = next((json.loads(p.value) for p in model.metadata_props if p.key == METADATA_KEY), None)
    if meta is None:
        return OnnxArtifact(data, _graph_specs(_real_inputs(model)), _graph_specs(model.graph.output))
    return OnnxArtifact(data, [TensorSpec.from_json(d) for d in meta["inputs"]],
                        [TensorSpec.from_json(d) for d in meta["outputs"]], meta.get("in_spec"), meta.get("out_spec"),
                        {int(k): v for k, v in meta.get("constant_inputs", {}).items()}, meta.get("op_histogram", {}))


def _real_inputs(model):
    initializers = {i.name for i in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]
