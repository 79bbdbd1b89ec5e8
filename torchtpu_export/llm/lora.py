"""LoRA adapters for LiteRT-LM bundles: LoRA-ready steps, PEFT folders read and written as LiteRT-LM's
adapter files.

LiteRT-LM (0.18.1, CPU; ``LoraConfig(lora_path=...)`` on a session or conversation) applies an adapter to
the attention projections of a model whose ``prefill_*`` and ``decode`` signatures take, for each layer
``i`` and projection ``p`` of q, k, v, o, the inputs ``lora_atten_<p>_a_prime_weight_<i>`` ``[in, rank]``
and ``lora_atten_<p>_b_prime_weight_<i>`` ``[rank, out]`` (``lora_util.cc``: ``IsLoRAInputName``): the
projection gives ``x W + (x A) B``. It copies an adapter's tensors into those inputs by name (zeros for the
ones it lacks); a session without an adapter finds them as they were (:func:`zero_adapter`). Its ranks are
16 and 32 only: an adapter of a
lower rank is zero-padded, which changes nothing (``A`` gains zero columns, ``B`` zero rows).

The adapter file is a TFLite flatbuffer of tensors named as those inputs, float32, whose buffers lie after
the flatbuffer (``Buffer.offset`` / ``size``: LiteRT-LM maps them, never reads inline data), with a
``lora_rank`` metadata entry whose buffer field is the rank itself."""
from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np
import torch

from ..errors import InputError

RANKS = (16, 32)  # what LiteRT-LM 0.18.1 takes ("Currently only support rank 16 and 32")
PROJECTIONS = ("q", "k", "v", "o")
_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attn|attention)\.([qkvo])_proj$")
_ALIGN = 16 << 10  # each tensor's data at a 16 KiB boundary after the flatbuffer
_PAGE = 4096
MAX_ADAPTER_BYTES = 4 << 30


def input_name(proj: str, ab: str, layer: int) -> str:
    return f"lora_atten_{proj}_{ab}_prime_weight_{layer}"


@dataclasses.dataclass(frozen=True)
class LoraLayout:
    """The LoRA inputs of a model's steps: ``rank`` and, per (layer, projection), the projection's
    ``(in, out)`` features."""

    rank: int
    shapes: tuple  # ((layer, proj, in_features, out_features), ...)

    def names(self) -> list[str]:
        return [input_name(p, ab, i) for i, p, _, _ in self.shapes for ab in "ab"]

    def shape(self, name: str) -> tuple:
        for i, p, fin, fout in self.shapes:
            if name == input_name(p, "a", i):
                return (fin, self.rank)
            if name == input_name(p, "b", i):
                return (self.rank, fout)
        raise KeyError(name)

    def zeros(self) -> dict:
        return {n: torch.zeros(self.shape(n)) for n in self.names()}


def projections(model) -> dict:
    """``{(layer, proj): nn.Linear}``: the model's attention projections LiteRT-LM's LoRA reaches."""
    found = {}
    for name, module in model.named_modules():
        m = _MODULE.search(name)
        if m and isinstance(module, torch.nn.Linear):
            found[(int(m.group(1)), m.group(2))] = module
    return found


def layout_of(model, rank: int, name: str) -> LoraLayout:
    if rank not in RANKS:
        raise InputError(f"LiteRT-LM takes LoRA adapters of rank {' or '.join(map(str, RANKS))}, not {rank}",
                         hint="give lora= a PEFT folder (of rank at most 32), 16 or 32")
    found = projections(model)
    if not found:
        raise InputError(f"{name}: no attention projections (layers.N.self_attn.q_proj ...) for LoRA to reach")
    return LoraLayout(rank, tuple((i, p, m.in_features, m.out_features) for (i, p), m in sorted(found.items())))


class applied:
    """Within it, each projection of ``model`` in ``layout`` adds ``(x A) B``, ``A`` and ``B`` taken from
    ``weights`` by their input names (forward hooks, removed on exit)."""

    def __init__(self, model, layout: LoraLayout, weights: dict):
        self.model, self.layout, self.weights = model, layout, weights
        self.handles = []

    def __enter__(self):
        found = projections(self.model)
        for i, p, _, _ in self.layout.shapes:
            a, b = self.weights[input_name(p, "a", i)], self.weights[input_name(p, "b", i)]
            self.handles.append(found[(i, p)].register_forward_hook(
                lambda mod, args, out, a=a, b=b: out + torch.matmul(torch.matmul(args[0], a.to(out.dtype)),
                                                                    b.to(out.dtype))))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@dataclasses.dataclass
