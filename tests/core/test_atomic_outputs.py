"""Atomic, deterministic outputs: no partial file on failure or Ctrl-C; identical bytes across processes."""
import hashlib
import os
import subprocess
import sys

import pytest
import torch

import torchtpu_export as tte
import zoo
from torchtpu_export import safetensors_io


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch, exc):
    model, args = zoo.small_cnn()
    prog = tte.export(model, args, platforms=("cpu",))
    out = tmp_path / "m.tpu"
    out.write_bytes(b"previous contents")

    def boom(*a, **k):
        raise exc("interrupted while writing weights")

    monkeypatch.setattr(safetensors_io, "write", boom)
    with pytest.raises(exc):
        prog.save(out)
    assert out.read_bytes() == b"previous contents"  # the old file is untouched
    assert os.listdir(tmp_path) == ["m.tpu"]  # and no temp file is left behind


def test_ctrl_c_in_cli_exits_130_without_output(tmp_path, monkeypatch, capsys):
    from torchtpu_export import cli
    from torchtpu_export.targets.tpu import artifact as tpu_format

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tpu_format.TpuArtifact, "save", interrupt)
    code = cli.main(["examples/zoo.py:small_cnn", "--target", "tpu", "-o", str(tmp_path / "m.tpu")])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "m.tpu").exists()


SCRIPT = """
import sys, torchtpu_export as tte
import zoo
target, path = sys.argv[1], sys.argv[2]
model, args = zoo.gpt(seq=16)
tte.export(model, args, target=target).save(path)
"""


@pytest.mark.parametrize("target,suffix", [("tpu", ".tpu"), ("litert", ".tflite")])
def test_same_model_gives_identical_bytes_across_processes(tmp_path, target, suffix):
    digests = []
    for i in range(2):
        path = tmp_path / f"m{i}{suffix}"
        env = dict(os.environ, PYTHONHASHSEED=str(i + 1), PYTHONWARNINGS="ignore")
        subprocess.run([sys.executable, "-c", SCRIPT, target, str(path)], check=True, env=env, timeout=600)
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
