"""Hostile inputs, round 3, each reproduced as the review reported it: native code and zip-slip in a
.pt2, sparse and STRING tensors that corrupt LiteRT's memory, outputs that would replace inputs,
"exit 1" on hostile files, dimension expressions, memory far beyond the file, ONNX external data,
terminal escapes, and serve-web's connections. Each ends in one message and its exit code, within
the memory bound docs/security.md states (4x the file plus 300 MB), nothing left behind or run."""
import hashlib
import io
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.request
import zipfile

import numpy as np
import pytest
import torch

import tflite_craft
import torchtpu_export as tte
import zoo
from cli_checks import _clean, _cli_peak_rss_mb
from conftest import run_cli
from mutants import _rezip, mutate, mutations
from torchtpu_export.targets.litert import artifact as litert_format
from torchtpu_export import models
from torchtpu_export.errors import ArtifactError, InputError, TteError

MEMORY_BOUND_MB = 300  # plus 4x the file: what docs/security.md promises for any hostile file


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.l(x)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("round3")
    torch.manual_seed(0)
    m, x = Linear(), torch.randn(2, 4)
    ep = torch.export.export(m, (x,))
    torch.export.save(ep, d / "good.pt2")
    tte.export(m, (x,), platforms=("cpu",)).save(d / "good.tpu")
    tte.convert(m, (x,)).export(d / "good.tflite")
    tte.export(m, (x,), target="onnx").save(d / "good.onnx")
    return {"dir": d, "ep": ep, "pt2": d / "good.pt2", "tpu": d / "good.tpu", "tflite": d / "good.tflite",
            "onnx": d / "good.onnx"}


# ---- 1, 2: native code and zip-slip through a .pt2 ---------------------------------------------

CONSTRUCTOR = r"""
#include <stdio.h>
__attribute__((constructor)) static void pwn(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
"""


def _evil_pt2(tmp_path, ep, marker) -> str:
    src = tmp_path / "evil.c"
    src.write_text(CONSTRUCTOR % marker)
    lib = tmp_path / "model.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    meta = tmp_path / "model_metadata.json"
    meta.write_text('{"AOTI_DEVICE_KEY": "cpu"}')
    from torch.export.pt2_archive._package import package_pt2
    path = tmp_path / "evil.pt2"
    package_pt2(str(path), exported_programs=ep, aoti_files={"model": [str(lib), str(meta)]})
    return str(path)


def test_a_pt2_carrying_aotinductor_code_is_refused_before_torch_opens_it(files, tmp_path, monkeypatch):
    marker = tmp_path / "PWNED"
    evil = _evil_pt2(tmp_path, files["ep"], marker)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    for argv in ([evil, "--target", "litert", "-o", tmp_path / "o.tflite"], ["debug", evil, "--target", "litert"]):
        r = run_cli(*argv, env={"TMPDIR": str(private_tmp)})
        _clean(r, 2)
        assert "AOTInductor" in r.stderr
    assert not marker.exists() and not (tmp_path / "o.tflite").exists()
    assert [n for n in os.listdir(private_tmp) if not n.startswith("torchinductor")] == []
    # and torch's loader is never reached (in-process, the API path)
    from torch.export.pt2_archive import _package
    monkeypatch.setattr(_package, "load_pt2", lambda *a, **k: pytest.fail("torch opened the file"))
    with pytest.raises(InputError, match="AOTInductor"):
        models.load_model(evil)


@pytest.mark.parametrize("entry", ["data/aotinductor/model/../../../../../../../{victim}",
                                   "data/weights/../../../../../../../{victim}",
                                   "/{victim}"])
def test_zip_slip_entries_in_a_pt2_write_nothing(files, tmp_path, entry):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    evil = tmp_path / "slip.pt2"
    with zipfile.ZipFile(files["pt2"]) as zin, zipfile.ZipFile(evil, "w") as zout:
        root = zin.namelist()[0].split("/")[0]
        for name in zin.namelist():
            zout.writestr(name, zin.read(name))
        zout.writestr(f"{root}/" + entry.format(victim=str(victim).lstrip("/")), "overwritten")
    r = run_cli(evil, "--target", "litert", "-o", tmp_path / "o.tflite")
    _clean(r, 2)
    assert victim.read_text() == "precious"


