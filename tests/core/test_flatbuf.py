"""The flatbuffers internals torchtpu_export.flatbuf relies on (Builder.Bytes/head, Table._tab), checked
against the installed package: a flatbuffers release that changes them fails here, not in a model."""
import mmap

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as fb

from torchtpu_export import flatbuf


def test_a_buffer_built_in_given_memory_with_a_skipped_vector_reads_back():
    payload = np.arange(64, dtype=np.uint8)
    with mmap.mmap(-1, 4096) as space:
        b = flatbuffers.Builder(0)
        flatbuf.use_memory(b, space)
        assert flatbuf.memory(b) is space
        b.StartVector(1, len(payload), 16)
        flatbuf.skip(b, len(payload))  # room kept, bytes not written by the builder
        data = b.EndVector()
        fb.BufferStart(b)
        fb.BufferAddData(b, data)
        buf = fb.BufferEnd(b)
        fb.ModelStartBuffersVector(b, 1)
        b.PrependUOffsetTRelative(buf)
        bufs = b.EndVector()
        fb.ModelStart(b)
        fb.ModelAddBuffers(b, bufs)
        b.Finish(fb.ModelEnd(b), file_identifier=b"TFL3")
        out = bytearray(flatbuf.memory(b)[b.Head():])
    model = fb.Model.GetRootAs(out, 0)
    start = flatbuf.vector_start(model.Buffers(0), 4)
    assert model.Buffers(0).DataLength() == len(payload)
    out[start:start + len(payload)] = payload.tobytes()  # what the writer fills in the file
    assert bytes(model.Buffers(0).DataAsNumpy()) == payload.tobytes()


def test_the_pinned_version():
    assert flatbuffers.__version__ == "25.12.19", "re-check torchtpu_export/flatbuf.py against this release"
