"""Serialises graphs to a TFLite flatbuffer (schema version 3) with the ``flatbuffers`` package.

One subgraph and one SignatureDef per graph. Constant data is stored once per
distinct content (a weight shared by two signatures, or tied embeddings, is one
buffer), 16-byte aligned as the schema asks. Past the 2 GB flatbuffer limit,
buffers go after the flatbuffer and are referenced by offset and size.
The output depends only on the graphs: the same model gives the same bytes.
"""
from __future__ import annotations

import concurrent.futures
import io
import json
import mmap

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as fb

from torchtpu_export import flatbuf
from torchtpu_export.errors import ConversionError
from torchtpu_export.targets.litert.artifact import METADATA_NAME, weights_digest

from . import schema
from .dims import concrete, is_static
from .ir import Graph

_ALIGN = 16
# flatbuffers cannot address more than 2 GB; keep room for everything but the weights
EXTERNAL_THRESHOLD = 2**31 - 2**26


def _vector(builder: flatbuffers.Builder, start, items: list, prepend) -> int:
    start(builder, len(items))
    for x in reversed(items):
        prepend(x)
    return builder.EndVector()


def _int_vector(builder, items, start) -> int:
    return _vector(builder, start, [int(x) for x in items], builder.PrependInt32)


def _offset_vector(builder, offsets, start) -> int:
    return _vector(builder, start, offsets, builder.PrependUOffsetTRelative)


def _reserved_vector(builder: flatbuffers.Builder, n: int) -> int:
    # a byte vector of length n whose bytes the builder skips (the writer fills them in the file)
    builder.StartVector(1, n, _ALIGN)
    flatbuf.skip(builder, n)
    return builder.EndVector()


class _Buffers:
    """Constant contents, each stored once; index 0 is the schema's empty buffer."""

    def __init__(self):
        self.data: list[memoryview] = [memoryview(b"")]
        # candidates for sharing, by size and the bytes at both ends; equality is then checked in full
        self._by_key: dict[tuple, list[int]] = {}

    def add(self, array: np.ndarray) -> int:
        raw = memoryview(np.require(array, requirements="C").reshape(-1).view(np.uint8))
        key = (len(raw), bytes(raw[:32]), bytes(raw[-32:]))
        same = self._by_key.setdefault(key, [])
        for idx in same:
            if self.data[idx] == raw:
                return idx
        self.data.append(raw)
        same.append(len(self.data) - 1)
        return len(self.data) - 1


def serialize(graphs: list[Graph], metadata: dict | None = None, *, description: str = "torchtpu-export",
              external_threshold: int = EXTERNAL_THRESHOLD) -> bytes:
    """The flatbuffer of ``graphs`` (one subgraph + SignatureDef each) with ``metadata`` as JSON, as bytes."""
    out = io.BytesIO()
    write(graphs, out, metadata, description=description, external_threshold=external_threshold)
    return out.getvalue()


def write(graphs: list[Graph], f, metadata: dict | None = None, *, description: str = "torchtpu-export",
          external_threshold: int = EXTERNAL_THRESHOLD) -> None:
    """Writes the flatbuffer of ``graphs`` to the binary file ``f``.

    The weights go from the graphs' arrays straight to ``f``: no copy of them is made, so a
    model converts in about the memory its weights already take.
    """
    buffers = _Buffers()
    tensor_buffer: list[dict[int, int]] = []
    for g in graphs:
        per = {}
        for t in g.tensors():
            if t.data is not None:
                if t.data.dtype != t.dtype or tuple(t.data.shape) != t.shape:
                    raise ConversionError(f"constant {t.name}: data {t.data.dtype}{list(t.data.shape)} does not "
                                          f"match the tensor {t.dtype}{list(t.shape)}")
                per[id(t)] = buffers.add(pack_int4(t.data) if t.dtype == schema.INT4 else t.data) \
                    if t.data.size else 0
        tensor_buffer.append(per)
    if metadata is None:
        parts = (graphs, tensor_buffer, buffers, None, description)
        _write(f, parts, external_threshold)
        return
    # A digest of every constant, so a reader can tell a damaged file from a model. It is computed
    # while the file is written (hashing and writing both release the GIL), then put in place of a
    # placeholder of the same length.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        digest = pool.submit(weights_digest, buffers.data[1:])
        placeholder = _metadata_bytes(metadata, "0" * 32)
        meta_idx = buffers.add(np.frombuffer(placeholder, np.uint8))
        start = f.tell()
        positions = _write(f, (graphs, tensor_buffer, buffers, meta_idx, description), external_threshold)
        final = _metadata_bytes(metadata, digest.result())
    if len(final) != len(placeholder):
        raise ConversionError("the metadata changed size; please report this")
    end = f.tell()
    f.seek(start + positions[meta_idx])
    f.write(final)
    f.seek(end)