def test_entries_no_exported_program_has_are_refused(files, tmp_path):
    for extra in ("data/executorch/model.pte", "xl_model_weights/model_param_config", "notes.txt"):
        evil = tmp_path / "extra.pt2"
        with zipfile.ZipFile(files["pt2"]) as zin, zipfile.ZipFile(evil, "w") as zout:
            root = zin.namelist()[0].split("/")[0]
            for name in zin.namelist():
                zout.writestr(name, zin.read(name))
            zout.writestr(f"{root}/{extra}", b"\0" * 16)
        with pytest.raises(InputError, match="not part of an exported program"):
            models.load_model(str(evil))


# ---- 3: sparse and STRING tensors --------------------------------------------------------------

def _crafted(tmp_path, name, content) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def _refused_everywhere(path):
    for argv in (["run", path], ["inspect", path]):
        r = run_cli(*argv)
        _clean(r, 5)
    with pytest.raises(ArtifactError):
        tte.load(path)
    from torchtpu_export.targets.litert import web
    with pytest.raises(ArtifactError):  # the models are checked before anything else is set up
        web.start_server([path], port=0, check_dtypes=False)


def test_well_formed_sparse_and_string_constants_run(tmp_path):
    x = np.ones((4, 4), np.float32)
    got = tte.load(_crafted(tmp_path, "s.tflite", tflite_craft.sparse_model()))(x)
    assert np.array_equal(got, x + np.diag([1.0, 2.0, 3.0, 4.0]).astype(np.float32))
    edge = tte.load(_crafted(tmp_path, "t.tflite", tflite_craft.string_model(tflite_craft.strings(b"ab", b"cde"))))
    y, s = edge(np.zeros(1, np.float32))
    assert list(s) == [b"ab", b"cde"]


@pytest.mark.parametrize("content", [
    tflite_craft.sparse_model(indices=(0, 1, 2, 100_000)),  # a column past the dense shape: heap corruption
    tflite_craft.sparse_model(segments=(0, 1, 2, 3, 9)),  # more values than indices
    tflite_craft.sparse_model(segments=(0, 3, 2, 3, 4)),  # segments going backwards
    tflite_craft.sparse_model(values=(1.0, 2.0)),  # fewer values than the indices say
], ids=["index-past-shape", "segment-past-indices", "segments-backwards", "short-values"])
def test_crafted_sparse_tensors_are_refused(tmp_path, content):
    _refused_everywhere(_crafted(tmp_path, "sparse.tflite", content))


@pytest.mark.parametrize("data", [
    np.array([2, 16, 0xFFFFFF, 0x7FFFFFFF], "<u4").tobytes(),  # offsets past the buffer: a segfault in GetTensor
    np.array([3, 20, 20, 20, 20], "<u4").tobytes(),  # three strings in a two-element tensor
    np.array([2, 16, 17, 16], "<u4").tobytes() + b"a",  # offsets going backwards
    b"\x02\x00",  # no header
], ids=["offsets-past-end", "count-vs-shape", "backwards", "no-header"])
def test_crafted_string_tensors_are_refused(tmp_path, data):
    _refused_everywhere(_crafted(tmp_path, "strings.tflite", tflite_craft.string_model(data)))


def run_crafted(path: str) -> dict:
    """Worker task: the whole EdgeModel path on one file (validation, then LiteRT's interpreter)."""
    try:
        edge = tte.load(path)
        x = np.ones(tuple(d if isinstance(d, int) else 1 for d in edge.inputs()[0].shape), np.float32)
        edge(x)
    except TteError as e:
        return {"status": "refused", "code": e.exit_code}
    except Exception as e:  # noqa: BLE001
        return {"status": "exception", "reason": f"{type(e).__name__}: {e}"}
    return {"status": "ran"}


def _structural_mutant(rng: random.Random) -> bytes:
    """A sparse or STRING model with one of its tables' values replaced by a hostile one."""
    big = rng.choice([0, 1, 3, 4, 5, 7, 255, 65_535, 2 ** 31 - 1, -1, -(2 ** 31)])
    if rng.random() < 0.5:
        indices, segments, values = [0, 1, 2, 3], [0, 1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0]
        target = rng.choice([indices, segments, values])
        target[rng.randrange(len(target))] = big
        if rng.random() < 0.3:
            target.append(big)
        return tflite_craft.sparse_model(indices=np.array(indices).astype(np.int32),
                                         segments=np.array(segments).astype(np.int32), values=values)
    words = np.frombuffer(tflite_craft.strings(b"ab", b"cde"), "<u4", 4).astype(np.int64).tolist()
    words[rng.randrange(len(words))] = big
    return tflite_craft.string_model(np.array(words).astype("<u4").tobytes() + b"abcde")


