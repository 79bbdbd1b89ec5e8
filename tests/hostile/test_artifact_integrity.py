"""Hostile and careless inputs, each reproduced as it was reported: a pickle inside a .pt2, special
output files, crafted .tflite buffers, zip bombs, flipped bits, SIGTERM, caller-dependent bytes,
sizes the machine cannot hold, shape mismatches, malformed safetensors and metadata, and requests
serve-web must not choke on. Every one ends in one message and its exit code, nothing left behind."""
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile

import numpy as np
import pytest
import torch

import torchtpu_export as tte
import zoo
from torchtpu_export import safetensors_io

from cli_checks import _cli_peak_rss_mb
from conftest import REPO, run_cli

MARKER_NAME = "PWNED"


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def evil_pt2(tmp_path):
    good = tmp_path / "good.pt2"
    torch.export.save(torch.export.export(Double(), (torch.randn(2, 3),)), good)
    marker = tmp_path / MARKER_NAME
    payload = io.BytesIO()
    torch.save(((Evil(str(marker)),), {}), payload)
    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(evil, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info, payload.getvalue() if info.filename.endswith("sample_inputs/model.pt") else data)
    return evil, marker


@pytest.mark.parametrize("command", [["--target", "litert"], ["--target", "tpu"], ["debug", "--target", "litert"]])
def test_a_pickle_in_a_pt2_never_runs_without_trust_pickle(evil_pt2, tmp_path, command):
    evil, marker = evil_pt2
    argv = [command[0], evil, *command[1:]] if command[0] == "debug" else [evil, *command, "-o", tmp_path / "o.out"]
    r = run_cli(*argv)
    assert r.returncode == 2 and "--trust-pickle" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()
    assert not (tmp_path / "o.out").exists()


def test_trust_pickle_is_what_lets_a_pt2_unpickle(evil_pt2, tmp_path):
    evil, marker = evil_pt2
    run_cli(evil, "--target", "litert", "--trust-pickle", "-o", tmp_path / "o.tflite")
    assert marker.exists()  # the flag means what it says: the file's code ran


def test_a_clean_pt2_still_converts_without_the_flag(tmp_path):
    good = tmp_path / "good.pt2"
    torch.export.save(torch.export.export(Double(), (torch.randn(2, 3),)), good)
    r = run_cli(good, "--target", "litert", "-o", tmp_path / "o.tflite", "--check")
    assert r.returncode == 0 and "check: OK" in r.stdout, r.stderr


def test_special_output_files_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.tflite"
    link.symlink_to(tmp_path / "target.tflite")
    for out in (fifo, "/dev/null", link):
        r = run_cli("examples/zoo.py:small_cnn", "--target", "litert", "-o", out)
        assert r.returncode == 7 and "only writes new or regular files" in r.stderr, r.stderr
    assert fifo.is_fifo() and os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert link.is_symlink() and not (tmp_path / "target.tflite").exists()


def _crafted_tflite(tmp_path, edit) -> str:
    from ai_edge_litert import schema_py_generated as fb
    import flatbuffers
    model, args = zoo.small_cnn()
    content = tte.convert(model, args).model_content()
    obj = fb.ModelT.InitFromObj(fb.Model.GetRootAs(content, 0))
    obj.metadata = None  # a file from elsewhere: no digest to catch anything
    edit(obj)
    b = flatbuffers.Builder(0)
    b.Finish(obj.Pack(b), file_identifier=b"TFL3")
    path = tmp_path / "crafted.tflite"
    path.write_bytes(b.Output())
    return str(path)


def _big_buffer(obj):
    return next(b for b in obj.buffers if b.data is not None and len(b.data) > 100)


def _offset_past_the_end(obj):
    buf = _big_buffer(obj)
    buf.data, buf.offset, buf.size = None, 2 ** 64 - 64, 128


def _huge_size(obj):
    buf = _big_buffer(obj)
    buf.data, buf.offset, buf.size = None, 1 << 20, 2 ** 64 - 8