def _metadata_bytes(metadata: dict, digest: str) -> bytes:
    return json.dumps(dict(metadata, weights_blake2b=digest), sort_keys=True).encode()


def _write(f, parts, external_threshold: int) -> dict[int, int]:
    # the file; returns buffer -> where its data starts, from the start of the flatbuffer
    if sum(len(d) for d in parts[2].data) < external_threshold:
        return _write_inline(f, parts)
    return _write_external(f, parts)


def _write_inline(f, parts) -> dict[int, int]:
    # The data vectors are built first, so they end the file, after every table. The builder works
    # in an anonymous mapping that only reserves their room: its untouched pages take no memory,
    # and the data itself goes to ``f`` from the arrays, into the gaps the builder left.
    buffers = parts[2]
    probe = flatbuffers.Builder(65536)
    _build(probe, *parts, layout="probe")
    size = len(flatbuf.memory(probe)) - probe.Head() + sum(len(d) + 2 * _ALIGN + 8 for d in buffers.data) + 4096
    with mmap.mmap(-1, size) as space:
        builder = flatbuffers.Builder(0)
        flatbuf.use_memory(builder, space)
        vectors = _build(builder, *parts, layout="inline")
        # (had the estimate been short, the builder would have grown into a bytearray: still right)
        out, head = flatbuf.memory(builder), builder.Head()
        # each vector's data starts after its 4-byte length, at this position in the builder's buffer
        spans = sorted((len(out) - off + 4, i) for i, off in vectors.items())
        with memoryview(out) as view:
            pos = head
            for start, i in spans:
                f.write(view[pos:start])
                f.write(buffers.data[i])
                pos = start + len(buffers.data[i])
            f.write(view[pos:])
    return {i: start - head for start, i in spans}


def _write_external(f, parts) -> dict[int, int]:
    # Past 2 GB: the flatbuffer holds no data; each buffer follows it at an offset (schema: offset/size).
    # Two passes: the flatbuffer's size fixes where the data starts; offsets are u64 fields, so the
    # second build has the same size as the first.
    buffers = parts[2]
    probe = flatbuffers.Builder(65536)
    _build(probe, *parts, layout=[1] * len(buffers.data))
    offsets, pos = [0], _round_up(len(flatbuf.memory(probe)) - probe.Head(), _ALIGN)
    for d in buffers.data[1:]:
        offsets.append(pos)
        pos = _round_up(pos + len(d), _ALIGN)
    builder = flatbuffers.Builder(65536)
    _build(builder, *parts, layout=offsets)
    head = builder.Output()
    if len(head) != len(flatbuf.memory(probe)) - probe.Head():
        raise ConversionError("the flatbuffer changed size between passes; please report this")
    f.write(head)
    written = len(head)
    for off, d in zip(offsets[1:], buffers.data[1:]):
        f.write(b"\0" * (off - written))
        f.write(d)
        written = off + len(d)
    return dict(enumerate(offsets))


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _build(builder: flatbuffers.Builder, graphs, tensor_buffer, buffers: _Buffers, meta_idx, description,
           layout) -> dict[int, int]:
    # ``layout``: "inline" (data vectors reserved, not filled), "probe" (empty data vectors: the
    # size of everything else) or a list of external offsets. Returns buffer -> its data vector's offset.
    inline = not isinstance(layout, list)
    if not inline:
        builder.ForceDefaults(True)

    # Buffers first: built back to front, their data lands at the end of the file.
    vectors = {}
    if inline:
        for i, d in enumerate(buffers.data[1:], 1):
            vectors[i] = _reserved_vector(builder, 0 if layout == "probe" else len(d))
    buffer_tables = []
    for i, d in enumerate(buffers.data):
        fb.BufferStart(builder)
        if i and inline:
            fb.BufferAddData(builder, vectors[i])
        elif i:
            fb.BufferAddOffset(builder, layout[i])
            fb.BufferAddSize(builder, len(d))
        buffer_tables.append(fb.BufferEnd(builder))
    builder.ForceDefaults(False)
    opcodes: dict[str, int] = {}
    versions: dict[str, int] = {}
    for g in graphs:
        for op in g.ops:
            if op.code not in schema.BUILTIN:
                raise ConversionError(f"unknown TFLite builtin {op.code}")
            opcodes.setdefault(op.code, len(opcodes))
            versions[op.code] = max(versions.get(op.code, 1), schema.op_version(op))

    subgraphs, signatures = [], []
    for gi, g in enumerate(graphs):
        sub, sig = _subgraph(builder, g, tensor_buffer[gi], opcodes, gi)
        subgraphs.append(sub)
        signatures.append(sig)

    codes = []
    for code in opcodes:
        value = schema.BUILTIN[code]
        fb.OperatorCodeStart(builder)
        fb.OperatorCodeAddDeprecatedBuiltinCode(builder, min(value, fb.BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES))
        fb.OperatorCodeAddBuiltinCode(builder, value)
        fb.OperatorCodeAddVersion(builder, versions[code])
        codes.append(fb.OperatorCodeEnd(builder))

    metadata = []
    if meta_idx is not None:
        name = builder.CreateString(METADATA_NAME)
        fb.MetadataStart(builder)
        fb.MetadataAddName(builder, name)
        fb.MetadataAddBuffer(builder, meta_idx)
        metadata.append(fb.MetadataEnd(builder))

    desc = builder.CreateString(description)
    codes_vec = _offset_vector(builder, codes, fb.ModelStartOperatorCodesVector)
    subs_vec = _offset_vector(builder, subgraphs, fb.ModelStartSubgraphsVector)
    bufs_vec = _offset_vector(builder, buffer_tables, fb.ModelStartBuffersVector)
    sigs_vec = _offset_vector(builder, signatures, fb.ModelStartSignatureDefsVector)
    meta_vec = _offset_vector(builder, metadata, fb.ModelStartMetadataVector) if metadata else None
    fb.ModelStart(builder)
    fb.ModelAddVersion(builder, 3)
    fb.ModelAddOperatorCodes(builder, codes_vec)
    fb.ModelAddSubgraphs(builder, subs_vec)
    fb.ModelAddDescription(builder, desc)
    fb.ModelAddBuffers(builder, bufs_vec)
    if meta_vec is not None:
        fb.ModelAddMetadata(builder, meta_vec)
    fb.ModelAddSignatureDefs(builder, sigs_vec)
    model = fb.ModelEnd(builder)
    builder.Finish(model, file_identifier=b"TFL3")
    return vectors


