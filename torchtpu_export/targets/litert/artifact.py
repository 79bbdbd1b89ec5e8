"""The ``.tflite`` artifact: reading LiteRT flatbuffers, and what the converter hands over.

Converters write flatbuffers (``converters/litert/writer.py``); this module reads them for
everyone else: the signatures' tensors, the ``torchtpu_export`` metadata (call structure and a
digest of the weights), the operators, and the description ``inspect`` prints. It never runs
a model: ``edge.EdgeModel`` does, through ``runtimes/litert.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import weakref

from ... import flatbuf
from ...errors import ArtifactError
from ...specs import TensorSpec
from ...untrusted import load_json


@dataclasses.dataclass
class LiteRTArtifact:
    """A converted flatbuffer: its bytes, or (large models) a temporary file removed with the artifact.

    ``signatures`` holds each signature's call metadata (``CapturedProgram.call_metadata`` and its
    dynamic dims); ``quantization`` the recipe and weight sizes of a quantized model.
    """

    content: bytes | None
    signatures: dict
    quantization: dict | None = None
    path: str | None = None

    def __post_init__(self):
        if self.path is not None:
            weakref.finalize(self, _remove, self.path)

    def save(self, path) -> None:
        from ...fileio import atomic_open, link_atomic, write_bytes_atomic
        if self.content is not None:
            write_bytes_atomic(path, self.content)
            return
        with contextlib.suppress(OSError):  # linked into place, not copied (unless on another filesystem)
            link_atomic(self.path, path)
            return
        import shutil
        with atomic_open(path) as f, open(self.path, "rb") as src:
            shutil.copyfileobj(src, f, 8 << 20)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


METADATA_NAME = "torchtpu_export"
MAX_METADATA_BYTES = 16 << 20
# the metadata's "format" and "format_version": the converter writes them, read_metadata checks the version
FORMAT = "torchtpu_export.litert"
FORMAT_VERSION = 1  # 1: signatures, versions, weights_blake2b, quantization


def _schema():
    from ai_edge_litert import schema_py_generated as fb
    return fb


def type_name(code: int) -> str:
    """A TensorType code as our dtype name (``float32``, ``int8``, ``bfloat16``, ...)."""
    for name, value in vars(_schema().TensorType).items():
        if value == code and not name.startswith("_"):
            return name.lower()
    return str(code)


def _is_8_bit(code: int) -> bool:
    fb = _schema()
    return code in (fb.TensorType.UINT8, fb.TensorType.INT8)


def parse_model(content: bytes):
    """The flatbuffer's root Model table; ArtifactError if it is not one."""
    fb = _schema()
    if len(content) < 8 or content[4:8] != b"TFL3":
        raise ArtifactError("not a TFLite flatbuffer (no TFL3 identifier)")
    try:
        return fb.Model.GetRootAs(content, 0)
    except Exception as e:
        raise ArtifactError(f"cannot parse the TFLite flatbuffer ({type(e).__name__}: {e})") from e


# bytes per element of the tensor types whose data has a fixed size (others, e.g. STRING, are not checked)
_ITEMSIZE = {"float32": 4, "float16": 2, "int32": 4, "uint8": 1, "int64": 8, "bool": 1, "int16": 2,
             "complex64": 8, "int8": 1, "float64": 8, "complex128": 16, "uint64": 8, "uint32": 4, "uint16": 2,
             "bfloat16": 2}
_MAX_ELEMENTS = 2 ** 48