def test_sparse_and_string_mutants_never_crash_litert(tmp_path):
    """Structural and byte-level mutants of both crafted models: those that pass validation are run
    by LiteRT's interpreter in worker processes, where a signal is reported instead of ending the run."""
    from torchtpu_export.coverage import run_isolated
    rng = random.Random(11)
    originals = [tflite_craft.sparse_model(), tflite_craft.string_model(tflite_craft.strings(b"ab", b"cde"))]
    paths, tried, refused = [], 0, 0
    while len(paths) < 60 and tried < 4000:
        tried += 1
        if rng.random() < 0.5:
            data = _structural_mutant(rng)
        else:
            original = rng.choice(originals)
            data = mutate(original, mutations(rng, len(original)))
        try:
            litert_format.validate(data)
        except ArtifactError:
            refused += 1
            continue
        path = tmp_path / f"v{len(paths)}.tflite"
        path.write_bytes(data)
        paths.append(str(path))
    assert refused > 100 and len(paths) >= 20, (refused, len(paths))
    results = run_isolated([("test_artifact_contents:run_crafted", (p,)) for p in paths], jobs=2, timeout=60)
    bad = [(p, r) for p, r in zip(paths, results) if r.get("status") not in ("ran", "refused") or r.get("code") == 1]
    assert not bad, bad[:3]


# ---- 4: outputs never replace inputs ------------------------------------------------------------

def test_an_output_naming_an_input_is_refused(files, tmp_path):
    model = tmp_path / "m.pt2"
    shutil.copy(files["pt2"], model)
    before = model.read_bytes()
    r = run_cli(model, "--target", "litert", "-o", model)
    _clean(r, 7)
    os.link(model, tmp_path / "alias.tflite")  # another name of the same file
    r = run_cli(model, "--target", "litert", "-o", tmp_path / "alias.tflite")
    _clean(r, 7)
    assert model.read_bytes() == before
    flat = tmp_path / "m.tflite"
    shutil.copy(files["tflite"], flat)
    r = run_cli("run", flat, "-o", flat)
    _clean(r, 7)
    np.save(tmp_path / "x.npy", np.ones((2, 4), np.float32))
    r = run_cli("run", flat, "--inputs", tmp_path / "x.npy", "-o", tmp_path / "x.npy")
    _clean(r, 7)
    assert flat.read_bytes() == files["tflite"].read_bytes()
    assert np.load(tmp_path / "x.npy").shape == (2, 4)


def test_a_trailing_slash_is_exit_7_and_an_existing_output_keeps_its_mode(files, tmp_path):
    r = run_cli(files["pt2"], "--target", "litert", "-o", f"{tmp_path}/out.tflite/")
    _clean(r, 7)
    out = tmp_path / "private.tflite"
    out.write_bytes(b"old")
    out.chmod(0o600)
    r = run_cli(files["pt2"], "--target", "litert", "-o", out)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and out.read_bytes()[4:8] == b"TFL3"


# ---- 5: exit 1 on hostile files ---------------------------------------------------------------

def _with_manifest(src, dst, change):
    with zipfile.ZipFile(src) as zf:
        doc = json.loads(zf.read("manifest.json"))
    change(doc)
    dst.write_bytes(_rezip(src.read_bytes(), "manifest.json", json.dumps(doc).encode()))
    return dst


def _program(doc):
    return doc["programs"]["main"]


MANIFEST_CONFUSIONS = {
    "dims-list": lambda d: _program(d).update(dims=[1, 2]),
    "dims-value": lambda d: _program(d).update(dims={"s0": "wide"}),
    "calling-convention": lambda d: _program(d).update(calling_convention_version="10"),
    "mesh": lambda d: d.update(mesh={"axes": "model=8", "devices": 8}),
    "mesh-devices": lambda d: d.update(mesh={"axes": [["model", 2]], "devices": 8}),
    "ragged-outputs": lambda d: _program(d).update(ragged_outputs={"0": "x"}),
    "ragged-index": lambda d: _program(d).update(ragged_outputs={"7": 0}),
    "compiled-stats": lambda d: d.update(compiled={"v5e:2x2": {"main": {"stats": [], "device_kind": "TPU v5 lite"}}}),
    "kernels": lambda d: _program(d).update(kernels={"node": 1}),
    "sharding": lambda d: _program(d).update(sharding={"mode": "x", "weights": {"l.weight": "model"},
                                                       "inputs": [], "column_parallel": [], "row_parallel": []}),
    "uses-x64": lambda d: _program(d).update(uses_x64="yes"),
    "dim-text": lambda d: _program(d)["inputs"][0].update(shape=["(" * 5000 + "s0" + ")" * 5000, 4]),
}