class LoraAdapter:
    """A PEFT LoRA adapter as LiteRT-LM's inputs: ``weights`` by input name (``A`` scaled by alpha / r,
    zero-padded to ``rank``), the PEFT rank ``r`` it came from."""

    rank: int
    r: int
    weights: dict  # name -> np.ndarray float32
    source: str

    def merged_into(self, model) -> None:
        """Adds the adapter to ``model``'s projection weights in place (W += (A B)^T): the merged model."""
        found = projections(model)
        with torch.no_grad():
            for (i, p), module in found.items():
                a = self.weights.get(input_name(p, "a", i))
                if a is not None:
                    b = self.weights[input_name(p, "b", i)]
                    module.weight += torch.from_numpy(a @ b).T.to(module.weight.dtype)

    def save(self, path) -> None:
        """Writes LiteRT-LM's adapter file at ``path`` (atomically)."""
        from ..fileio import atomic_open, check_writable
        path = check_writable(os.fspath(path))
        with atomic_open(path) as f:
            write_adapter(f, self.weights, self.rank)


def features_of(model) -> dict:
    """``{(layer, proj): (in, out)}`` of a model's LoRA-reachable projections."""
    return {k: (m.in_features, m.out_features) for k, m in projections(model).items()}


def features_of_inputs(inputs: dict) -> tuple:
    """``({(layer, proj): (in, out)}, rank)`` from a bundle's LoRA inputs ``{name: shape}``."""
    found, rank = {}, None
    for name, shape in inputs.items():
        m = re.fullmatch(r"lora_atten_([qkvo])_a_prime_weight_(\d+)", name)
        if m:
            b = inputs.get(input_name(m.group(1), "b", int(m.group(2))))
            if b is not None and len(shape) == 2 and len(b) == 2:
                found[(int(m.group(2)), m.group(1))] = (shape[0], b[1])
                rank = shape[1]
    return found, rank


def zero_adapter(inputs: dict) -> LoraAdapter:
    """The adapter of zeros for a bundle's LoRA ``inputs`` (``{name: shape}``): the base model. LiteRT-LM
    0.18.1 leaves a session's LoRA inputs as they were when it has no adapter (never written, or the previous
    session's adapter): a LoRA-ready bundle runs its base model through this one."""
    rank = next((shape[1] for name, shape in sorted(inputs.items()) if "_a_prime_" in name), RANKS[0])
    return LoraAdapter(rank, 0, {n: np.zeros(shape, np.float32) for n, shape in inputs.items()}, "zeros")