def validate(content) -> object:
    """The Model of a flatbuffer whose every index and span has been checked, before anything (LiteRT
    included) reads it: buffers inside the file, tensors' buffers, opcodes and tensor indices in
    range, shapes non-negative, constant data exactly the size its tensor's shape and type say.
    ArtifactError (exit 5) names the first problem."""
    model = parse_model(content)
    size = len(content)
    try:
        n_buffers, n_codes, n_subgraphs = model.BuffersLength(), model.OperatorCodesLength(), model.SubgraphsLength()
        data = [_checked_span(model.Buffers(i), i, size) for i in range(n_buffers)]
        if model.ExternalBufferGroupsLength() or model.ExternalBuffersLength():
            raise ValueError("it keeps weights in external files, which torchtpu-export does not open")
        for k in range(n_subgraphs):
            sub = model.Subgraphs(k)
            n_tensors = sub.TensorsLength()
            for j in range(n_tensors):
                _check_tensor(sub.Tensors(j), f"subgraph {k} tensor {j}", n_buffers, data,
                              lambda i: _buffer_span(model, content, i), content)
                _check_blockwise(sub.Tensors(j), f"subgraph {k} tensor {j}", n_tensors)
            for j in range(sub.OperatorsLength()):
                op = sub.Operators(j)
                if not 0 <= op.OpcodeIndex() < n_codes:
                    raise ValueError(f"subgraph {k} operator {j} has opcode index {op.OpcodeIndex()} of {n_codes}")
                for field in ("Inputs", "Outputs", "Intermediates"):
                    _check_indices(getattr(op, field + "AsNumpy")() if getattr(op, field + "Length")() else [],
                                   n_tensors, f"subgraph {k} operator {j} {field.lower()}", allow_absent=True)
            for field in ("Inputs", "Outputs"):
                _check_indices(getattr(sub, field + "AsNumpy")() if getattr(sub, field + "Length")() else [],
                               n_tensors, f"subgraph {k} {field.lower()}", allow_absent=False)
        keys = []
        for i in range(model.SignatureDefsLength()):
            sig = model.SignatureDefs(i)
            k = sig.SubgraphIndex()
            if not 0 <= k < n_subgraphs:
                raise ValueError(f"signature {i} names subgraph {k} of {n_subgraphs}")
            n_tensors = model.Subgraphs(k).TensorsLength()
            maps = [sig.Inputs(j) for j in range(sig.InputsLength())] + \
                [sig.Outputs(j) for j in range(sig.OutputsLength())]
            _check_indices([m.TensorIndex() for m in maps], n_tensors, f"signature {i}", allow_absent=False)
            # names LiteRT keys its runners by: text, each once per side
            for side, n in (("inputs", sig.InputsLength()), ("outputs", sig.OutputsLength())):
                names = [(getattr(sig, side.title())(j).Name() or b"").decode("utf-8") for j in range(n)]
                if len(set(names)) != len(names):
                    raise ValueError(f"signature {i} names two of its {side} alike")
            keys.append((sig.SignatureKey() or b"").decode("utf-8"))
        if len(set(keys)) != len(keys):
            raise ValueError("two signatures have the same key")
        for i in range(model.MetadataLength()):
            if not 0 <= model.Metadata(i).Buffer() < n_buffers:
                raise ValueError(f"metadata {i} names buffer {model.Metadata(i).Buffer()} of {n_buffers}")
    except ArtifactError:
        raise
    except Exception as e:  # a damaged table fails anywhere inside the generated readers
        raise ArtifactError(f"the TFLite flatbuffer is invalid: {type(e).__name__}: {str(e)[:200]}",
                            hint="convert or download the model again") from None
    return model


def _checked_span(buf, index: int, size: int) -> int:
    """The byte count of a buffer, after checking that it lies inside the file."""
    offset, n = buf.Offset(), buf.Size()
    if offset > 1:
        if offset + n > size:
            raise ValueError(f"buffer {index} spans bytes {offset}..{offset + n}, past the file's {size}")
        return n
    n = buf.DataLength()
    if n and flatbuf.vector_start(buf, 4) + n > size:
        raise ValueError(f"buffer {index} runs past the end of the file")
    return n


_TYPE_CODES: set | None = None


