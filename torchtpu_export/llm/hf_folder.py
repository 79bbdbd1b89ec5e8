"""Reading a Hugging Face model folder someone else made, before transformers or tokenizers sees it.

A file is read only if it is a regular file inside the folder: a symlink may point only to another
file of the folder, or, in a hub cache snapshot (``models--ORG--NAME/snapshots/REV/``, whose files
are links to ``../../blobs/SHA``), to a blob of that same model. Devices, FIFOs, directories and
links anywhere else are refused with InputError, as is a file over its size cap. transformers opens
files itself, so it is pointed at a private folder that holds only what was checked here
(:func:`staged`): the configs as read, and links to the checked weight files.

The safetensors headers are read here too (:func:`checkpoint`), each capped by the data it
describes, so a model can be compared with its checkpoint before anything of its size is allocated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import tempfile

from ..errors import InputError
from ..fileio import file_kind, open_regular, read_regular

MAX_CONFIG_BYTES = 4 << 20  # config.json, generation_config.json, tokenizer_config.json, chat templates
MAX_TOKENIZER_BYTES = 128 << 20  # tokenizer.json (Gemma 3's is 33 MB)
MAX_INDEX_BYTES = 32 << 20  # model.safetensors.index.json (DeepSeek-V3's, 91k tensors, is 9 MB)
# A header is a few hundred bytes per tensor, and a tensor holds kilobytes at least: a header over 1 MiB
# plus a ninth of its file (an eighth of its data) is padding or names of nothing, which safetensors would
# parse into gigabytes.
_HEADER_SLACK = 1 << 20
_HEADER_SHARE = 8

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _blobs(root: str) -> str | None:
    """The hub cache's ``models--*/blobs`` of a snapshot folder (already resolved), else None."""
    snapshots = os.path.dirname(root)
    model = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(model).startswith("models--"):
        return os.path.join(model, "blobs")
    return None


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _plain(name: str) -> bool:
    """A file name of the folder itself (no folder part, no ``..``)."""
    return bool(name) and name not in (".", "..") and "/" not in name and os.sep not in name and "\0" not in name


