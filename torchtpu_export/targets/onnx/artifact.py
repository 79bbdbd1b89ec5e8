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

from ...errors import ArtifactError
from ...fileio import write_bytes_atomic
from ...specs import TensorSpec
from ...untrusted import load_json

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
    path: str | None = None  # the file it was read from: ONNX Runtime loads that (external data beside it)

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


def _graph_specs(values, path: str) -> list[TensorSpec]:
    import onnx
    from ...specs import NP_DTYPES
    specs = []
    for v in values:
        t = v.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim)
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else "float32"
        except (KeyError, ValueError, TypeError):
            dtype = None
        if dtype not in NP_DTYPES:
            raise ArtifactError(f"{path}: {v.name[:80]!r} is a tensor of ONNX type {t.elem_type}, which "
                                "torchtpu-export does not run")
        specs.append(TensorSpec(v.name, shape, dtype))
    return specs


MAX_MODEL_BYTES = 2 << 30  # protobuf's limit: larger models keep their weights as external data


def read(path: str | os.PathLike) -> OnnxArtifact:
    import onnx
    path = os.fspath(path)
    try:
        if os.path.getsize(path) > MAX_MODEL_BYTES:
            raise ArtifactError(f"{path} is larger than an ONNX protobuf can be (2 GB)")
        with open(path, "rb") as f:
            data = f.read()
        model = onnx.load_from_string(data)
    except OSError as e:
        raise ArtifactError(f"cannot read {path}: {e.strerror}") from e
    except ArtifactError:
        raise
    except Exception as e:  # protobuf's DecodeError and friends
        raise ArtifactError(f"{path} is not a valid ONNX model ({type(e).__name__})") from e
    check_external_data(model, path)
    texts = [p.value for p in model.metadata_props if p.key == METADATA_KEY]
    if not texts:
        return OnnxArtifact(data, _graph_specs(_real_inputs(model), path), _graph_specs(model.graph.output, path),
                            path=path)
    meta = load_json(texts[0], f"{path}: its {METADATA_KEY} metadata")
    problem = _metadata_problem(meta)
    if problem:
        raise ArtifactError(f"{path}: its {METADATA_KEY} metadata is malformed: {problem}",
                            hint="export the model again")
    return OnnxArtifact(data, [TensorSpec.from_json(d) for d in meta["inputs"]],
                        [TensorSpec.from_json(d) for d in meta["outputs"]], meta["in_spec"], meta["out_spec"],
                        {int(k): v for k, v in meta.get("constant_inputs", {}).items()}, meta.get("op_histogram", {}),
                        path=path)


def _metadata_problem(meta) -> str | None:
    from ...specs import call_metadata_problem
    from ...untrusted import Count, MapOf, Record
    return Record({}, {"op_histogram": MapOf(Count())}).problem(meta) or call_metadata_problem(meta)


def check_external_data(model, path: str) -> None:
    """Every tensor whose data lies in another file names a file inside the model's own folder
    (no absolute path, no "..", no link out of it), and a span within that file: ONNX Runtime
    would otherwise read whatever file the model names into its weights."""
    from onnx.external_data_helper import _get_all_tensors
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    for tensor in _get_all_tensors(model):
        if tensor.data_location != onnx_external():
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        target = os.path.realpath(os.path.join(folder, location))
        if not location or os.path.isabs(location) or ".." in location.replace("\\", "/").split("/") \
                or os.path.commonpath([folder, target]) != folder:
            raise ArtifactError(f"{path}: tensor {tensor.name[:80]!r} takes its data from {location[:120]!r}, "
                                "outside the model's folder; refused",
                                hint="external data must lie beside the model (onnx.save(..., location='x.data'))")
        if not os.path.isfile(target):
            raise ArtifactError(f"{path}: tensor {tensor.name[:80]!r}'s data file {location[:120]!r} is missing")
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
        except ValueError:
            raise ArtifactError(f"{path}: tensor {tensor.name[:80]!r} has a malformed external data span") from None
        size = os.path.getsize(target)
        if offset < 0 or offset > size or (length >= 0 and offset + length > size):
            raise ArtifactError(f"{path}: tensor {tensor.name[:80]!r}'s external data lies past the end of "
                                f"{location[:120]!r}")


def onnx_external() -> int:
    import onnx
    return onnx.TensorProto.EXTERNAL


def _real_inputs(model):
    initializers = {i.name for i in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]
