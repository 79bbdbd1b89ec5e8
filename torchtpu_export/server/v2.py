"""The v2 model: an artifact as a ``kserve.Model`` (Open Inference Protocol v2, implemented by KServe),
running the program's default signature, or for an LLM generating with the engine: ``input_ids`` (INT32,
``[n]``) and optional ``max_new_tokens`` (INT32, ``[1]``) in, ``output_ids`` out."""
from __future__ import annotations

import asyncio
import os
import sys
import uuid

import numpy as np

from ..errors import InputError, TteError
from .common import one_line, stream_tokens

# v2 datatypes <-> numpy dtype names
V2_DTYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
             "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
             "FP32": "float32", "FP64": "float64"}
NP_TO_V2 = {v: k for k, v in V2_DTYPES.items()} | {"bfloat16": "BF16"}


def import_kserve():
    """kserve parses ``sys.argv`` when imported (its own flags): it sees none of ours."""
    os.environ.setdefault("KSERVE_OPENAI_ROUTE_PREFIX", "")
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        import kserve.model_server  # (binds kserve; its model_server module is the one reading sys.argv)
    except ImportError as e:
        raise InputError(f"serving needs KServe's model server ({e.name or e} is not installed)",
                         hint="pip install 'torchtpu-export[serve]'") from e
    finally:
        sys.argv = argv
    return kserve


def v2_shape(spec) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in spec.shape]


def make_v2_model(kserve, name: str, program, engine=None, stop_ids=()):
    """A ``kserve.Model`` that runs ``program``'s default signature, or (for an LLM) generates."""
    from kserve.errors import InvalidInput
    from kserve.protocol.infer_type import InferOutput, InferResponse

    class ArtifactModel(kserve.Model):
        def __init__(self):
            super().__init__(name)
            self.program, self.llm = program, engine  # (KServe's own `engine` attribute means something else)
            if engine is None:
                self.sig = program.signature(None)
                self.in_specs, self.out_specs = program.inputs(self.sig), program.outputs(self.sig)
            self.ready = True

        def start(self):  # KServe's lifecycle: the engine's scheduler thread runs while the model is served
            if self.llm is not None:
                self.llm.start()
            self.ready = True

        def stop(self):
            if self.llm is not None:
                self.llm.stop()
            self.ready = False

        async def healthy(self) -> bool:
            return self.ready and (self.llm is None or self.llm.running)

        def get_input_types(self):
            if self.llm is not None:
                return [{"name": "input_ids", "datatype": "INT32", "shape": [-1]},
                        {"name": "max_new_tokens", "datatype": "INT32", "shape": [1], "optional": True}]
            return [{"name": s.name, "datatype": NP_TO_V2.get(s.dtype, s.dtype.upper()), "shape": v2_shape(s)}
                    for s in self.in_specs]

        def get_output_types(self):
            if self.llm is not None:
                return [{"name": "output_ids", "datatype": "INT32", "shape": [-1]}]
            return [{"name": s.name, "datatype": NP_TO_V2.get(s.dtype, s.dtype.upper()), "shape": v2_shape(s)}
                    for s in self.out_specs]

        def _array(self, inp, spec_name, dtype, shape):
            if inp.datatype != NP_TO_V2.get(dtype):
                raise InvalidInput(f"input {spec_name!r} must be {NP_TO_V2.get(dtype, dtype)}, got {inp.datatype}")
            try:
                arr = inp.as_numpy()
            except (ValueError, TypeError) as e:
                raise InvalidInput(f"input {spec_name!r}: its data does not match its shape {inp.shape} "
                                   f"and datatype {inp.datatype} ({str(e)[:120]})") from None
            if len(arr.shape) != len(shape) or any(isinstance(d, int) and d >= 0 and d != a
                                                   for d, a in zip(shape, arr.shape)):
                raise InvalidInput(f"input {spec_name!r} must have shape {list(shape)}, got {list(arr.shape)}")
            return arr

        def _inputs(self, payload, specs):
            got = {i.name: i for i in payload.inputs}
            unknown = sorted(set(got) - {s[0] for s in specs})
            if unknown:
                raise InvalidInput(f"unknown input {unknown[0]!r}; the model takes {[s[0] for s in specs]}")
            out = {}
            for spec_name, dtype, shape, required in specs:
                if spec_name not in got:
                    if required:
                        raise InvalidInput(f"missing input {spec_name!r}; the model takes {[s[0] for s in specs]}")
                    continue
                out[spec_name] = self._array(got[spec_name], spec_name, dtype, shape)
            return out

        async def predict(self, payload, headers=None, response_headers=None):
            if self.llm is not None:
                arrays = self._inputs(payload, [("input_ids", "int32", (-1,), True),
                                                ("max_new_tokens", "int32", (1,), False)])
                ids = arrays["input_ids"].tolist()
                limit = int(arrays["max_new_tokens"][0]) if "max_new_tokens" in arrays else 16
                try:
                    request = self.llm.submit(ids, limit, stop=stop_ids)
                except InputError as e:
                    raise InvalidInput(one_line(e)) from None
                tokens = [t async for t in stream_tokens(request)]
                out = InferOutput("output_ids", [len(tokens)], "INT32")
                out.set_data_from_numpy(np.array(tokens, np.int32), binary_data=False)
                return InferResponse(response_id=payload.id or str(uuid.uuid4()), model_name=name, infer_outputs=[out])
            arrays = self._inputs(payload, [(s.name, s.dtype, s.shape, True) for s in self.in_specs])
            try:
                outs = await asyncio.to_thread(self.program.run_flat, [arrays[s.name] for s in self.in_specs],
                                               self.sig)
            except TteError as e:
                raise InvalidInput(one_line(e)) from None
            results = []
            for spec, arr in zip(self.out_specs, outs):
                arr = np.asarray(arr)
                if arr.dtype.name == "bfloat16":  # v2's BF16 has no numpy form here: sent as FP32
                    arr = arr.astype(np.float32)
                o = InferOutput(spec.name, list(arr.shape), NP_TO_V2[arr.dtype.name])
                o.set_data_from_numpy(arr, binary_data=False)
                results.append(o)
            return InferResponse(response_id=payload.id or str(uuid.uuid4()), model_name=name, infer_outputs=results)

    return ArtifactModel()