def _check_tensor(t, where: str, n_buffers: int, data: list, span, content) -> None:
    """One tensor: its buffer index, shape, type, and constant data as LiteRT will read it (dense
    data of the exact size; sparse data consistent with its sparsity parameters; strings with a
    well-formed header; none for resource and variant tensors)."""
    global _TYPE_CODES
    fb = _schema()
    if _TYPE_CODES is None:
        _TYPE_CODES = {v for k, v in vars(fb.TensorType).items() if not k.startswith("_")}
    if not 0 <= t.Buffer() < n_buffers:
        raise ValueError(f"{where} names buffer {t.Buffer()} of {n_buffers}")
    if t.Type() not in _TYPE_CODES:
        raise ValueError(f"{where} has tensor type {t.Type()}, which the schema does not define")
    if t.ExternalBuffer():
        raise ValueError(f"{where} takes its data from an external buffer, which torchtpu-export does not open")
    shape = [int(d) for d in t.ShapeAsNumpy()] if t.ShapeLength() else []
    if any(d < 0 for d in shape):
        raise ValueError(f"{where} has a negative dim in its shape {shape}")
    if t.ShapeSignatureLength() and any(int(d) < -1 for d in t.ShapeSignatureAsNumpy()):
        raise ValueError(f"{where} has a dim below -1 in its shape signature")
    count = 1
    for d in shape:
        count *= d
    if count > _MAX_ELEMENTS:
        raise ValueError(f"{where} has {count:,} elements")
    kind = type_name(t.Type())
    stored = data[t.Buffer()]
    for j in range(t.VariantTensorsLength()):
        sub = t.VariantTensors(j)
        if sub.Type() not in _TYPE_CODES or (sub.ShapeLength() and any(int(d) < -1 for d in sub.ShapeAsNumpy())):
            raise ValueError(f"{where} has a malformed variant subtype")
    if kind in ("resource", "variant"):
        if stored:
            raise ValueError(f"{where} is a {kind} tensor with constant data")
        return
    if kind == "string":
        if stored:
            start, n = span(t.Buffer())
            _check_strings(content[start:start + n], count, where)
        return
    if t.Sparsity() is not None:
        count = _sparse_elements(t, shape, where)
    if kind == "int4":  # two values per byte
        if stored and stored != (count + 1) // 2:
            raise ValueError(f"{where} holds {stored:,} bytes of int4 data; its shape {shape} makes {(count + 1) // 2:,}")
        return
    itemsize = _ITEMSIZE.get(kind)
    if stored and itemsize and stored != count * itemsize:
        raise ValueError(f"{where} holds {stored:,} bytes of data; its shape {shape}"
                         f"{' and sparsity' if t.Sparsity() is not None else ''} and type {kind} make "
                         f"{count * itemsize:,}")


def _check_blockwise(t, where: str, n_tensors: int) -> None:
    """A blockwise-quantized tensor names its scales (and zero points) by tensor index: in range."""
    fb = _schema()
    q = t.Quantization()
    if q is None or q.DetailsType() != fb.QuantizationDetails.BlockwiseQuantization:
        return
    table = q.Details()
    details = fb.BlockwiseQuantization()
    details.Init(table.Bytes, table.Pos)
    if not 0 <= details.Scales() < n_tensors or not -1 <= details.ZeroPoints() < n_tensors \
            or details.BlockSize() <= 0:
        raise ValueError(f"{where} has blockwise quantization naming tensors {details.Scales()} and "
                         f"{details.ZeroPoints()} of {n_tensors} (block size {details.BlockSize()})")


def _check_strings(buf: bytes, count: int, where: str) -> None:
    """LiteRT's string layout: int32 n, n + 1 int32 offsets (the first just past them, each no
    smaller than the last, the last the buffer's end), then the bytes; n the tensor's element count."""
    import numpy as np
    if len(buf) < 4:
        raise ValueError(f"{where} is a string tensor with {len(buf)} bytes of data (no header)")
    n = int(np.frombuffer(buf, "<u4", 1)[0])
    header = (n + 2) * 4
    if n != count or header > len(buf):
        raise ValueError(f"{where} is a string tensor of {count:,} elements whose data says {n:,} strings in "
                         f"{len(buf):,} bytes")
    offsets = np.frombuffer(buf, "<u4", n + 1, 4).astype(np.int64)
    if offsets[0] != header or offsets[-1] != len(buf) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{where} is a string tensor whose offsets do not lie in order inside its data")


def _index_vector(table, kind: int):
    """The values of a sparse dimension's segments or indices (a SparseIndexVector union)."""
    fb = _schema()
    cls = {fb.SparseIndexVector.Int32Vector: fb.Int32Vector, fb.SparseIndexVector.Uint16Vector: fb.Uint16Vector,
           fb.SparseIndexVector.Uint8Vector: fb.Uint8Vector}.get(kind)
    if cls is None or table is None:
        return None
    vec = cls()
    vec.Init(table.Bytes, table.Pos)
    if vec.ValuesIsNone():
        return None
    return vec.ValuesAsNumpy().astype("int64")