@pytest.mark.parametrize("name", sorted(MANIFEST_CONFUSIONS))
def test_type_confusion_in_a_tpu_manifest_is_exit_5(files, tmp_path, name):
    path = _with_manifest(files["tpu"], tmp_path / "m.tpu", MANIFEST_CONFUSIONS[name])
    for argv in (["run", path], ["inspect", path]):
        _clean(run_cli(*argv), 5)


def _swap_weights(files, tmp_path, change) -> str:
    """A .tpu whose weights file was replaced (digest fixed up, as an attacker would)."""
    from torchtpu_export import safetensors_io
    with zipfile.ZipFile(files["tpu"]) as zf:
        weights = safetensors_io.read(zf.read("weights.safetensors"))
    buf = io.BytesIO()
    safetensors_io.write(buf, change(dict(weights)))
    blob = buf.getvalue()
    path = tmp_path / "w.tpu"
    data = _rezip(files["tpu"].read_bytes(), "weights.safetensors", blob)
    path.write_bytes(data)
    return str(_with_manifest(path, path, lambda d: d["digests"].update(
        {"weights.safetensors": hashlib.sha256(blob).hexdigest()})))


@pytest.mark.parametrize("change", [
    lambda w: dict(w, **{"l.weight": np.zeros((4, 3), np.float32)}),
    lambda w: dict(w, **{"l.weight": np.zeros((3, 4), np.float64)}),
    lambda w: dict(w, **{"l.bias": np.zeros((3, 1), np.float32)}),
], ids=["shape", "dtype", "rank"])
def test_weights_that_disagree_with_the_program_are_exit_5(files, tmp_path, change):
    path = _swap_weights(files, tmp_path, change)
    r = run_cli("run", path)
    _clean(r, 5)
    assert "weight" in r.stderr


def run_tpu_mutant(path: str) -> dict:
    """Worker task: the CLI's run on one .tpu (a crash is reported by the pool, an exit code here)."""
    from torchtpu_export import cli
    import contextlib
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli.main(["run", path])
    return {"status": "ran" if code == 0 else "refused", "code": code, "err": err.getvalue()[-300:]}


def test_mutated_programs_with_valid_digests_are_exit_5_or_run(files, tmp_path):
    """The program bytes mutated and the manifest's digest recomputed: load and run refuse them with
    exit 5 (or run them), never an internal error or a signal."""
    from torchtpu_export.coverage import run_isolated
    data = files["tpu"].read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        program = zf.read("programs/main/cpu.jaxexport")
    rng = random.Random(3)
    paths = []
    for i in range(120):
        mutant = mutate(program, mutations(rng, len(program)))
        path = tmp_path / f"p{i}.tpu"
        path.write_bytes(_rezip(data, "programs/main/cpu.jaxexport", mutant))
        _with_manifest(path, path, lambda d, m=mutant: d["digests"].update(
            {"programs/main/cpu.jaxexport": hashlib.sha256(m).hexdigest()}))
        paths.append(str(path))
    results = run_isolated([("test_artifact_contents:run_tpu_mutant", (p,)) for p in paths], jobs=2, timeout=120)
    bad = [r for r in results if r.get("code") not in (0, 5)]
    assert not bad, bad[:3]
    assert sum(r["code"] == 5 for r in results) > 30


def test_tflite_and_onnx_metadata_of_the_wrong_types_are_exit_5(files, tmp_path):
    from ai_edge_litert import schema_py_generated as fb
    import flatbuffers
    import onnx
    content = files["tflite"].read_bytes()
    obj = fb.ModelT.InitFromObj(fb.Model.GetRootAs(content, 0))
    meta = json.loads(bytes(obj.buffers[obj.metadata[0].buffer].data))
    sig = meta["signatures"]["serving_default"]
    for bad in ({**meta, "versions": [1]}, {**meta, "quantization": {"recipe": 5}},
                {**meta, "signatures": {"serving_default": {**sig, "dims": {"s0": [1]}}}},
                {**meta, "signatures": {"serving_default": {**sig, "constant_inputs": {"x": 1}}}},
                {**meta, "signatures": {"serving_default": {**sig, "inputs": [{"name": 1, "shape": [], "dtype": "x"}]}}}):
        obj.buffers[obj.metadata[0].buffer].data = np.frombuffer(json.dumps(bad).encode(), np.uint8)
        b = flatbuffers.Builder(0)
        b.Finish(obj.Pack(b), file_identifier=b"TFL3")
        path = tmp_path / "meta.tflite"
        path.write_bytes(b.Output())
        for argv in (["run", path], ["inspect", path]):
            _clean(run_cli(*argv), 5)
    model = onnx.load(files["onnx"])
    for value in ('{"inputs": 3}', '[1, 2]', "{not json", '{"inputs": [], "outputs": [], "in_spec": 1}'):
        for prop in model.metadata_props:
            if prop.key == "torchtpu_export":
                prop.value = value
        path = tmp_path / "meta.onnx"
        onnx.save(model, path)
        _clean(run_cli("run", path), 5)


