"""Fuzzing: mutated .tpu and .pt2 bytes given to inspect, run and load give clean errors, never a crash."""
import io
import json
import os
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchtpu_export as tte
from mutants import _rezip
from torchtpu_export import TteError, cli

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.l(x))


class Artifacts(dict):
    def __repr__(self):  # hypothesis prints fixtures of failing examples: keep it short
        return f"<artifacts {sorted(self)}>"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    torch.manual_seed(0)
    m, x = Tiny(), torch.randn(2, 4)
    tte.export(m, (x,), platforms=("cpu",)).save(d / "m.tpu")
    torch.export.save(torch.export.export(m, (x,)), d / "m.pt2")
    return Artifacts(tpu=(d / "m.tpu").read_bytes(), pt2=(d / "m.pt2").read_bytes())


def mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for kind, pos, value in ops:
        if not b:
            break
        i = pos % len(b)
        if kind == "flip":
            b[i] ^= value or 1
        elif kind == "truncate":
            b = b[:i]
        elif kind == "insert":
            b[i:i] = bytes([value])
        else:
            del b[i]
    return bytes(b)


OPS = st.lists(st.tuples(st.sampled_from(["flip", "truncate", "insert", "delete"]), st.integers(0, 2**31),
                         st.integers(0, 255)), min_size=1, max_size=6)


def _exercise(path, capsys):
    """inspect, run and load: each either works or raises/returns a clean error."""
    for argv in (["inspect", str(path)], ["run", str(path)]):
        code = cli.main(argv)
        _, err = capsys.readouterr()
        assert code in (0, 2, 5), err
        assert "Traceback" not in err and "internal error" not in err, err
    try:
        prog = tte.load(path)
        prog(np.ones((2, 4), np.float32))
    except TteError:
        pass


@SETTINGS
@given(ops=OPS)
def test_mutated_tpu_bytes(artifacts, tmp_path, capsys, ops):
    path = tmp_path / "fuzz.tpu"
    path.write_bytes(mutate(artifacts["tpu"], ops))
    _exercise(path, capsys)


@SETTINGS
@given(entry=st.sampled_from(["manifest.json", "weights.safetensors", "programs/main/cpu.jaxexport"]), ops=OPS)
def test_mutated_tpu_entries_in_valid_zip(artifacts, tmp_path, capsys, entry, ops):
    with zipfile.ZipFile(io.BytesIO(artifacts["tpu"])) as zf:
        content = zf.read(entry)
    path = tmp_path / "fuzz.tpu"
    path.write_bytes(_rezip(artifacts["tpu"], entry, mutate(content, ops)))
    _exercise(path, capsys)


@SETTINGS
@given(key=st.sampled_from(["format_version", "programs", "weights", "format"]),
       value=st.one_of(st.none(), st.integers(-5, 1000), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_manifest_fields_of_wrong_type(artifacts, tmp_path, capsys, key, value):
    with zipfile.ZipFile(io.BytesIO(artifacts["tpu"])) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    manifest[key] = value
    path = tmp_path / "fuzz.tpu"
    path.write_bytes(_rezip(artifacts["tpu"], "manifest.json", json.dumps(manifest).encode()))
    _exercise(path, capsys)


@SETTINGS
@given(ops=OPS)
def test_mutated_pt2_bytes(artifacts, tmp_path, capsys, ops):
    path = tmp_path / "fuzz.pt2"
    path.write_bytes(mutate(artifacts["pt2"], ops))
    out = tmp_path / "o.tpu"
    if out.exists():  # tmp_path is shared by the examples of one test
        out.unlink()
    code = cli.main([str(path), "--target", "tpu", "-o", str(tmp_path / "o.tpu"), "--platforms", "cpu"])
    _, err = capsys.readouterr()
    assert code in (0, 2, 3, 4, 5, 8), err
    assert "Traceback" not in err and "internal error" not in err, err
    if code != 0:
        assert not os.path.exists(tmp_path / "o.tpu")