def _sparse_elements(t, shape: list, where: str) -> int:
    """The number of values a sparse tensor stores, after checking its sparsity parameters as LiteRT's
    verifier does: the traversal order a permutation of the dims (then of the block dims), block
    sizes that divide their dims, dense sizes equal to the dims, CSR segments non-decreasing from the
    parent level's count, indices inside their dim. DENSIFY trusts all of it."""
    fb = _schema()
    sp = t.Sparsity()
    rank = len(shape)
    order = [int(x) for x in sp.TraversalOrderAsNumpy()] if sp.TraversalOrderLength() else []
    blocks = [int(x) for x in sp.BlockMapAsNumpy()] if sp.BlockMapLength() else []
    total = len(order)
    bad = ValueError(f"{where} has invalid sparsity parameters")
    if total < rank or total > 16 or sp.DimMetadataLength() != total or len(blocks) != total - rank:
        raise bad
    if sorted(order[:rank]) != list(range(rank)) or sorted(order[rank:]) != list(range(rank, total)):
        raise bad
    sizes = list(shape) + [0] * (total - rank)
    for i, b in enumerate(blocks):
        block_size = sp.DimMetadata(rank + i).DenseSize()
        if not 0 <= b < rank or block_size <= 0 or shape[b] % block_size:
            raise bad
        sizes[order[rank + i]] = block_size
        sizes[b] //= block_size
    elements = 1
    for level, dim in enumerate(order):
        meta = sp.DimMetadata(level)
        if meta.Format() == fb.DimensionType.DENSE:
            if meta.DenseSize() != sizes[dim]:
                raise bad
            elements *= sizes[dim]
            continue
        segments = _index_vector(meta.ArraySegments(), meta.ArraySegmentsType())
        indices = _index_vector(meta.ArrayIndices(), meta.ArrayIndicesType())
        if segments is None or indices is None or len(segments) != elements + 1 or not len(segments) \
                or segments[0] != 0 or (len(segments) > 1 and (segments[1:] < segments[:-1]).any()) \
                or segments[-1] != len(indices) or (len(indices) and (indices.min() < 0 or indices.max() >= sizes[dim])):
            raise bad
        elements = len(indices)
        if elements > _MAX_ELEMENTS:
            raise bad
    return elements


def _check_indices(indices, n: int, where: str, allow_absent: bool) -> None:
    low = -1 if allow_absent else 0
    for i in indices:
        if not low <= int(i) < n:
            raise ValueError(f"{where} names tensor {int(i)} of {n}")


def weights_digest(chunks) -> str:
    """blake2b of a model's constant buffers in order (each prefixed by its length)."""
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()


def damaged(e: Exception) -> ArtifactError:
    return ArtifactError(f"the TFLite flatbuffer is truncated or damaged ({type(e).__name__}: {str(e)[:120]})",
                         hint="convert or download the model again")


def _verify_digest(model, content, skip: set, expected: str) -> None:
    # blake2b as weights_digest computes it, over views of the content (no copies). A mapped
    # file is hashed a chunk at a time and each chunk unmapped again: the check reads the whole
    # file without keeping it in memory.
    h = hashlib.blake2b(digest_size=16)
    view = memoryview(content)
    try:
        for i in range(1, model.BuffersLength()):
            if i in skip:
                continue
            start, size = _buffer_span(model, content, i)
            h.update(size.to_bytes(8, "little"))
            for a in range(start, start + size, _CHUNK):
                b = min(a + _CHUNK, start + size)
                h.update(view[a:b])
                if isinstance(content, mmap.mmap):
                    page = a - a % mmap.PAGESIZE
                    content.madvise(mmap.MADV_DONTNEED, page, b - page)
    finally:
        view.release()
    if h.hexdigest() != expected:
        raise ArtifactError("the model's weights do not match the digest written with them",
                            hint="the file was damaged after conversion: convert it again")


_CHUNK = 64 << 20


def _buffer_span(model, content, index: int) -> tuple[int, int]:
    # (start, size) of a buffer's data in the content
    buf = model.Buffers(index)
    if buf.Offset() > 1:  # stored after the flatbuffer (models past 2 GB)
        if buf.Offset() + buf.Size() > len(content):
            raise ValueError(f"buffer {index} ends past the end of the file")
        return buf.Offset(), buf.Size()
    n = buf.DataLength()
    return (flatbuf.vector_start(buf, 4), n) if n else (0, 0)