def test_hostile_inputs_files_are_exit_2(files, tmp_path):
    d = tmp_path
    np.savez(d / "objects.npz", x=np.array([1, "a"], dtype=object))
    np.save(d / "structured.npy", np.zeros((2, 4), dtype=[("a", "<f4")]))
    np.save(d / "dates.npy", np.zeros((2, 4), dtype="datetime64[D]"))
    np.savez(d / "crc.npz", x=np.ones((2, 4), np.float32))
    raw = bytearray((d / "crc.npz").read_bytes())
    raw[raw.index(b"\x00\x00\x80\x3f") + 2] ^= 0xFF  # a data byte: the CRC no longer matches
    (d / "crc.npz").write_bytes(bytes(raw))
    for name in ("objects.npz", "structured.npy", "dates.npy", "crc.npz"):
        r = run_cli("run", files["tflite"], "--inputs", d / name)
        _clean(r, 2)
    np.save(d / "big_endian.npy", np.arange(8, dtype=">f4").reshape(2, 4))  # a valid array: it runs
    r = run_cli("run", files["tflite"], "--inputs", d / "big_endian.npy", "-o", d / "out.npz")
    assert r.returncode == 0, r.stderr
    expected = tte.load(files["tflite"])(np.arange(8, dtype=np.float32).reshape(2, 4))
    assert np.allclose(np.load(d / "out.npz")["output_0"], expected)


def test_a_stored_executable_is_never_loaded_on_the_manifests_word(files, tmp_path, monkeypatch):
    """An executable whose manifest says it is for this host's device kind (here a CPU) is not
    deserialized: only real TPU chips of its generation ever load one."""
    import jax
    from torchtpu_export.targets.tpu import aot as tpu_compile
    from torchtpu_export.runtimes import xla
    prog = tte.load(files["tpu"])
    art = prog.artifact
    art.programs["main"]["tpu"] = art.programs["main"]["cpu"]
    kind = jax.devices()[0].device_kind
    blob = b"not an executable"
    art.executables = {"v5e:2x2": {"main": blob}}
    art.manifest["compiled"] = {"v5e:2x2": {"main": {
        "stats": {}, "device_kind": kind, "devices": 1, "libtpu": tpu_compile.libtpu_version(),
        "jax": jax.__version__, "executable": {"file": "x", "sha256": hashlib.sha256(blob).hexdigest()}}}}
    monkeypatch.setattr(tpu_compile, "load_executable", lambda *a, **k: pytest.fail("deserialized"))
    runner = xla.XlaRunner(art, "main", platform="tpu", trust_stored_executables=True)
    assert runner.executable is None


# ---- 6: dimension expressions -------------------------------------------------------------------

def _with_dim(files, tmp_path, dim: str) -> str:
    from ai_edge_litert import schema_py_generated as fb
    import flatbuffers
    content = files["tflite"].read_bytes()
    obj = fb.ModelT.InitFromObj(fb.Model.GetRootAs(content, 0))
    meta = json.loads(bytes(obj.buffers[obj.metadata[0].buffer].data))
    meta["signatures"]["serving_default"]["outputs"][0]["shape"] = [dim, 3]
    obj.buffers[obj.metadata[0].buffer].data = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    b = flatbuffers.Builder(0)
    b.Finish(obj.Pack(b), file_identifier=b"TFL3")
    path = tmp_path / "dim.tflite"
    path.write_bytes(b.Output())
    return str(path)


@pytest.mark.parametrize("dim", ["(" * 5500 + "s0" + ")" * 5500, "s0+" * 800_000 + "1"], ids=["11KB", "2.4MB"])
def test_hostile_dimension_expressions_are_refused_quickly(files, tmp_path, dim):
    path = _with_dim(files, tmp_path, dim)
    t0 = time.monotonic()
    r = run_cli("run", path)
    _clean(r, 5)
    assert time.monotonic() - t0 < 60