def file_path(folder: str, name: str) -> str | None:
    """The real path of the file ``name`` of ``folder`` (None when there is none), once it is known to be a
    regular file inside the folder or a blob of its own hub cache model; InputError otherwise."""
    root = os.path.realpath(folder)
    shown = os.path.join(folder, name)
    if not _plain(name):
        raise InputError(f"{shown}: a file name inside the model folder was expected")
    path = os.path.join(root, name)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise InputError(f"cannot read {shown}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(path)
        blobs = _blobs(root)
        if not (_inside(real, root) or (blobs is not None and _inside(real, blobs))):
            raise InputError(f"{shown} is a link to {real}, outside the model folder: not read",
                             hint="copy the file into the folder (links are followed only within it, or to "
                                  "the blobs of a Hugging Face cache snapshot)")
        try:
            st = os.stat(real)
        except OSError:
            raise InputError(f"{shown} is a link that leads to no file ({real})") from None
        path = real
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{shown} is not a regular file ({file_kind(st.st_mode)}): not read")
    return path


def read_bytes(folder: str, name: str, max_bytes: int) -> bytes | None:
    """The bytes of the file ``name`` of ``folder`` (None when there is none), at most ``max_bytes``."""
    path = file_path(folder, name)
    if path is None:
        return None
    # never blocks (a FIFO swapped in since) and never follows a link swapped in
    return read_regular(path, os.path.join(folder, name), max_bytes, follow_links=False)


def read_text(folder: str, name: str, max_bytes: int = MAX_CONFIG_BYTES) -> str | None:
    data = read_bytes(folder, name, max_bytes)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{os.path.join(folder, name)} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json(folder: str, name: str, max_bytes: int = MAX_CONFIG_BYTES) -> dict | None:
    """The JSON object in the file ``name`` of ``folder`` (None when there is none), parsed within the caps
    of :func:`untrusted.load_json`."""
    from ..untrusted import load_json
    data = read_bytes(folder, name, max_bytes)
    if data is None:
        return None
    shown = os.path.join(folder, name)
    value = load_json(data, shown, max_bytes=max_bytes, error=InputError)
    if not isinstance(value, dict):
        raise InputError(f"{shown} is not a JSON object")
    return value


# ---- the checkpoint ---------------------------------------------------------------------------

@dataclasses.dataclass
class Checkpoint:
    """The safetensors weights of a folder, as their headers describe them."""

    files: dict[str, str]  # name in the folder -> real path (the weight files, and the index if sharded)
    index: dict | None  # the index as transformers will read it (sharded checkpoints)
    tensors: int
    elements: int
    nbytes: int  # bytes of tensor data


def checkpoint(folder: str, config: dict) -> Checkpoint | None:
    """The folder's safetensors checkpoint, found as transformers finds it (``transformers_weights`` in
    config.json, else ``model.safetensors``, else the sharded index), every file and header checked;
    None when the folder has none."""
    named = config.get("transformers_weights")
    if named is not None:
        if not (isinstance(named, str) and _plain(named)
                and named.endswith((".safetensors", ".safetensors.index.json"))):
            raise InputError(f"{os.path.join(folder, 'config.json')}: transformers_weights must name a "
                             f".safetensors file or index of the folder itself, got {named!r:.200}")
        if file_path(folder, named) is None:
            raise InputError(f"{os.path.join(folder, 'config.json')}: transformers_weights names {named}, "
                             "which the folder does not hold")
        main = named
    else:
        main = WEIGHTS if file_path(folder, WEIGHTS) is not None else INDEX
    files, index = {}, None
    if main.endswith(".index.json"):
        raw = read_json(folder, main, MAX_INDEX_BYTES)
        if raw is None:
            return None
        index = _index(folder, main, raw)
        files[main] = file_path(folder, main)
        shards = sorted(set(index["weight_map"].values()))
    else:
        shards = [main]
    tensors = elements = nbytes = 0
    for name in shards:
        path = file_path(folder, name)
        if path is None:
            raise InputError(f"{os.path.join(folder, main)} names the shard {name}, which the folder does not hold")
        files[name] = path
        for dtype, shape, start, end in _header(folder, name, path).values():
            tensors += 1
            elements += (end - start) // dtype.itemsize
            nbytes += end - start
    if index is not None and len(index["weight_map"]) > tensors:
        raise InputError(f"{os.path.join(folder, main)} names {len(index['weight_map']):,} tensors; its shards "
                         f"hold {tensors:,}")
    return Checkpoint(files, index, tensors, elements, nbytes)


def _index(folder: str, name: str, raw: dict) -> dict:
    shown = os.path.join(folder, name)
    weight_map, metadata = raw.get("weight_map"), raw.get("metadata", {})
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise InputError(f"{shown}: weight_map must map tensor names to shard file names")
    for shard in set(weight_map.values()):
        if not (_plain(shard) and shard.endswith(".safetensors")):
            raise InputError(f"{shown} names the shard {shard!r}: shards are .safetensors files of the folder itself")
    if not isinstance(metadata, dict):
        raise InputError(f"{shown}: metadata must be a JSON object")
    return {"metadata": metadata, "weight_map": weight_map}


def _header(folder: str, name: str, path: str) -> dict:
    from ..safetensors_io import MAX_HEADER_BYTES, read_header
    with open_regular(path, os.path.join(folder, name), follow_links=False) as (f, size):
        cap = min(MAX_HEADER_BYTES, _HEADER_SLACK + max(size - 8, 0) // (_HEADER_SHARE + 1))
        try:
            return read_header(f, size, cap)
        except ValueError as e:
            raise InputError(f"{os.path.join(folder, name)}: {e}") from None
        except OSError as e:
            raise InputError(f"cannot read {os.path.join(folder, name)}: {e.strerror}") from None


@contextlib.contextmanager
def staged(jsons: dict[str, dict], ckpt: Checkpoint | None):
    """A private folder holding ``jsons`` (name -> the object read and checked) and links to the checked
    files of ``ckpt``: the only folder transformers is given, so it reads nothing that was not checked."""
    with tempfile.TemporaryDirectory(prefix="tte-hf-") as stage:
        if ckpt is not None:
            for name, path in ckpt.files.items():
                if name.endswith(".index.json"):
                    jsons = {**jsons, name: ckpt.index}
                else:
                    os.symlink(path, os.path.join(stage, name))
        for name, value in jsons.items():
            with open(os.path.join(stage, name), "w", encoding="utf-8") as f:
                json.dump(value, f)
        yield stage