def read_metadata(content: bytes, *, verify: bool = False) -> dict | None:
    """The ``torchtpu_export`` metadata of a flatbuffer, or None for files made elsewhere.

    With ``verify``, the constants are checked against the digest the metadata records.
    """
    model = parse_model(content)
    try:
        for i in range(model.MetadataLength()):
            m = model.Metadata(i)
            if m.Name() and m.Name().decode() == METADATA_NAME:
                start, size = _buffer_span(model, content, m.Buffer())
                if size > MAX_METADATA_BYTES:
                    raise ArtifactError(f"the flatbuffer's {METADATA_NAME} metadata is {size:,} bytes "
                                        f"(at most {MAX_METADATA_BYTES:,} are read)")
                meta = load_json(content[start:start + size], f"the flatbuffer's {METADATA_NAME} metadata",
                                 max_bytes=MAX_METADATA_BYTES)
                _check_format_version(meta)
                problem = _metadata_problem(meta)
                if problem:
                    raise ArtifactError(f"the flatbuffer's {METADATA_NAME} metadata is malformed: {problem}",
                                        hint="convert the model again")
                # LiteRT's NPU compiler moves the weights its NPU runs into the appended bytecode: the digest
                # of the CPU file no longer applies to a compiled one (DISPATCH_OPs), which carries its own
                # (npu.digest_state); a stamp alone (LiteRtStamp metadata) exempts nothing
                compiled = any(c == "CUSTOM:DISPATCH_OP" for c in opcode_names(model))
                if verify and "weights_blake2b" in meta and not compiled:
                    _verify_digest(model, content, {m.Buffer()}, meta["weights_blake2b"])
                return meta
    except ArtifactError:
        raise
    except Exception as e:
        raise damaged(e) from e
    return None


def _check_format_version(meta) -> None:
    """ArtifactError unless the metadata's format version is one this reader takes (1..FORMAT_VERSION),
    before anything else in it is read: a newer format may lay its fields out differently."""
    if not isinstance(meta, dict):
        return  # malformed: _metadata_problem says so
    version = meta.get("format_version")
    number = isinstance(version, int) and not isinstance(version, bool)
    if number and 1 <= version <= FORMAT_VERSION:
        return
    reads = f"format version {FORMAT_VERSION}" if FORMAT_VERSION == 1 else f"format versions 1 to {FORMAT_VERSION}"
    if number and version > FORMAT_VERSION:
        raise ArtifactError(f"the flatbuffer's {METADATA_NAME} metadata has format version {version}, newer than "
                            f"this torchtpu-export reads ({reads})", hint="upgrade torchtpu-export to load it")
    found = "no format version" if version is None else f"format version {str(version)[:40]!r}, unknown"
    raise ArtifactError(f"the flatbuffer's {METADATA_NAME} metadata has {found} (this torchtpu-export reads {reads})",
                        hint="convert the model again")


def _metadata_problem(meta) -> str | None:
    from ...specs import call_metadata_problem
    from ...untrusted import STR, Count, MapOf, Record
    problem = Record({}, {"signatures": MapOf(Record({})), "versions": MapOf(STR), "weights_blake2b": STR,
                          "quantization": Record({"recipe": STR, "weight_bytes": Count(),
                                                  "float_weight_bytes": Count()})}).problem(meta)
    if problem:
        return problem
    for name, sig in meta.get("signatures", {}).items():
        problem = call_metadata_problem(sig)
        if problem:
            return f"signature {name[:80]!r}: {problem}"
    return None


def signature_io(model) -> dict:
    # Per signature: input and output TensorSpecs read from the SignatureDefs themselves.
    out = {}
    for i in range(model.SignatureDefsLength()):
        sig = model.SignatureDefs(i)
        sub = model.Subgraphs(sig.SubgraphIndex())

        quant = {}

        def specs(n, get):
            res = []
            for j in range(n):
                tm = get(j)
                t = sub.Tensors(tm.TensorIndex())
                shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
                if t.ShapeSignatureLength():
                    # -1 in shape_signature: a dynamic dim, named after its tensor and axis
                    shape = tuple(f"{tm.Name().decode()}_{k}" if int(d) < 0 else n
                                  for k, (d, n) in enumerate(zip(t.ShapeSignatureAsNumpy(), shape)))
                res.append(TensorSpec(tm.Name().decode(), shape, type_name(t.Type())))
                q = t.Quantization()
                if q is not None and q.ScaleLength() == 1 and _is_8_bit(t.Type()):
                    quant[tm.Name().decode()] = (float(q.Scale(0)), int(q.ZeroPoint(0)) if q.ZeroPointLength() else 0)
            return res
        out[sig.SignatureKey().decode()] = {"inputs": specs(sig.InputsLength(), sig.Inputs),
                                            "outputs": specs(sig.OutputsLength(), sig.Outputs),
                                            "subgraph": sig.SubgraphIndex(), "quant": quant}
    return out