def read_peft(path: str, features: dict, rank: int | None = None) -> LoraAdapter:
    """The PEFT folder ``path`` (``adapter_config.json``, ``adapter_model.safetensors``) as LiteRT-LM's LoRA
    inputs for a model whose projections have ``features`` (``{(layer, proj): (in, out)}``): q/k/v/o
    projections only, plain LoRA (no DoRA, biases or extra trained modules), each tensor's shape checked
    against its projection. ``rank``: the inputs' rank (16 or 32; default the smallest that holds the
    adapter's)."""
    from ..safetensors_io import read
    from . import hf_folder
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InputError(f"{path} is not a PEFT adapter folder", hint="give the folder PEFT's save_pretrained wrote")
    config = hf_folder.read_json(path, "adapter_config.json")
    if config is None:
        raise InputError(f"{path} has no adapter_config.json: not a PEFT adapter folder")
    where = os.path.join(path, "adapter_config.json")
    if config.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{where}: a {config.get('peft_type')!r} adapter; LiteRT-LM takes LoRA adapters")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                     ("modules_to_save", "fully trained modules"), ("rank_pattern", "per-module ranks"),
                     ("alpha_pattern", "per-module alphas")):
        if config.get(key):
            raise InputError(f"{where}: {why} ({key}), which LiteRT-LM's LoRA inputs cannot carry")
    if config.get("bias", "none") != "none":
        raise InputError(f"{where}: trained biases (bias {config.get('bias')!r}), which LiteRT-LM's LoRA cannot carry")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not (isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= max(RANKS)):
        raise InputError(f"{where}: r is {r!r}; LiteRT-LM takes ranks up to {max(RANKS)}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InputError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    rank = rank or next(k for k in RANKS if k >= r)
    if r > rank:
        raise InputError(f"{path} is a rank-{r} adapter; the base takes rank {rank}")
    data = hf_folder.read_bytes(path, "adapter_model.safetensors", MAX_ADAPTER_BYTES)
    if data is None:
        raise InputError(f"{path} has no adapter_model.safetensors (pickled adapters are never loaded)")
    try:
        tensors = read(data)
    except ValueError as e:
        raise InputError(f"{os.path.join(path, 'adapter_model.safetensors')} is damaged: {e}") from None
    pairs: dict = {}
    for key, value in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
        target = _MODULE.search(m.group(1)) if m else None
        if target is None:
            raise InputError(f"{path}: {key} is not a LoRA weight of an attention projection (q, k, v, o_proj); "
                             "LiteRT-LM's LoRA reaches those only")
        pairs.setdefault((int(target.group(1)), target.group(2)), {})[m.group(2)] = (key, value)
    weights = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if (layer, proj) not in features or set(ab) != {"A", "B"}:
            raise InputError(f"{path}: layer {layer}'s {proj}_proj is not in the model, or lacks lora_A or lora_B")
        fin, fout = features[(layer, proj)]
        with np.errstate(over="ignore", invalid="ignore"):  # a value past float32 is refused below
            a, b = np.asarray(ab["A"][1], np.float32), np.asarray(ab["B"][1], np.float32)  # [r, in], [out, r]
        if a.shape != (r, fin) or b.shape != (fout, r):
            raise InputError(f"{path}: layer {layer}'s {proj}_proj lora_A {list(a.shape)} / lora_B "
                             f"{list(b.shape)} do not fit the model's projection ({fin} -> {fout}) at rank {r}")
        pa = np.zeros((fin, rank), np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            pa[:, :r] = a.T * scale
        pb = np.zeros((rank, fout), np.float32)
        pb[:r] = b.T
        # one NaN or inf reaches every logit through the attention: LiteRT-LM then samples <pad> for ever
        for (key, _), given in ((ab["A"], a), (ab["B"], b)):
            if not np.isfinite(given).all():
                raise InputError(f"{path}: {key} holds NaN or infinite values (as float32)",
                                 hint="the adapter's training diverged: use an earlier checkpoint")
        if not np.isfinite(pa).all():
            raise InputError(f"{path}: {ab['A'][0]} times lora_alpha / r ({scale:g}) is past float32's range")
        weights[input_name(proj, "a", layer)], weights[input_name(proj, "b", layer)] = pa, pb
    if not weights:
        raise InputError(f"{path}: its safetensors hold no LoRA weights")
    return LoraAdapter(rank, r, weights, path)


def write_adapter(f, weights: dict, rank: int) -> None:
    """LiteRT-LM's adapter file to the binary stream ``f``: a TFLite flatbuffer of one subgraph whose tensors
    are named as the inputs, each buffer an ``offset`` / ``size`` into the data after it, and
    ``Model.metadata["lora_rank"].buffer = rank``."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema
    names = sorted(weights)
    arrays = [np.ascontiguousarray(weights[n], np.float32) for n in names]
    header = 64 << 10
    while True:  # the data's offsets depend on the flatbuffer's size: grow the room for it until it fits
        offsets, at = [], header
        for a in arrays:
            at = -(-at // _ALIGN) * _ALIGN
            offsets.append(at)
            at += a.nbytes
        fb = _flatbuffer(flatbuffers, schema, names, arrays, offsets, rank)
        if len(fb) <= header:
            break
        header = -(-len(fb) // _ALIGN) * _ALIGN
    f.write(fb)
    pos = len(fb)
    for a, off in zip(arrays, offsets):
        f.write(b"\0" * (off - pos))
        f.write(a.tobytes())
        pos = off + a.nbytes
    f.write(b"\0" * (-pos % _PAGE))  # LiteRT-LM maps whole pages: the file's size is a multiple of one


def _flatbuffer(flatbuffers, s, names, arrays, offsets, rank: int) -> bytes:
    b = flatbuffers.Builder(1 << 16)
    buffers = []
    s.BufferStart(b)
    buffers.append(s.BufferEnd(b))  # buffer 0: empty, as in every TFLite model
    for a, off in zip(arrays, offsets):
        s.BufferStart(b)
        s.BufferAddOffset(b, off)
        s.BufferAddSize(b, a.nbytes)
        buffers.append(s.BufferEnd(b))
    buffer_vec = _vector(b, s.ModelStartBuffersVector, buffers)
    tensors = []
    for k, (name, a) in enumerate(zip(names, arrays), 1):
        label = b.CreateString(name)
        s.TensorStartShapeVector(b, a.ndim)
        for d in reversed(a.shape):
            b.PrependInt32(int(d))
        shape = b.EndVector()
        s.TensorStart(b)
        s.TensorAddShape(b, shape)
        s.TensorAddType(b, s.TensorType.FLOAT32)
        s.TensorAddBuffer(b, k)
        s.TensorAddName(b, label)
        tensors.append(s.TensorEnd(b))
    tensor_vec = _vector(b, s.SubGraphStartTensorsVector, tensors)
    label = b.CreateString("lora")
    s.SubGraphStart(b)
    s.SubGraphAddTensors(b, tensor_vec)
    s.SubGraphAddName(b, label)
    graphs = _vector(b, s.ModelStartSubgraphsVector, [s.SubGraphEnd(b)])
    key = b.CreateString("lora_rank")
    s.MetadataStart(b)
    s.MetadataAddName(b, key)
    s.MetadataAddBuffer(b, rank)  # the rank itself, not a buffer index (LiteRT-LM's GetLoRARank)
    meta = _vector(b, s.ModelStartMetadataVector, [s.MetadataEnd(b)])
    about = b.CreateString("LoRA adapter, torchtpu-export")
    s.ModelStart(b)
    s.ModelAddVersion(b, 3)
    s.ModelAddSubgraphs(b, graphs)
    s.ModelAddBuffers(b, buffer_vec)
    s.ModelAddMetadata(b, meta)
    s.ModelAddDescription(b, about)
    b.Finish(s.ModelEnd(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _vector(b, start, items) -> int:
    start(b, len(items))
    for x in reversed(items):
        b.PrependUOffsetTRelative(x)
    return b.EndVector()


def read_adapter(path: str) -> dict:
    """An adapter file's tensors ``{name: (shape, offset, size)}`` and its rank, each checked (a regular file,
    a TFL3 flatbuffer, every buffer inside the file, sizes that match the shapes, finite values) before
    LiteRT-LM maps it."""
    import mmap

    from ..errors import ArtifactError
    from ..fileio import open_regular
    path = os.fspath(path)
    with open_regular(path, f"the adapter {path}") as (f, size):
        try:
            head = f.read(min(size, 16 << 20))
        except OSError as e:
            raise InputError(f"cannot read the adapter {path}: {e.strerror}") from None
        if len(head) < 8 or head[4:8] != b"TFL3":
            raise ArtifactError(f"{path} is not a LoRA adapter file (a TFLite flatbuffer)")
        rank, tensors = _adapter_tensors(path, head, size)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for name, (shape, offset, nbytes) in tensors.items():
                # a NaN or inf reaches every logit through the attention: LiteRT-LM then samples <pad> for ever
                if not np.isfinite(np.frombuffer(data, np.float32, nbytes // 4, offset)).all():
                    raise ArtifactError(f"{path}: tensor {name[:80]!r} holds NaN or infinite values")
    if rank not in RANKS:
        raise ArtifactError(f"{path}: its lora_rank is {rank}; LiteRT-LM takes {' or '.join(map(str, RANKS))}")
    return {"rank": rank, "tensors": tensors}


def _adapter_tensors(path: str, head: bytes, size: int) -> tuple:
    """``(lora_rank, {name: (shape, offset, size)})`` of the adapter flatbuffer ``head`` (of a file of
    ``size`` bytes), every tensor float32 data of its shape inside the file; ArtifactError otherwise."""
    from ai_edge_litert import schema_py_generated as s

    from ..errors import ArtifactError
    try:
        model = s.Model.GetRootAs(head, 0)
        rank = next((model.Metadata(i).Buffer() for i in range(model.MetadataLength())
                     if model.Metadata(i).Name() == b"lora_rank"), None)
        graph = model.Subgraphs(0)
        tensors = {}
        for i in range(graph.TensorsLength()):
            t = graph.Tensors(i)
            buf = model.Buffers(t.Buffer())
            shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
            need = 4 * math.prod(shape)
            name = (t.Name() or b"").decode("utf-8", "replace")
            if t.Type() != s.TensorType.FLOAT32 or buf.Size() != need or not 0 < buf.Offset() <= size - need:
                raise ArtifactError(f"{path}: tensor {name[:80]!r} is not float32 data of its shape inside the file "
                                    "(not a LoRA adapter)")
            tensors[name] = (shape, buf.Offset(), buf.Size())
    except ArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged flatbuffer makes the reader raise
        raise ArtifactError(f"{path}: the adapter's flatbuffer is damaged ({type(e).__name__})") from None
    return rank, tensors


def check_adapter(path: str, inputs: dict) -> None:
    """ArtifactError unless every tensor of the adapter at ``path`` is one of the bundle's LoRA ``inputs``
    (``{name: shape}``) with its shape: LiteRT-LM fails on a size mismatch only at the first prefill."""
    from ..errors import ArtifactError
    found = read_adapter(path)
    if not inputs:
        raise InputError("this bundle takes no LoRA adapter: its steps have no LoRA inputs",
                         hint="export the base with lora= (a PEFT folder, 16 or 32)")
    for name, (shape, _, _) in found["tensors"].items():
        if name not in inputs:
            raise ArtifactError(f"{path}: tensor {name[:80]!r} is not one of the bundle's LoRA inputs")
        if tuple(inputs[name]) != shape:
            raise ArtifactError(f"{path}: tensor {name} is {list(shape)}; the bundle takes {list(inputs[name])} "
                                "(another base, or another rank)")