def _short_data(obj):
    buf = _big_buffer(obj)
    buf.data = buf.data[:len(buf.data) // 2]


def _tensor_index(obj):
    op = obj.subgraphs[0].operators[0]
    op.inputs = np.array([10_000, *op.inputs[1:]], np.int32)


def _negative_dim(obj):
    t = obj.subgraphs[0].tensors[obj.subgraphs[0].inputs[0]]
    t.shape = np.array([-5, *t.shape[1:]], np.int32)


@pytest.mark.parametrize("edit,phrase", [(_offset_past_the_end, "past the file"), (_huge_size, "past the file"),
                                         (_short_data, "holds"), (_tensor_index, "names tensor 10000"),
                                         (_negative_dim, "negative dim")])
def test_crafted_tflite_is_refused_before_litert(tmp_path, edit, phrase):
    path = _crafted_tflite(tmp_path, edit)
    for argv in (["run", path], ["inspect", path]):
        r = run_cli(*argv)
        assert r.returncode == 5 and phrase in r.stderr and "Traceback" not in r.stderr, (argv, r.returncode, r.stderr)
    with pytest.raises(tte.ArtifactError):
        tte.load(path)


def test_malformed_metadata_in_a_tflite_is_exit_5(tmp_path):
    from ai_edge_litert import schema_py_generated as fb
    import flatbuffers
    model, args = zoo.small_cnn()
    content = tte.convert(model, args).model_content()
    obj = fb.ModelT.InitFromObj(fb.Model.GetRootAs(content, 0))
    for text in (b"{not json", b'{"signatures": [1, 2]}', b'{"signatures": {"serving_default": {"inputs": 3}}}'):
        obj.buffers[obj.metadata[0].buffer].data = np.frombuffer(text, np.uint8)
        b = flatbuffers.Builder(0)
        b.Finish(obj.Pack(b), file_identifier=b"TFL3")
        path = tmp_path / "meta.tflite"
        path.write_bytes(b.Output())
        r = run_cli("run", path)
        assert r.returncode == 5 and "Traceback" not in r.stderr, (text, r.stderr)


@pytest.fixture(scope="module")
def small_tpu(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpu") / "small.tpu"
    model, args = zoo.small_cnn()
    tte.export(model, args, platforms=("cpu",)).save(path)
    return path


def _rewrite(src, dst, change=None, compress=None, manifest=None):
    """A copy of a .tpu with one entry's bytes changed (digests left as they were unless asked)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if change and info.filename in change:
                data = change[info.filename]
            if info.filename == "manifest.json" and manifest:
                doc = json.loads(data)
                manifest(doc)
                data = json.dumps(doc).encode()
            kind = zipfile.ZIP_DEFLATED if compress and info.filename in compress else zipfile.ZIP_STORED
            zout.writestr(info.filename, data, compress_type=kind)


def test_a_zip_bomb_is_refused_in_bounded_memory(small_tpu, tmp_path):
    bomb = tmp_path / "bomb.tpu"
    _rewrite(small_tpu, bomb, change={"programs/main/cpu.jaxexport": b"\0" * (400 << 20)},
             compress={"programs/main/cpu.jaxexport"})
    assert bomb.stat().st_size < 2 << 20  # a small file that would expand to 400 MB
    _, baseline = _cli_peak_rss_mb("inspect", small_tpu)
    for command in ("inspect", "run"):
        r, peak = _cli_peak_rss_mb(command, bomb)
        assert r.returncode == 5 and "compressed" in r.stderr, r.stderr
        assert peak < baseline + 100, f"{command} peaked at {peak:.0f} MB, a good file's inspect at {baseline:.0f} MB"


def test_a_flipped_bit_in_a_program_is_caught_before_it_runs(small_tpu, tmp_path):
    data = bytearray(small_tpu.read_bytes())
    with zipfile.ZipFile(small_tpu) as zf:
        info = zf.getinfo("programs/main/cpu.jaxexport")
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 200] ^= 0x04
    flipped = tmp_path / "flipped.tpu"
    flipped.write_bytes(bytes(data))
    for argv in (["run", flipped], ["inspect", flipped]):
        r = run_cli(*argv)
        assert r.returncode == 5 and "does not match its sha256" in r.stderr, r.stderr


SLOW_WRITE = """
import os, sys, time
import zoo  # examples/ is on the PYTHONPATH conftest.py gives the processes tests start

_fsync = os.fsync


def _slow_fsync(fd):
    # the artifact's temporary file is written and about to be renamed into place: say so, then wait
    open({ready!r}, "w").close()
    time.sleep(60)
    _fsync(fd)


def model():
    os.fsync = _slow_fsync
    return zoo.small_cnn()
"""


@pytest.mark.parametrize("target,suffix", [("tpu", ".tpu"), ("litert", ".tflite")])
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_leave_no_partial_files(tmp_path, target, suffix, sig, code):
    out_dir, tmp_dir = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    tmp_dir.mkdir()
    ready = tmp_path / "ready"
    factory = tmp_path / "slow.py"
    factory.write_text(SLOW_WRITE.format(ready=str(ready)))
    proc = subprocess.Popen([sys.executable, "-m", "torchtpu_export", f"{factory}:model", "--target", target,
                             "-o", str(out_dir / f"m{suffix}")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp_dir), PYTHONWARNINGS="ignore"))
    deadline = time.monotonic() + 300
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), proc.communicate()[1]
    assert os.listdir(out_dir), "the temporary file should exist while the write is under way"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code and f"terminated ({signal.Signals(sig).name})" in err, (proc.returncode, err)
    ours = [n for n in os.listdir(tmp_dir) if not n.startswith("torchinductor")]  # torch's own cache folder
    assert os.listdir(out_dir) == [] and ours == [], (os.listdir(out_dir), ours)


SCRIPT = """
import sys, torchtpu_export as tte
import zoo  # examples/ is on the PYTHONPATH conftest.py gives the processes tests start
model, args = zoo.gpt(seq=16)
tte.export(model, args, target="tpu").save(sys.argv[1])
"""


def test_tpu_bytes_do_not_depend_on_the_caller_or_hold_its_paths(tmp_path):
    repo = REPO
    examples = os.path.join(repo, "examples")
    script = tmp_path / "one_script.py"
    script.write_text(SCRIPT)
    renamed = tmp_path / "elsewhere" / "another_name.py"
    renamed.parent.mkdir()
    renamed.write_text(SCRIPT)
    outs = []
    for i, argv in enumerate(([str(script)], [str(renamed)])):
        out = tmp_path / f"m{i}.tpu"
        subprocess.run([sys.executable, *argv, str(out)], check=True, cwd=tmp_path, timeout=600,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
        outs.append(out)
    r = run_cli(os.path.join(examples, "zoo.py:gpt"), "--target", "tpu", "--inputs", "1x16:int64:0:64",
                "-o", tmp_path / "cli.tpu")
    assert r.returncode == 0, r.stderr
    digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in outs}
    assert len(digests) == 1
    for p in outs:
        data = p.read_bytes()
        for path in (repo, str(tmp_path), os.path.expanduser("~")):
            assert path.encode() not in data, f"{p.name} holds {path}"
    cli_data = (tmp_path / "cli.tpu").read_bytes()
    assert repo.encode() not in cli_data and str(tmp_path).encode() not in cli_data


def test_sizes_the_machine_cannot_hold(small_tpu, tmp_path):
    r = run_cli("examples/zoo.py:small_cnn", "--target", "litert", "--inputs", "1000000x1000000:float32",
                "-o", tmp_path / "m.tflite")
    assert r.returncode == 2 and "GiB" in r.stderr and "--inputs" in r.stderr, r.stderr
    huge = tmp_path / "huge.tpu"

    def huge_input(doc):
        doc["programs"]["main"]["inputs"][0]["shape"] = [2 ** 40]
    _rewrite(small_tpu, huge, manifest=huge_input)
    r = run_cli("run", huge)
    assert r.returncode == 5 and "GiB" in r.stderr and "--inputs" not in r.stderr, r.stderr
    negative = tmp_path / "negative.tpu"

    def negative_dim(doc):
        doc["programs"]["main"]["inputs"][0]["shape"][0] = -3
    _rewrite(small_tpu, negative, manifest=negative_dim)
    for argv in (["run", negative], ["inspect", negative]):
        r = run_cli(*argv)
        assert r.returncode == 5 and "--inputs" not in r.stderr, r.stderr


def test_a_shape_mismatch_is_one_message_even_quiet(tmp_path):
    r = run_cli("examples/zoo.py:small_cnn", "--target", "litert", "-q", "--inputs", "1x5:float32",
                "-o", tmp_path / "m.tflite")
    assert r.returncode == 3, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 3 and "1x5:float32" in r.stderr and "1x3x32x32:float32" in r.stderr, r.stderr
    assert "control flow" not in r.stderr


def test_safetensors_offsets_are_not_trusted(small_tpu, tmp_path):
    with zipfile.ZipFile(small_tpu) as zf:
        weights = zf.read("weights.safetensors")
    (n,) = np.frombuffer(weights[:8], "<u8")
    header = json.loads(weights[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    for offsets in ([-8, header[name]["data_offsets"][1]], [0, 10 ** 12], [4, 2]):
        bad = dict(header, **{name: dict(header[name], data_offsets=offsets)})
        text = json.dumps(bad).encode()
        text += b" " * (-(len(text) + 8) % 8)
        blob = len(text).to_bytes(8, "little") + text + weights[8 + n:]
        with pytest.raises(ValueError):
            safetensors_io.read(blob)

        def fix_digest(doc, blob=blob):
            doc["digests"]["weights.safetensors"] = hashlib.sha256(blob).hexdigest()
        path = tmp_path / "w.tpu"
        _rewrite(small_tpu, path, change={"weights.safetensors": blob}, manifest=fix_digest)
        r = run_cli("inspect", path)
        assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr


@pytest.fixture
def served(tmp_path):
    model, args = zoo.small_cnn()
    path = tmp_path / "m.tflite"
    tte.convert(model, args).export(path)
    proc = subprocess.Popen([sys.executable, "-m", "torchtpu_export", "serve-web", str(path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    line = proc.stdout.readline()
    assert "serving m.tflite at" in line, line + proc.stderr.read()
    yield line.split(" at ", 1)[1].split()[0], proc
    proc.terminate()
    proc.wait(timeout=30)


def _status(url, host=None):
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code


def test_serve_web_answers_bad_requests_and_foreign_hosts_cleanly(served):
    url, proc = served
    port = url.rsplit(":", 1)[1].rstrip("/")
    assert _status(url) == 200
    assert _status(url + "a%00b") == 400
    assert _status(url + "a" * 9000) == 400
    assert _status(url + "%ff%fe") == 400
    assert _status(url, host="attacker.example:" + port) == 421
    assert _status(url + "models.json", host="localhost:" + port) == 200
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err
