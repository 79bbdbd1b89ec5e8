"""Hostile NPU-compiled files, as the red team reported them: two changed bytes of a QNN context
binary ran unnoticed (15 of 20) or crashed QNN's HTP simulator (SIGSEGV). Every file
``npu.compile_model`` writes now carries a sha256 of the whole file in a metadata entry that LiteRT's
AOT path keeps in place (docs/guides/npus.md); it is checked before any runtime is handed the file.
Also the "exit 1" cases of the same report and their neighbours: ``--ai-pack`` through symlinks,
``run --runtime compiled_model`` on an NPU file, damaged operator tables."""
import json
import os
import platform
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import torchtpu_export as tte
import zoo
from conftest import run_cli
from torchtpu_export.targets.litert import npu
from torchtpu_export.errors import ArtifactError
from torchtpu_export.targets.litert.artifact import validate

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="QNN's host libraries and HTP simulator are x86-64 Linux only")

SOC = "qualcomm:SM8650"
TOL = 1e-3  # small_cnn on the HTP's fp16 arithmetic (measured 4.2e-4; tests/targets/litert/test_npu.py)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """small_cnn for the CPU and compiled for SM8650, a sample input and torch's output."""
    from torchtpu_export.runtimes.qnn_htp import available
    assert available() is None, available()
    assert npu.qnn_library_dirs(), "QNN's host libraries are not in <venv>/qairt: run `make`"
    d = tmp_path_factory.mktemp("npu")
    model, args = zoo.small_cnn()
    with torch.no_grad():
        ref = model(*args).numpy()
    cpu = tte.convert(model, args).model_content()
    (d / "cnn.tflite").write_bytes(cpu)
    (r,) = npu.soc_results(npu.compile_model(cpu, npu.parse_targets(SOC)))
    (d / "npu.tflite").write_bytes(r.content)
    np.save(d / "x.npy", args[0].numpy())
    return {"dir": d, "cpu": d / "cnn.tflite", "npu": d / "npu.tflite", "x": d / "x.npy", "ref": ref,
            "content": r.content}