def pack_int4(values: np.ndarray) -> np.ndarray:
    """int4 values, two per byte, the first in the low nibble (LiteRT's packed INT4 layout)."""
    v = np.asarray(values).astype(np.int8).reshape(-1)
    if v.size % 2:
        v = np.concatenate([v, np.zeros(1, np.int8)])
    return ((v[0::2] & 0x0F) | ((v[1::2] & 0x0F) << 4)).astype(np.uint8)


def _quantization(builder, q, tindex: dict) -> int:
    if q.block_size:
        fb.BlockwiseQuantizationStart(builder)
        fb.BlockwiseQuantizationAddScales(builder, tindex[id(q.scales)])
        fb.BlockwiseQuantizationAddZeroPoints(builder, -1)
        fb.BlockwiseQuantizationAddBlockSize(builder, q.block_size)
        details = fb.BlockwiseQuantizationEnd(builder)
        fb.QuantizationParametersStart(builder)
        fb.QuantizationParametersAddDetailsType(builder, fb.QuantizationDetails.BlockwiseQuantization)
        fb.QuantizationParametersAddDetails(builder, details)
        return fb.QuantizationParametersEnd(builder)
    scale = _vector(builder, fb.QuantizationParametersStartScaleVector, [float(x) for x in q.scale],
                    builder.PrependFloat32)
    zero = _vector(builder, fb.QuantizationParametersStartZeroPointVector, [int(x) for x in q.zero_point],
                   builder.PrependInt64)
    fb.QuantizationParametersStart(builder)
    fb.QuantizationParametersAddScale(builder, scale)
    fb.QuantizationParametersAddZeroPoint(builder, zero)
    if q.axis:
        fb.QuantizationParametersAddQuantizedDimension(builder, q.axis)
    return fb.QuantizationParametersEnd(builder)


def unique_names(tensors, first=()) -> dict[int, str]:
    """A distinct name per tensor of a subgraph (``id(tensor) -> name``): its own name where no other
    tensor has it, else the name with ``_1``, ``_2``, ... (the subgraph's inputs and outputs keep theirs).
    Readers other than LiteRT's interpreter (OpenVINO's TFLite frontend) tell tensors apart by name."""
    out: dict[int, str] = {}
    taken: set[str] = set()
    for t in [*first, *tensors]:
        if t is None or id(t) in out:
            continue
        name, k = t.name, 0
        while name in taken:
            k += 1
            name = f"{t.name}_{k}"
        taken.add(name)
        out[id(t)] = name
    return out


