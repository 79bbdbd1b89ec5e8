"""Pytree specs as text, for every structure torch.export takes and returns.

torch's ``treespec_dumps`` has no name for namedtuples it was not told about, torch's own
``torch.return_types`` (``torch.max(x, 1)``, ``topk``, ``sort``, ...) included. Here a spec
is JSON of its nodes: tuples, lists, dicts, None, and namedtuples by their type name and
field names. Loading builds nothing from the file but containers: a namedtuple comes back as
``torch.return_types``' own type, as the class of that name already imported in this process
if its fields match, or else as a new namedtuple with those fields (never by importing a
module the file names). Other registered pytree nodes go through torch's serialisation, which
needs their ``serialized_type_name``. Text from torch's ``treespec_dumps`` (older artifacts)
loads too.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import sys

import torch
import torch.utils._pytree as pytree

from .errors import ArtifactError, InputError

TAG = "torchtpu_export.treespec"


def dumps(spec: pytree.TreeSpec) -> str:
    return json.dumps({TAG: 1, "tree": _node(spec)}, separators=(",", ":"))


def loads(text: str) -> pytree.TreeSpec:
    """The TreeSpec of ``dumps`` (or of torch's ``treespec_dumps``); ArtifactError when malformed."""
    from .untrusted import load_json
    try:
        doc = load_json(text, "its text", max_bytes=1 << 20)
    except ArtifactError as e:
        raise ArtifactError(f"a pytree spec in the artifact is malformed: {e}", hint="export the model again") from None
    try:
        if isinstance(doc, dict) and TAG in doc:
            return pytree.tree_structure(_template(doc["tree"]), is_leaf=lambda x: x is _LEAF)
        return pytree.treespec_loads(text)
    except ArtifactError:
        raise
    except Exception as e:  # malformed JSON or nodes, from a damaged or hostile file
        raise ArtifactError(f"a pytree spec in the artifact is malformed ({type(e).__name__}: {str(e)[:120]})",
                            hint="export the model again") from e


def is_namedtuple_type(t) -> bool:
    """A namedtuple class, or a structseq (``torch.return_types``: fields in ``__match_args__``)."""
    return isinstance(t, type) and issubclass(t, tuple) and (hasattr(t, "_fields") or hasattr(t, "n_fields"))


def _fields(t) -> list[str]:
    return list(t._fields) if hasattr(t, "_fields") else list(t.__match_args__)


def _make(t, values: list):
    return t(*values) if hasattr(t, "_fields") else t(values)  # a structseq takes one sequence


def _node(spec: pytree.TreeSpec):
    if spec.is_leaf():
        return 0
    t, children = spec.type, [_node(c) for c in spec.children()]
    if t is tuple:
        return {"t": "tuple", "c": children}
    if t is list:
        return {"t": "list", "c": children}
    if t is type(None):
        return {"t": "none"}
    if t in (dict, collections.OrderedDict):
        return {"t": "dict" if t is dict else "ordereddict", "k": list(spec.context), "c": children}
    if t is collections.namedtuple and is_namedtuple_type(spec.context):  # torch's key for user namedtuples
        t = spec.context
    if is_namedtuple_type(t):
        return {"t": "namedtuple", "n": f"{t.__module__}.{t.__qualname__}", "f": _fields(t), "c": children}
    fields = _dataclass_fields(spec)
    if fields is not None:  # torch.utils._pytree.register_dataclass: by its field names, like a namedtuple
        return {"t": "dataclass", "n": f"{t.__module__}.{t.__qualname__}", "f": fields[0], "none": fields[1],
                "c": children}
    try:  # a node registered with a serialized_type_name: torch's own format
        return {"t": "torch", "s": pytree.treespec_dumps(spec)}
    except (NotImplementedError, TypeError, ValueError):
        pass
    raise InputError(
        f"the model takes or returns a {t.__module__}.{t.__qualname__}, a pytree node torchtpu-export cannot "
        "record in the artifact",
        hint="return tuples, lists or dicts, or register the type with torch.utils._pytree.register_pytree_node("
             "..., serialized_type_name='module.Name')")


_LEAF = object()


def _template(node):
    """A Python object with this structure, a sentinel at each leaf."""
    if node == 0:
        return _LEAF
    kind = node["t"]
    if kind == "none":
        return None
    children = [_template(c) for c in node.get("c", [])]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind in ("dict", "ordereddict"):
        keys = node["k"]
        if len(keys) != len(children) or not all(isinstance(k, (str, int)) for k in keys):
            raise ValueError("dict keys do not match its children")
        return (dict if kind == "dict" else collections.OrderedDict)(zip(keys, children))
    if kind == "namedtuple":
        return _make(namedtuple_type(node["n"], tuple(node["f"])), children)
    if kind == "dataclass":
        fields, none = tuple(node["f"]), tuple(node["none"])
        cls = dataclass_type(node["n"], fields, none)
        if cls is None:  # not loaded in this process: a namedtuple of the same fields stands in
            return namedtuple_type(node["n"], fields)(*children)
        return cls(**dict(zip(fields, children)), **dict.fromkeys(none))
    if kind == "torch":
        spec = pytree.treespec_loads(node["s"])
        return pytree.tree_unflatten([_LEAF] * spec.num_leaves, spec)
    raise ValueError(f"unknown node kind {kind!r}")


@functools.lru_cache(maxsize=None)
def namedtuple_type(name: str, fields: tuple) -> type:
    """torch.return_types' type, the loaded class of that name with these fields, or a new namedtuple."""
    if not all(isinstance(f, str) and f.isidentifier() for f in fields) or not isinstance(name, str):
        raise ValueError("namedtuple fields must be identifiers")
    module, _, qualname = name.rpartition(".")
    if module == "torch.return_types":
        t = getattr(torch.return_types, qualname, None)
        if is_namedtuple_type(t):
            return t
    obj = sys.modules.get(module)  # only a module this process imported itself
    for part in qualname.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    if is_namedtuple_type(obj) and tuple(_fields(obj)) == fields:
        return obj
    short = qualname.rsplit(".", 1)[-1]
    return collections.namedtuple(short if short.isidentifier() else "Outputs", fields)


def _dataclass_fields(spec: pytree.TreeSpec):
    """(field names, None-valued field names) of a node registered by register_dataclass, else None."""
    ctx = spec.context
    if not (dataclasses.is_dataclass(spec.type) and isinstance(ctx, (list, tuple)) and len(ctx) == 2):
        return None
    if not all(isinstance(part, (list, tuple)) and all(isinstance(n, str) for n in part) for part in ctx):
        return None
    return list(ctx[0]), list(ctx[1])


@functools.lru_cache(maxsize=None)
def dataclass_type(name: str, fields: tuple, none: tuple):
    """The dataclass of that name already imported in this process and registered as a pytree node
    with those fields, else None (no module is imported on a file's say-so)."""
    if not all(isinstance(f, str) and f.isidentifier() for f in fields + none):
        raise ValueError("dataclass fields must be identifiers")
    module, _, qualname = name.rpartition(".")
    obj = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj in pytree.SUPPORTED_NODES \
            and {f.name for f in dataclasses.fields(obj)} == set(fields + none):
        return obj
    return None


def same_structure(a: pytree.TreeSpec, b: pytree.TreeSpec) -> bool:
    """Equal specs, where namedtuples match by field names (a loaded spec may hold a look-alike class)."""
    if a.is_leaf() or b.is_leaf():
        return a.is_leaf() and b.is_leaf()
    ta, tb = _node_type(a), _node_type(b)
    record_a, record_b = _record_fields(a), _record_fields(b)
    if record_a is not None and record_b is not None:  # namedtuples, dataclasses, stand-ins for either
        if record_a != record_b:
            return False
    elif ta is not tb or a.context != b.context:
        return False
    return a.num_children == b.num_children and all(same_structure(x, y) for x, y in zip(a.children(), b.children()))


def _record_fields(spec: pytree.TreeSpec):
    t = _node_type(spec)
    if is_namedtuple_type(t):
        return _fields(t)
    fields = _dataclass_fields(spec)
    return fields[0] if fields is not None else None


def _node_type(spec: pytree.TreeSpec):
    return spec.context if spec.type is collections.namedtuple else spec.type


# ---- litert-torch's signature names ------------------------------------------------------------

def input_names(in_spec: pytree.TreeSpec) -> list[str]:
    """A name per leaf of ``(args, kwargs)`` as litert-torch names signature inputs: positional
    ``args_<i>``, keyword ones by their key, nested ones by the path (``z_data_2_0_foo``)."""
    args_spec, kwargs_spec = in_spec.children()
    return [f"args_{n}" for n in _path_names(args_spec)] + _path_names(kwargs_spec)


def output_names(out_spec: pytree.TreeSpec) -> list[str]:
    """A name per output leaf as litert-torch names signature outputs: ``output_<i>``, unless the
    outputs are keyed (a dict, a dataclass): then their paths (``y_data_2_0``)."""
    if out_spec.is_leaf() or _keys(out_spec) is None:
        return [f"output_{i}" for i in range(out_spec.num_leaves)]
    return _path_names(out_spec)


def unique(names: list[str]) -> list[str]:
    """``names`` with repeats made distinct (a path can flatten to another's name) by a ``_<n>`` suffix."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        k = n
        while k in seen:
            seen[n] += 1
            k = f"{n}_{seen[n]}"
        seen.setdefault(k, 0)
        out.append(k)
    return out


def _keys(spec: pytree.TreeSpec) -> list | None:
    """The child names of a keyed node (dict keys, dataclass or namedtuple fields), else None."""
    t = _node_type(spec)
    if t in (dict, collections.OrderedDict):
        return [str(k) for k in spec.context]
    if is_namedtuple_type(t):
        return _fields(t)
    if dataclasses.is_dataclass(t) and isinstance(spec.context, (list, tuple)) and spec.context \
            and isinstance(spec.context[0], (list, tuple)):
        return [str(k) for k in spec.context[0]]  # register_dataclass: (field names, None fields)
    return None


def _path_names(spec: pytree.TreeSpec) -> list[str]:
    if spec.is_leaf():
        return [""]
    keys = _keys(spec) or [str(i) for i in range(spec.num_children)]
    names = []
    for key, child in zip(keys, spec.children()):
        names += [f"{key}_{rest}" if rest else key for rest in _path_names(child)]
    return names
