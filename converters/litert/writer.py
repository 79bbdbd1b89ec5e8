"""Serialises graphs to a TFLite flatbuffer (schema version 3) with the ``flatbuffers`` package.

One subgraph and one SignatureDef per graph. Constant data is stored once per
distinct content (a weight shared by two signatures, or tied embeddings, is one
buffer), 16-byte aligned as the schema asks. Past the 2 GB flatbuffer limit,
buffers go after the flatbuffer and are referenced by offset and size.
The output depends only on the graphs: the same model gives the same bytes.
"""
from __future__ import annotations

import json

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as fb

from torchtpu_export.edge import weights_digest
from torchtpu_export.errors import ConversionError

from . import schema
from .dims import concrete, is_static
from .ir import Graph

METADATA_NAME = "torchtpu_export"
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


def _bytes_vector(builder: flatbuffers.Builder, data: bytes | memoryview) -> int:
    builder.StartVector(1, len(data), _ALIGN)
    builder.head = builder.head - len(data)
    builder.Bytes[builder.head:builder.head + len(data)] = data
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
    """The flatbuffer of ``graphs`` (one subgraph + SignatureDef each) with ``metadata`` as JSON."""
    buffers = _Buffers()
    tensor_buffer: list[dict[int, int]] = []
    for g in graphs:
        per = {}
        for t in g.tensors():
            if t.data is not None:
                if t.data.dtype != t.dtype or tuple(t.data.shape) != t.shape:
                    raise ConversionError(f"constant {t.name}: data {t.data.dtype}{list(t.data.shape)} does not "
                                          f"match the tensor {t.dtype}{list(t.shape)}")
                per[id(t)] = buffers.add(t.data) if t.data.size else 0
        tensor_buffer.append(per)
    meta_idx = None
    if metadata is not None:
        # a digest of every constant, so a reader can tell a damaged file from a model
        metadata = dict(metadata, weights_blake2b=weights_digest(buffers.data[1:]))
        meta_idx = buffers.add(np.frombuffer(json.dumps(metadata, sort_keys=True).encode(), np.uint8))
    total = sum(len(d) for d in buffers.data)
    if total < external_threshold:
        return _build(graphs, tensor_buffer, buffers, meta_idx, description, None)
    # Two passes: the flatbuffer's size fixes where the external data starts; offsets are u64
    # fields, so the second build has the same size as the first.
    probe = _build(graphs, tensor_buffer, buffers, meta_idx, description, [1] * len(buffers.data))
    offsets, pos = [0], _round_up(len(probe), _ALIGN)
    for d in buffers.data[1:]:
        offsets.append(pos)
        pos = _round_up(pos + len(d), _ALIGN)
    head = _build(graphs, tensor_buffer, buffers, meta_idx, description, offsets)
    if len(head) != len(probe):
        raise ConversionError("the flatbuffer changed size between passes; please report this")
    out = bytearray(head)
    for off, d in zip(offsets[1:], buffers.data[1:]):
        out.extend(b"\0" * (off - len(out)))
        out.extend(d)
    return bytes(out)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _build(graphs, tensor_buffer, buffers: _Buffers, meta_idx, description, external) -> bytes:
    inline = external is None
    size = sum(len(d) + _ALIGN for d in buffers.data) if inline else 0
    builder = flatbuffers.Builder(size + 65536 + 512 * sum(len(g.ops) for g in graphs))
    if external is not None:
        builder.ForceDefaults(True)

    # Buffers first: built back to front, their data lands at the end of the file.
    data_offsets = [None] + [_bytes_vector(builder, d) if inline else None for d in buffers.data[1:]]
    buffer_tables = []
    for i, d in enumerate(buffers.data):
        fb.BufferStart(builder)
        if i and inline:
            fb.BufferAddData(builder, data_offsets[i])
        elif i:
            fb.BufferAddOffset(builder, external[i])
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
    return bytes(memoryview(builder.Bytes)[builder.Head():])


def _subgraph(builder, g: Graph, buffer_of: dict[int, int], opcodes: dict[str, int], index: int):
    tensors = list(g.tensors())
    tindex = {id(t): i for i, t in enumerate(tensors)}
    names = {}
    for t in tensors:
        names.setdefault(t.name, builder.CreateSharedString(t.name))
    tables = []
    for t in tensors:
        # a dynamic dim: -1 in shape_signature, its sample size in shape (what LiteRT allocates on load)
        shape = _int_vector(builder, [concrete(d, g.hints) for d in t.shape], fb.TensorStartShapeVector)
        signature = _int_vector(builder, [d if is_static(d) else -1 for d in t.shape],
                                fb.TensorStartShapeSignatureVector) if t.dynamic else None
        fb.TensorStart(builder)
        fb.TensorAddShape(builder, shape)
        if signature is not None:
            fb.TensorAddShapeSignature(builder, signature)
        fb.TensorAddType(builder, schema.TENSOR_TYPE[t.dtype])
        fb.TensorAddBuffer(builder, buffer_of.get(id(t), 0))
        fb.TensorAddName(builder, names[t.name])
        tables.append(fb.TensorEnd(builder))
    ops = []
    for op in g.ops:
        ins = _int_vector(builder, [-1 if t is None else tindex[id(t)] for t in op.inputs], fb.OperatorStartInputsVector)
        outs = _int_vector(builder, [tindex[id(t)] for t in op.outputs], fb.OperatorStartOutputsVector)
        opt_type, opt = schema.options_table(op.code, op.options)
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