def _explicit_options(op) -> dict | None:
    """The op's options as written (None: no options table): a RESHAPE states its static target shape,
    or has no table when the shape is dynamic (an empty ReshapeOptions reads as ``new_shape=[]`` to
    readers that take the options over the shape input, OpenVINO's among them)."""
    if op.code == "RESHAPE" and not op.options and op.outputs:
        shape = op.outputs[0].shape
        if all(is_static(d) for d in shape):
            return {"newShape": [int(d) for d in shape]}
        return None
    return op.options


def _subgraph(builder, g: Graph, buffer_of: dict[int, int], opcodes: dict[str, int], index: int):
    tensors = list(g.tensors())
    tindex = {id(t): i for i, t in enumerate(tensors)}
    unique = unique_names(tensors, first=[*g.inputs, *g.outputs])
    names = {}
    for t in tensors:
        names.setdefault(unique[id(t)], builder.CreateSharedString(unique[id(t)]))
    tables = []
    for t in tensors:
        # a dynamic dim: -1 in shape_signature, its sample size in shape (what LiteRT allocates on load)
        shape = _int_vector(builder, [concrete(d, g.hints) for d in t.shape], fb.TensorStartShapeVector)
        signature = _int_vector(builder, [d if is_static(d) else -1 for d in t.shape],
                                fb.TensorStartShapeSignatureVector) if t.dynamic else None
        quant = _quantization(builder, t.quant, tindex) if t.quant is not None else None
        fb.TensorStart(builder)
        fb.TensorAddShape(builder, shape)
        if signature is not None:
            fb.TensorAddShapeSignature(builder, signature)
        fb.TensorAddType(builder, schema.TENSOR_TYPE[t.dtype])
        fb.TensorAddBuffer(builder, buffer_of.get(id(t), 0))
        fb.TensorAddName(builder, names[unique[id(t)]])
        if quant is not None:
            fb.TensorAddQuantization(builder, quant)
        tables.append(fb.TensorEnd(builder))
    ops = []
    for op in g.ops:
        ins = _int_vector(builder, [-1 if t is None else tindex[id(t)] for t in op.inputs], fb.OperatorStartInputsVector)
        outs = _int_vector(builder, [tindex[id(t)] for t in op.outputs], fb.OperatorStartOutputsVector)
        options = _explicit_options(op)
        opt_type, opt = (0, None) if options is None else schema.options_table(op.code, options)
        opt_off = opt.Pack(builder) if opt is not None else None
        fb.OperatorStart(builder)
        fb.OperatorAddOpcodeIndex(builder, opcodes[op.code])
        fb.OperatorAddInputs(builder, ins)
        fb.OperatorAddOutputs(builder, outs)
        if opt_off is not None:
            fb.OperatorAddBuiltinOptionsType(builder, opt_type)
            fb.OperatorAddBuiltinOptions(builder, opt_off)
        ops.append(fb.OperatorEnd(builder))
    tensors_vec = _offset_vector(builder, tables, fb.SubGraphStartTensorsVector)
    inputs_vec = _int_vector(builder, [tindex[id(t)] for t in g.inputs], fb.SubGraphStartInputsVector)
    outputs_vec = _int_vector(builder, [tindex[id(t)] for t in g.outputs], fb.SubGraphStartOutputsVector)
    ops_vec = _offset_vector(builder, ops, fb.SubGraphStartOperatorsVector)
    name = builder.CreateString(g.name)
    fb.SubGraphStart(builder)
    fb.SubGraphAddTensors(builder, tensors_vec)
    fb.SubGraphAddInputs(builder, inputs_vec)
    fb.SubGraphAddOutputs(builder, outputs_vec)
    fb.SubGraphAddOperators(builder, ops_vec)
    fb.SubGraphAddName(builder, name)
    sub = fb.SubGraphEnd(builder)

    def tensor_maps(tensors_, names_):
        maps = []
        for t, n in zip(tensors_, names_):
            s = builder.CreateString(n)
            fb.TensorMapStart(builder)
            fb.TensorMapAddName(builder, s)
            fb.TensorMapAddTensorIndex(builder, tindex[id(t)])
            maps.append(fb.TensorMapEnd(builder))
        return maps

    in_maps = _offset_vector(builder, tensor_maps(g.inputs, g.input_names), fb.SignatureDefStartInputsVector)
    out_maps = _offset_vector(builder, tensor_maps(g.outputs, g.output_names), fb.SignatureDefStartOutputsVector)
    key = builder.CreateString(g.name)
    fb.SignatureDefStart(builder)
    fb.SignatureDefAddInputs(builder, in_maps)
    fb.SignatureDefAddOutputs(builder, out_maps)
    fb.SignatureDefAddSignatureKey(builder, key)
    fb.SignatureDefAddSubgraphIndex(builder, index)
    return sub, fb.SignatureDefEnd(builder)
