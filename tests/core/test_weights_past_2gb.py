"""Past 2 GB: a model with more weights than a flatbuffer can hold converts to both targets,
saves, loads back from disk and runs like eager (the .tflite keeps its weights after the
flatbuffer, referenced by offset and size)."""
import gc
import os

import numpy as np
import torch
from ai_edge_litert import schema_py_generated as fb

import torchtpu_export as tte

ROWS, DIM, TABLES = 1_536_000, 128, 3  # 3 x 750 MB of float32: 2.25 GiB, past the 2 GiB flatbuffer limit


class Tables(torch.nn.Module):
    """Embedding tables and a linear head (a recommender's shape), filled cheaply but distinctly."""

    def __init__(self):
        super().__init__()
        rows = torch.remainder(torch.arange(ROWS, dtype=torch.float32), 997.0)[:, None] * 1e-3
        cols = torch.arange(DIM, dtype=torch.float32)[None, :] * 1e-2
        tables = []
        for i in range(TABLES):
            w = torch.empty(ROWS, DIM)
            torch.add(rows, cols + i, out=w)  # row- and table-dependent: a wrong row or table shows
            tables.append(torch.nn.Embedding.from_pretrained(w, freeze=True))
        self.tables = torch.nn.ModuleList(tables)
        torch.manual_seed(0)
        self.head = torch.nn.Linear(DIM * TABLES, 16)

    def forward(self, idx):
        return self.head(torch.cat([t(idx[:, i]) for i, t in enumerate(self.tables)], dim=-1))


def test_weights_past_2gb_convert_save_load_and_run_on_both_targets(tmp_path):
    model = Tables().eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes > 2**31
    # first and last rows of every table, and some between
    idx = torch.tensor([[0, ROWS - 1, 5], [ROWS - 1, 0, 123_457], [999_983, 17, ROWS - 2], [1, 2, 3]])
    with torch.no_grad():
        ref = model(idx).numpy()

    edge = tte.convert(model, (idx,))
    edge.save(tmp_path / "m.tflite")
    del edge
    gc.collect()
    path = tmp_path / "m.tflite"
    assert os.path.getsize(path) > weight_bytes
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    flat = fb.Model.GetRootAs(head, 0)  # the flatbuffer itself is small: every table is after it
    external = [flat.Buffers(i) for i in range(flat.BuffersLength()) if flat.Buffers(i).Offset() > 1]
    assert sorted(b.Size() for b in external)[-TABLES:] == [ROWS * DIM * 4] * TABLES
    assert all(b.Offset() % 16 == 0 for b in external)
    edge = tte.load(path)
    for runtime in ("interpreter", "compiled_model"):
        out = edge.run_flat([idx], runtime=runtime)[0]
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg=runtime)
    del edge
    gc.collect()

    prog = tte.export(model, (idx,), target="tpu", platforms=("cpu",))
    prog.save(tmp_path / "m.tpu")
    del prog
    gc.collect()
    out = tte.load(tmp_path / "m.tpu")(idx)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
