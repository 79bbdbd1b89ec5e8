"""The LiteRT reader takes the metadata format versions it knows, and refuses others with one clear error."""
import json

import numpy as np
import pytest
import torch

import torchtpu_export as tte
from torchtpu_export import cli
from torchtpu_export.errors import ArtifactError
from torchtpu_export.targets.litert import artifact


@pytest.fixture(scope="module")
def tflite(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("litert") / "linear.tflite"
    tte.convert(torch.nn.Linear(4, 4), (torch.randn(1, 4),)).export(path)
    return path


def _with_metadata(src, dst, change) -> None:
    """``src`` rewritten to ``dst`` with its torchtpu_export metadata changed by ``change(meta)`` (None:
    the metadata left out, as in a file made elsewhere)."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb
    obj = fb.ModelT.InitFromObj(fb.Model.GetRootAs(src.read_bytes(), 0))
    (entry,) = [m for m in obj.metadata if m.name.decode() == artifact.METADATA_NAME]
    if change is None:
        obj.metadata.remove(entry)
    else:
        meta = json.loads(bytes(obj.buffers[entry.buffer].data))
        change(meta)
        obj.buffers[entry.buffer].data = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    b = flatbuffers.Builder(0)
    b.Finish(obj.Pack(b), file_identifier=b"TFL3")
    dst.write_bytes(b.Output())


def test_written_version_is_read(tflite):
    meta = artifact.read_metadata(tflite.read_bytes(), verify=True)
    assert meta["format"] == artifact.FORMAT and meta["format_version"] == artifact.FORMAT_VERSION
    tte.load(tflite)


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_newer_version_refused(tflite, tmp_path, capsys, command):
    path = tmp_path / "new.tflite"
    _with_metadata(tflite, path, lambda m: m.update(format_version=99))
    with pytest.raises(ArtifactError) as e:
        tte.load(path)
    assert "format version 99" in str(e.value) and f"reads (format version {artifact.FORMAT_VERSION})" in str(e.value)
    assert "upgrade torchtpu-export" in e.value.hint
    code = cli.main([command, str(path)])
    err = capsys.readouterr().err
    assert code == 5, err
    assert err.startswith("error:") and "Traceback" not in err
    assert "format version 99" in err and "upgrade torchtpu-export" in err


@pytest.mark.parametrize("version", [None, "2", 0, True])
def test_unknown_version_refused(tflite, tmp_path, version):
    path = tmp_path / "odd.tflite"
    _with_metadata(tflite, path, lambda m: m.pop("format_version") if version is None
                   else m.update(format_version=version))
    with pytest.raises(ArtifactError, match=f"reads format version {artifact.FORMAT_VERSION}") as e:
        tte.load(path)
    assert e.value.hint
    assert cli.main(["inspect", str(path)]) == 5


def test_files_made_elsewhere_load(tflite, tmp_path):
    path = tmp_path / "plain.tflite"
    _with_metadata(tflite, path, None)
    assert artifact.read_metadata(path.read_bytes()) is None
    edge = tte.load(path)
    assert edge(np.ones((1, 4), np.float32)) is not None
    assert cli.main(["inspect", str(path)]) == 0