def test_dimension_expressions_are_evaluated_without_recursion():
    from torchtpu_export.specs import eval_dim
    assert eval_dim("Max(1, (s0 - 1)//2 + 1) * 3 - -2", {"s0": 4}) == 8
    assert eval_dim("Mod(s0, 3) + FloorDiv(s0, 2)", {"s0": 7}) == 4
    for bad in ("(" * 200, "s0 **2", "__import__(1, 2)", "s0" + " + s0" * 100, "Max(1)", "1/2"):
        with pytest.raises(InputError):
            eval_dim(bad, {"s0": 1})


# ---- 7: memory far beyond the file --------------------------------------------------------------

def _bounded(argv, good_argv, file_size: int, code: int):
    """The CLI on a hostile file exits with ``code`` within the bound, measured against the same
    command on a good file (what loading torch, jax and LiteRT costs by itself)."""
    r, peak = _cli_peak_rss_mb(*argv)
    _clean(r, code)
    _, baseline = _cli_peak_rss_mb(*good_argv)
    assert peak < baseline + 4 * file_size / 2 ** 20 + MEMORY_BOUND_MB, (peak, baseline, r.stderr[-500:])
    return r


def test_a_small_deflated_npz_cannot_allocate_what_no_input_takes(files, tmp_path):
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (1 << 28,)})
            chunk = bytes(16 << 20)
            for _ in range(64):
                f.write(chunk)
    assert path.stat().st_size < 2 << 20
    good = tmp_path / "x.npy"
    np.save(good, np.ones((2, 4), np.float32))
    r = _bounded(["run", files["tflite"], "--inputs", path], ["run", files["tflite"], "--inputs", good],
                 path.stat().st_size, 2)
    assert "shape" in r.stderr


def test_a_pt2_whose_json_deflates_far_past_the_file_is_refused(files, tmp_path):
    path = tmp_path / "bomb.pt2"
    big = b'{"a": "' + b" " * (256 << 20) + b'"}'
    with zipfile.ZipFile(files["pt2"]) as zin, zipfile.ZipFile(path, "w") as zout:
        for name in zin.namelist():
            if name.endswith("models/model.json"):
                zout.writestr(name, big, compress_type=zipfile.ZIP_DEFLATED)
            else:
                zout.writestr(name, zin.read(name))
    del big
    size = path.stat().st_size
    assert size < 2 << 20
    r = _bounded([path, "--target", "litert", "-o", tmp_path / "o.tflite"],
                 [files["pt2"], "--target", "litert", "-o", tmp_path / "good.tflite"], size, 2)
    assert "expand" in r.stderr


def test_json_of_empty_objects_is_refused_in_bounded_memory(files, tmp_path):
    blob = b"[" + b"{}," * (21 << 20) + b"{}]"  # 63 MB: gigabytes once parsed
    path = tmp_path / "objects.tpu"
    path.write_bytes(_rezip(files["tpu"].read_bytes(), "manifest.json", blob))
    _bounded(["inspect", path], ["inspect", files["tpu"]], path.stat().st_size, 5)
    from torchtpu_export.untrusted import load_json
    small = b"[" + b"{}," * 100_000 + b"{}]"
    with pytest.raises(ArtifactError, match="far more than"):
        load_json(small, "a blob")
    with pytest.raises(ArtifactError, match="levels deep"):
        load_json(b"[" * 100 + b"]" * 100, "a blob")


def test_json_shape_counts_outside_strings_a_chunk_at_a_time(monkeypatch):
    from torchtpu_export import untrusted

    def shape(value):  # (containers, depth) of a parsed value
        if isinstance(value, (list, dict)):
            inner = [shape(v) for v in (value.values() if isinstance(value, dict) else value)]
            return 1 + sum(c for c, _ in inner), 1 + max((d for _, d in inner), default=0)
        return 0, 0
    # strings holding brackets, quotes and backslash runs of each parity, escaped or not
    values = [["\\", "\"[{", {"a\\\"]": [[]], "}\\": ["\\\\", "[\\"]}], {"x": "é中😀]]", "y": [{}, [[[]]]]},
              [[["\\" * k + '"' + "[" * k for k in range(6)]]]]
    texts = [t for v in values for t in (json.dumps(v), json.dumps(v, ensure_ascii=False), json.dumps(v, indent=1))]
    for chunk in (1, 2, 3, 5, 1 << 20):  # an escape or a string across the chunks' edges
        monkeypatch.setattr(untrusted, "_JSON_CHUNK", chunk)
        for text in texts:
            assert untrusted.json_shape(text.encode()) == shape(json.loads(text)), (chunk, text)