_OP_NAMES: dict | None = None


def _op_names() -> dict:
    global _OP_NAMES
    if _OP_NAMES is None:
        fb = _schema()
        _OP_NAMES = {v: k for k, v in vars(fb.BuiltinOperator).items() if not k.startswith("_")}
    return _OP_NAMES


def opcode_names(model) -> list[str]:
    # the operator name of each of the model's opcode entries (CUSTOM ones with their custom code)
    names = _op_names()
    codes = []
    for i in range(model.OperatorCodesLength()):
        oc = model.OperatorCodes(i)
        code = max(oc.BuiltinCode(), oc.DeprecatedBuiltinCode())
        codes.append(f"CUSTOM:{(oc.CustomCode() or b'').decode(errors='replace')}" if code == 32
                     else names.get(code, str(code)))
    return codes


def op_histogram(model, subgraphs=None) -> dict[str, int]:
    """How many operators of each kind a validated model's subgraphs (default: all) hold, by name."""
    codes = opcode_names(model)
    hist: dict[str, int] = {}
    for k in range(model.SubgraphsLength()) if subgraphs is None else subgraphs:
        sub = model.Subgraphs(k)
        for j in range(sub.OperatorsLength()):
            name = codes[sub.Operators(j).OpcodeIndex()]
            hist[name] = hist.get(name, 0) + 1
    return hist


def int8_ops(content: bytes) -> dict[str, int]:
    """The operators of a flatbuffer that read an 8-bit integer tensor, by name: the kernels that run
    quantized. DEQUANTIZE counts only for constant inputs (weights stored int8, dequantized at load);
    QUANTIZE, which makes int8 values, never."""
    model = parse_model(content)
    codes = opcode_names(model)
    hist: dict[str, int] = {}
    for k in range(model.SubgraphsLength()):
        sub = model.Subgraphs(k)
        for j in range(sub.OperatorsLength()):
            op = sub.Operators(j)
            name = codes[op.OpcodeIndex()]
            if name == "QUANTIZE":
                continue
            ins = [sub.Tensors(i) for i in op.InputsAsNumpy() if i >= 0] if op.InputsLength() else []
            eight_bit = [t for t in ins if _is_8_bit(t.Type())]
            if name == "DEQUANTIZE":
                eight_bit = [t for t in eight_bit if model.Buffers(t.Buffer()).DataLength()
                             or model.Buffers(t.Buffer()).Size()]
            if eight_bit:
                hist[name] = hist.get(name, 0) + 1
    return hist


def signature_tensors(content: bytes, name: str = "model") -> dict:
    """Per signature, its inputs and outputs as ``{"name", "shape", "dtype"}`` in SignatureDef order
    (the order LiteRT.js and CompiledModel use), -1 for a dynamic dim."""
    try:
        io = signature_io(validate(content))
    except ArtifactError as e:
        raise ArtifactError(f"{name} is not a valid .tflite flatbuffer: {e}") from None
    except Exception as e:  # a damaged flatbuffer fails anywhere inside the generated readers
        raise ArtifactError(f"{name} is not a valid .tflite flatbuffer: {type(e).__name__}: {e}") from None
    if not io:
        raise ArtifactError(f"{name} has no signatures; LiteRT.js runs models through their signatures",
                            hint="convert it with torchtpu-export, which writes a serving_default signature")

    def plain(spec):
        return {"name": spec.name, "shape": [d if isinstance(d, int) else -1 for d in spec.shape], "dtype": spec.dtype}
    return {key: {"inputs": [plain(s) for s in sig["inputs"]], "outputs": [plain(s) for s in sig["outputs"]]}
            for key, sig in io.items()}