def _one_message(r, code: int, text: str) -> None:
    """Exit ``code`` with one ``error:`` line (and its hint) naming ``text``: no traceback, no runtime's log."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == code and lines and lines[0].startswith("error: ") and text in lines[0] \
        and all(line.startswith("  hint: ") for line in lines[1:]) and len(lines) <= 2, (r.returncode, r.stderr[-2000:])


def _rel_err(y, ref) -> float:
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())


def _span(content: bytes) -> tuple[int, int]:
    (d,) = npu.dispatch_ops(validate(content), content)
    return d["bytecode_offset"], d["bytecode_size"]


def _with_option(content: bytes, key: str, value: int) -> bytes:
    # the DISPATCH_OP's custom option ``key`` changed in place (flexbuffers keeps it as an 8-byte int)
    from flatbuffers import flexbuffers
    op = validate(content).Subgraphs(0).Operators(0)
    opts = bytes(op.CustomOptionsAsNumpy())
    old = int(flexbuffers.Loads(opts)[key]).to_bytes(8, "little")
    assert content.count(opts) == 1 and opts.count(old) == 1
    new_opts = opts.replace(old, value.to_bytes(8, "little"))
    out = content.replace(opts, new_opts)
    assert flexbuffers.Loads(new_opts)[key] == value
    return out


def test_red_team_two_changed_bytes_of_the_context_binary_are_refused_before_the_simulator(files, tmp_path):
    content = files["content"]
    offset, size = _span(content)
    rnd = random.Random(20261204)
    mutants = []
    for k in range(20):  # as the report: 20 files, 2 bytes of the context binary each
        data = bytearray(content)
        for _ in range(2):
            data[offset + rnd.randrange(size)] ^= 1 + rnd.randrange(255)
        mutants.append(tmp_path / f"m{k}.tflite")
        mutants[-1].write_bytes(bytes(data))
    for path in mutants[:2]:  # the command line: one message, exit 5, nothing from QNN
        r = run_cli("run", path, "--runtime", "qnn_htp", "--inputs", files["x"])
        _one_message(r, 5, "changed after compilation")
        assert "onnxruntime" not in r.stdout + r.stderr and "output_0" not in r.stdout
    r = run_cli("inspect", mutants[0])
    assert r.returncode == 0 and "NPU digest: MISMATCH" in r.stdout, r.stderr
    # all 20 through the Python API in one worker process, which reports a signal if QNN were reached and crashed
    script = textwrap.dedent("""
        import sys, numpy as np, torchtpu_export as tte
        x = np.load(sys.argv[1])
        for path in sys.argv[2:]:
            try:
                tte.load(path).run_flat([x], runtime="qnn_htp")
                print("RAN", path)
            except tte.ArtifactError as e:
                print("REFUSED" if "changed after compilation" in str(e) else f"OTHER {e}")
    """)
    r = subprocess.run([sys.executable, "-c", script, str(files["x"]), *map(str, mutants)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["REFUSED"] * 20, r.stdout


def test_changed_bytecode_offsets_and_sizes_and_the_digest_itself_are_refused(files, tmp_path):
    content = files["content"]
    offset, size = _span(content)
    cases = {
        "offset": _with_option(_with_option(content, "bytecode_offset", offset + 64), "bytecode_size", size - 64),
        "size": _with_option(content, "bytecode_size", size - 4096),  # both still inside the file
        "digest": _flip_digest(content),
        "weights_metadata": content.replace(b'"weights_blake2b"', b'"weights_blake2B"', 1),
        "soc_name": content.replace(b"SM8650", b"SM8750", 1),  # the stamp or the bytecode
    }
    for name, data in cases.items():
        assert data != content, name
        path = tmp_path / f"{name}.tflite"
        path.write_bytes(data)
        if name in ("offset", "size"):  # the command line, as reported
            _one_message(run_cli("run", path, "--runtime", "qnn_htp", "--inputs", files["x"]), 5,
                         "changed after compilation")
        with pytest.raises(ArtifactError, match="changed after compilation"):
            tte.load(path).run_flat([np.load(files["x"])], runtime="qnn_htp")
    # offsets past the file are refused by what reads them, before the digest
    path = tmp_path / "outside.tflite"
    path.write_bytes(_with_option(content, "bytecode_offset", len(content) - 100))
    _one_message(run_cli("run", path, "--runtime", "qnn_htp"), 5, "outside the file")
    _one_message(run_cli("inspect", path), 5, "outside the file")


def _flip_digest(content: bytes) -> bytes:
    at = content.index(b"torchtpu-export npu sha256 v1 ") + len(b"torchtpu-export npu sha256 v1 ")
    hexdigit = content[at:at + 1]
    return content[:at] + (b"0" if hexdigit != b"0" else b"1") + content[at + 1:]


def test_untouched_compiled_files_carry_a_matching_digest_and_run(files, tmp_path):
    content = files["content"]
    model = validate(content)
    assert npu.digest_state(content, model) == "ok"
    r = run_cli("inspect", files["npu"])
    assert r.returncode == 0 and "NPU digest: ok" in r.stdout, r.stderr
    r = run_cli("inspect", files["npu"], "--json")  # was exit 1: numpy ints in the partitions' tensor lists
    assert r.returncode == 0 and json.loads(r.stdout)["npu"]["digest"] == "ok", r.stderr
    r = run_cli("run", files["npu"], "--runtime", "qnn_htp", "--inputs", files["x"], "-o", tmp_path / "y.npz")
    assert r.returncode == 0, r.stderr
    assert _rel_err(np.load(tmp_path / "y.npz")["output_0"], files["ref"]) <= TOL
    # the Python API's CompilationResult holds the digest too; its CPU fallback is the model as given
    from ai_edge_litert.aot.vendors import fallback_backend
    model_, args = zoo.small_cnn()
    result = tte.experimental_add_compilation_backend(SOC).experimental_add_compilation_backend(
        fallback_backend.FallbackTarget()).convert(model_, args)
    (_, soc), (_, fallback) = result.models_with_backend
    assert npu.digest_state(soc.model_bytes, validate(soc.model_bytes)) == "ok"
    assert fallback.model_bytes == tte.convert(model_, args).model_content()
    assert npu.DIGEST_NAME.encode() not in fallback.model_bytes


def test_weights_after_the_flatbuffer_move_with_the_digests_entry(files, tmp_path):
    # a model that keeps its weights after the flatbuffer (as past 2 GB): the entry put in front of
    # it moves them, and the NPU compiler must still read the right weights
    ext = _external_weights(files["cpu"].read_bytes())
    m = validate(ext)
    assert any(m.Buffers(i).Offset() > 1 for i in range(m.BuffersLength()))
    (r,) = npu.soc_results(npu.compile_model(ext, npu.parse_targets(SOC)))
    path = tmp_path / "ext_npu.tflite"
    path.write_bytes(r.content)
    y = tte.load(path).run_flat([np.load(files["x"])], runtime="qnn_htp")[0]
    assert _rel_err(y, files["ref"]) <= TOL


def _external_weights(content: bytes) -> bytes:
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb
    model = fb.ModelT.InitFromPackedBuf(content, 0)
    meta = {m.buffer for m in model.metadata or []}
    moved = [(b, b.data.tobytes()) for i, b in enumerate(model.buffers)
             if i not in meta and b.data is not None and len(b.data)]
    for b, data in moved:
        b.data, b.offset, b.size = None, 1 << 40, len(data)

    def pack():
        builder = flatbuffers.Builder(1 << 16)
        builder.ForceDefaults(True)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())

    pos = (len(pack()) + 15) // 16 * 16 + 16
    for b, data in moved:
        b.offset, pos = pos, (pos + len(data) + 15) // 16 * 16
    out = bytearray(pack())
    for b, data in moved:
        out += b"\0" * (b.offset - len(out)) + data
    return bytes(out)


def test_a_file_without_our_digest_runs_only_when_allowed(files, tmp_path):
    # as LiteRT's own aot_compile writes it: no torchtpu_export_npu entry (renamed here, same length)
    data = files["content"].replace(npu.DIGEST_NAME.encode(), b"litert_compiled_npu", 1)
    assert len(npu.DIGEST_NAME) == len("litert_compiled_npu")
    path = tmp_path / "foreign.tflite"
    path.write_bytes(data)
    r = run_cli("inspect", path)
    assert r.returncode == 0 and "NPU digest: absent" in r.stdout, r.stderr
    r = run_cli("run", path, "--runtime", "qnn_htp", "--inputs", files["x"])
    _one_message(r, 5, "no torchtpu-export digest")
    assert "allow_unverified_npu" in r.stderr
    edge = tte.load(path)
    with pytest.raises(ArtifactError, match="no torchtpu-export digest"):
        edge.run_flat([np.load(files["x"])], runtime="qnn_htp")
    y = edge.run_flat([np.load(files["x"])], runtime="qnn_htp", allow_unverified_npu=True)[0]
    assert _rel_err(y, files["ref"]) <= TOL


def test_cpu_runtimes_are_never_handed_an_npu_file(files, tmp_path):
    # was exit 1: CompiledModel loaded vendors' dispatch libraries and failed inside LiteRT
    for runtime in ("compiled_model", "interpreter"):
        r = run_cli("run", files["npu"], "--runtime", runtime)
        _one_message(r, 5, "compiled for a phone NPU (DISPATCH_OP)")
        assert "qnn_htp" in r.stderr and "Dispatch" not in r.stderr
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(_flip_digest(files["content"]))
    _one_message(run_cli("run", bad, "--runtime", "compiled_model"), 5, "changed after compilation")
    _one_message(run_cli("run", files["npu"], "--runtime", "npu"), 2, "unknown LiteRT runtime")


def _damage_first_opcode(content: bytes) -> bytes:
    # the first OperatorCode table's vtable pointer sent far outside the file (validate() reads
    # only opcode indices; the opcode tables themselves are read later)
    import struct
    u32 = lambda pos: struct.unpack_from("<I", content, pos)[0]  # noqa: E731
    root = u32(0)
    vtable = root - struct.unpack_from("<i", content, root)[0]
    field = root + struct.unpack_from("<H", content, vtable + 6)[0]  # Model.operator_codes
    vec = field + u32(field)
    table = vec + 4 + u32(vec + 4)
    data = bytearray(content)
    struct.pack_into("<i", data, table, -0x40000000)
    return bytes(data)


def test_damaged_operator_tables_are_exit_5_not_1(files, tmp_path):
    bad_npu, bad_cpu = tmp_path / "npu.tflite", tmp_path / "cpu.tflite"
    bad_npu.write_bytes(_damage_first_opcode(files["content"]))
    bad_cpu.write_bytes(_damage_first_opcode(files["cpu"].read_bytes()))
    _one_message(run_cli("run", bad_npu, "--runtime", "qnn_htp"), 5, "operators are damaged")
    _one_message(run_cli("compile", bad_cpu, "--soc", SOC, "-o", tmp_path / "out"), 5, "operators are damaged")
    assert not (tmp_path / "out").exists()


def test_ai_pack_through_symlinks(files, tmp_path):
    d = tmp_path
    (d / "empty").mkdir()
    (d / "afile").write_bytes(b"")
    os.symlink(d / "empty", d / "l_empty")
    os.symlink(d / "nowhere", d / "l_dangling")
    os.symlink(d / "afile", d / "l_file")
    src = files["cpu"]
    for folder, code, text in [("l_empty", 7, "is a symbolic link"),  # was exit 1 (NotADirectoryError)
                               ("l_empty/", 7, "is a symbolic link"),
                               ("l_dangling", 7, "is a symbolic link"),  # was exit 1
                               ("l_dangling/pack", 7, "a symbolic link to nothing"),  # was exit 1
                               ("l_file/pack", 7, "is not a folder"),  # was exit 1
                               ("afile/pack", 7, "is not a folder"),  # was exit 1
                               ("", 2, "--ai-pack is empty")]:
        r = run_cli("compile", src, "--soc", SOC, "--ai-pack", str(d / folder) if folder else "")
        _one_message(r, code, text)
    assert os.listdir(d / "empty") == [] and not (d / "nowhere").exists()
    assert not [n for n in os.listdir(d) if n.startswith(".tte-aipack-")]
    # a path through a link to a folder is an ordinary path: the pack goes where it points
    r = run_cli("compile", src, "--soc", SOC, "--ai-pack", d / "l_empty" / "pack")
    assert r.returncode == 0, r.stderr
    soc = d / "empty" / "pack" / "cnn" / "src" / "main" / "assets" / "model#group_Qualcomm_SM8650" / "cnn.tflite"
    data = soc.read_bytes()
    assert npu.digest_state(data, validate(data)) == "ok"


def test_compile_output_folder_through_links_and_files(files, tmp_path):
    d = tmp_path
    (d / "afile").write_bytes(b"")
    os.symlink(d / "nowhere", d / "l_dangling")
    src = files["cpu"]
    for folder, code, text in [("l_dangling", 7, "a symbolic link to nothing"),  # was exit 1 (FileExistsError)
                               ("l_dangling/sub", 7, "a symbolic link to nothing"),  # was exit 1
                               ("afile/sub", 7, "is not a folder"),  # was exit 1 (NotADirectoryError)
                               ("", 2, "-o is empty")]:
        r = run_cli("compile", src, "--soc", SOC, "-o", str(d / folder) if folder else "")
        _one_message(r, code, text)
    assert not (d / "nowhere").exists()