def test_tflite_metadata_has_a_size_cap(files, tmp_path):
    from ai_edge_litert import schema_py_generated as fb
    import flatbuffers
    obj = fb.ModelT.InitFromObj(fb.Model.GetRootAs(files["tflite"].read_bytes(), 0))
    obj.buffers[obj.metadata[0].buffer].data = np.frombuffer(b" " * (40 << 20), np.uint8)
    b = flatbuffers.Builder(0)
    b.Finish(obj.Pack(b), file_identifier=b"TFL3")
    path = tmp_path / "fat.tflite"
    path.write_bytes(b.Output())
    r = _bounded(["run", path], ["run", files["tflite"]], path.stat().st_size, 5)
    assert "metadata" in r.stderr


# ---- 8: ONNX external data ----------------------------------------------------------------------

def _external_onnx(folder, location: str) -> str:
    import onnx
    from onnx import TensorProto, helper
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[8], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", location), ("offset", "0"), ("length", "32")):
        w.external_data.add(key=k, value=v)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])], [w])
    path = folder / "m.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return str(path)


def test_onnx_external_data_outside_the_models_folder_is_refused(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_bytes(b"SECRET-KEY-MATERIAL-0123456789ab")
    models_dir = home / "models"
    models_dir.mkdir()
    for location in (".ssh/id_rsa", "../.ssh/id_rsa", str(home / ".ssh" / "id_rsa")):
        path = _external_onnx(models_dir, location)
        np.save(home / "x.npy", np.zeros(8, np.float32))
        r = run_cli("run", path, "--inputs", home / "x.npy", "-o", home / "out.npz", cwd=home)
        _clean(r, 5)
        assert not (home / "out.npz").exists()
    os.symlink(home / ".ssh" / "id_rsa", models_dir / "w.data")  # a link out of the folder
    r = run_cli("run", _external_onnx(models_dir, "w.data"), cwd=home)
    _clean(r, 5)


def test_onnx_external_data_beside_the_model_loads_from_any_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.data").write_bytes(np.arange(8, dtype=np.float32).tobytes())
    path = _external_onnx(folder, "w.data")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    np.save(elsewhere / "x.npy", np.ones(8, np.float32))
    r = run_cli("run", path, "--inputs", "x.npy", "-o", "out.npz", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(elsewhere / "out.npz")["y"], np.arange(8, dtype=np.float32) + 1)


# ---- 9: lesser points ----------------------------------------------------------------------------

def test_inspect_and_run_escape_terminal_controls_in_names(tmp_path):
    from ai_edge_litert import schema_py_generated as fb
    import flatbuffers
    obj = fb.ModelT.InitFromObj(fb.Model.GetRootAs(tflite_craft.sparse_model(), 0))
    evil = b"\x1b[2J\x1b]0;owned\x07\ncheck: OK all checks passed\r"
    obj.subgraphs[0].tensors[3].name = evil
    obj.signatureDefs[0].outputs[0].name = evil
    b = flatbuffers.Builder(0)
    b.Finish(obj.Pack(b), file_identifier=b"TFL3")
    path = tmp_path / "names.tflite"
    path.write_bytes(b.Output())
    for argv in (["inspect", path], ["run", path]):
        r = run_cli(*argv)
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\r" not in r.stdout and "\x07" not in r.stdout
        assert not any(line.startswith("check: OK") for line in r.stdout.splitlines())
        assert "\\x1b[2J" in r.stdout


def test_a_pickle_refusal_always_names_the_global(files, tmp_path):
    class Runs:
        def __reduce__(self):
            return (os.system, ("true",))

    payload = io.BytesIO()
    torch.save(((Runs(),), {}), payload)
    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(files["pt2"]) as zin, zipfile.ZipFile(evil, "w") as zout:
        for name in zin.namelist():
            zout.writestr(name, payload.getvalue() if name.endswith("sample_inputs/model.pt") else zin.read(name))
    r = run_cli(evil, "--target", "litert", "-o", tmp_path / "o.tflite")
    _clean(r, 2)
    assert "system" in r.stderr and "--trust-pickle" in r.stderr
    from torchtpu_export.models import _pickle_globals
    import pickle
    assert _pickle_globals(pickle.dumps(Runs()))[0].endswith("system")


def test_load_errors_say_what_went_wrong(files, tmp_path):
    broken = tmp_path / "broken.pt2"
    with zipfile.ZipFile(files["pt2"]) as zin, zipfile.ZipFile(broken, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            zout.writestr(name, data[:len(data) // 2] if name.endswith("models/model.json") else data)
    r = run_cli(broken, "--target", "litert", "-o", tmp_path / "o.tflite")
    _clean(r, 5)
    assert "warnings above" not in r.stderr and "JSON" in r.stderr


def test_serve_web_bounds_idle_connections_and_ignores_vanishing_clients(files, tmp_path, monkeypatch, capfd):
    import threading
    from torchtpu_export.targets.litert import web
    monkeypatch.setattr(web._Handler, "timeout", 1)
    monkeypatch.setattr(web.WebServer, "workers", 4)
    monkeypatch.setattr(web.WebServer, "backlog", 4)
    before = threading.active_count()
    vendor = tmp_path / "node_modules"  # the page's LiteRT.js files are not what this test asks for
    for pkg in web._VENDOR:
        (vendor / pkg).mkdir(parents=True)
        (vendor / pkg / "package.json").write_text("{}")
    server = web.start_server([files["tflite"]], port=0, litertjs=vendor)
    try:
        host, port = server.server_address[:2]
        idle = [socket.create_connection((host, port)) for _ in range(40)]  # far more than the pool holds
        time.sleep(0.5)
        assert threading.active_count() <= before + 1 + 4  # the accept loop and the workers, no more
        deadline = time.monotonic() + 30
        while True:  # the idle ones time out and free the pool
            try:
                if urllib.request.urlopen(server.url + "models.json", timeout=5).status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "idle connections were never dropped"
                time.sleep(0.5)
        for _ in range(5):  # ask for the model and reset the connection before reading the answer
            s = socket.create_connection((host, port))
            s.sendall(b"GET /model.tflite HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        for s in idle:
            s.close()
        time.sleep(1)
        assert urllib.request.urlopen(server.url, timeout=30).status == 200
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err


# ---- the whole CLI on mutants of every file it reads ------------------------------------------

def cli_exit(argv: list) -> dict:
    """Worker task: one CLI command; its exit code (a crash or hang is reported by the pool)."""
    import contextlib
    from torchtpu_export import cli
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            code = e.code
    return {"code": code, "err": err.getvalue()[-400:]}


def test_no_mutant_of_any_file_gets_exit_1_or_a_signal(files, tmp_path):
    """Byte mutants of a .tpu, .tflite, .onnx, .pt2 and an --inputs .npz through the commands that read
    them, each in a worker process: every one ends with an exit code of its own class (never 1, the
    internal-error code), no signal, no hang."""
    from torchtpu_export.coverage import run_isolated
    np.savez(tmp_path / "x.npz", x=np.ones((2, 4), np.float32))
    originals = {k: files[k].read_bytes() for k in ("tpu", "tflite", "onnx", "pt2")}
    originals["npz"] = (tmp_path / "x.npz").read_bytes()
    rng = random.Random(5)
    tasks = []
    for kind, data in originals.items():
        for i in range(40):
            path = tmp_path / f"m{i}.{kind}"
            path.write_bytes(mutate(data, mutations(rng, len(data))))
            if kind == "pt2":
                argv = [path, "--target", "litert", "-o", tmp_path / f"o{i}.tflite"]
            elif kind == "npz":
                argv = ["run", files["tflite"], "--inputs", path]
            else:
                argv = [("inspect", "run")[i % 2], path]
            tasks.append(("test_artifact_contents:cli_exit", (argv,)))
    results = run_isolated(tasks, jobs=2, timeout=120)
    bad = [(t[1][0], r) for t, r in zip(tasks, results) if r.get("code") in (1, None) or "status" in r]
    assert not bad, bad[:3]


def test_npy_files_come_back_as_saved(tmp_path):
    """The header-first reader gives what numpy saved: 0-d, Fortran order, big-endian, bool, bfloat16."""
    import ml_dtypes
    from torchtpu_export import npyfiles
    arrays = {"scalar": np.float32(3.5), "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              "big": np.arange(4, dtype=">i4"), "mask": np.array([True, False]),
              "bf16": np.arange(4, dtype=ml_dtypes.bfloat16)}
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
        (stored,) = npyfiles.scan(str(tmp_path / f"{name}.npy"))
        got = stored.load()
        assert got.shape == np.shape(a) and got.dtype == np.asarray(a).dtype.newbyteorder("=")
        assert np.array_equal(got.astype(np.float64), np.asarray(a).astype(np.float64))
    np.savez_compressed(tmp_path / "all.npz", **{k: v for k, v in arrays.items() if k != "bf16"})
    loaded = {s.name: s.load() for s in npyfiles.scan(str(tmp_path / "all.npz"))}
    assert set(loaded) == {"scalar", "fortran", "big", "mask"} and loaded["scalar"].shape == ()
