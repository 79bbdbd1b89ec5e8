"""NPU compilation through LiteRT's own AOT path (ai_edge_litert.aot) and QNN's HTP simulator.

The Qualcomm compiler plugin of ai-edge-litert loads QNN's host libraries; here they come from
the onnxruntime-qnn wheel (tools/qnn_libs.py, run by make), which also brings QNN's HTP backend for
x86-64: a simulator of the Hexagon NPU that runs the compiled context binary with the NPU's fp16
and int8 arithmetic. So each compiled file is checked numerically against torch eager:

- float models run in fp16 on the HTP: within the per-model tolerance below (measured max error
  relative to the output's scale on SM8650, 2026-12-03, about 2x margin);
- int8 models within 1.5x the error the int8 recipe reports against float (measured: at most 1.18x).
"""
import platform
import sys

import numpy as np
import pytest
import torch

import torchtpu_export as tte
import zoo
from torchtpu_export.targets.litert import npu

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="QNN's host libraries and HTP simulator are x86-64 Linux only")

SOCS = "qualcomm:SM8550,qualcomm:SM8650,qualcomm:SM8750"  # Snapdragon 8 Gen 2, Gen 3, Elite
# model -> (factory kwargs, fp16-on-HTP tolerance; measured: 4.2e-4, 5.4e-4, 4.1e-4, 4.3e-4, 2.1e-3)
CNNS = {"small_cnn": ({}, 1e-3), "resnet18": ({"size": 64}, 1.5e-3), "resnet50": ({}, 1e-3),
        "mobilenet_v2": ({"size": 64}, 1e-3), "unet": ({}, 5e-3)}
INT8_MARGIN = 1.5


@pytest.fixture(scope="module", autouse=True)
def qnn_libraries():
    from torchtpu_export.runtimes.qnn_htp import available
    why = available()
    assert why is None, why
    assert npu.qnn_library_dirs(), ("QNN's host libraries are not in <venv>/qairt: run `make` "
                                    "(tools/qnn_libs.py links them from the onnxruntime-qnn wheel)")


@pytest.fixture
def cnn_tflite(tmp_path):
    """zoo.small_cnn converted for the CPU: what `compile` takes."""
    model, args = zoo.small_cnn()
    src = tmp_path / "cnn.tflite"
    tte.convert(model, args).export(src)
    return src


def _rel_err(y, ref) -> float:
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("recipe", ["fp32", "int8"])
@pytest.mark.parametrize("name", list(CNNS))
def test_zoo_cnn_compiles_for_snapdragons_and_matches_torch_on_the_htp_simulator(name, recipe, tmp_path):
    kwargs, tol = CNNS[name]
    model, args = zoo.ZOO[name](**kwargs)
    with torch.no_grad():
        ref = model(*args).numpy().astype(np.float64)
    quant = {"recipe": "int8", "calibration": [args]} if recipe == "int8" else None
    edge = tte.convert(model, args, quant_config=quant)
    if recipe == "int8":
        tol = INT8_MARGIN * edge.quant_report.max_rel_err
    result = npu.compile_model(edge.model_content(), npu.parse_targets(SOCS))
    socs = npu.soc_results(result)
    assert [r.name for r in socs] == ["Qualcomm_SM8550", "Qualcomm_SM8650", "Qualcomm_SM8750"]
    for r in socs:
        assert r.ops_on_npu == r.ops_total > 0, f"{r.name}: {r.ops_on_npu}/{r.ops_total} ops on the NPU"
        path = tmp_path / f"{name}_{r.name}.tflite"
        path.write_bytes(r.content)
        compiled = tte.load(path)  # the signature and pytree metadata survive compilation
        assert compiled.signatures == ["serving_default"]
        y = compiled.run_flat([a.numpy() for a in args], runtime="qnn_htp")[0]
        err = _rel_err(y, ref)
        print(f"{name} {recipe} {r.name}: {err:.3g} (tolerance {tol:.3g})")
        assert err <= tol, f"{name} {recipe} on {r.name}'s HTP (simulated): error {err:.3g} > {tol:.3g}"


def test_convert_with_compilation_backend_is_litert_torchs_api(tmp_path):
    from ai_edge_litert.aot.core import aot_types
    from ai_edge_litert.aot.vendors import fallback_backend
    from ai_edge_litert.aot.vendors.qualcomm import target as qnn
    model, args = zoo.small_cnn()
    result = (tte.experimental_add_compilation_backend(qnn.Target(qnn.SocModel.SM8650))
              .experimental_add_compilation_backend(qnn.Target(qnn.SocModel.SM8650))  # twice: a no-op
              .experimental_add_compilation_backend("qualcomm:SM8750")
              .experimental_add_compilation_backend(fallback_backend.FallbackTarget())
              .convert(model, args))
    assert isinstance(result, aot_types.CompilationResult)
    assert [b.target_id for b, _ in result.models_with_backend] == ["Qualcomm_SM8650", "Qualcomm_SM8750", "fallback"]
    assert not result.failed_backends
    assert "7 / 7 ops offloaded" in result.compilation_report()
    result.export(tmp_path, model_name="cnn")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["cnn_Qualcomm_SM8650.tflite", "cnn_Qualcomm_SM8750.tflite", "cnn_fallback.tflite"]
    cpu = tte.load(tmp_path / "cnn_fallback.tflite")
    npu_model = tte.load(tmp_path / "cnn_Qualcomm_SM8650.tflite")
    with torch.no_grad():
        ref = model(*args).numpy()
    np.testing.assert_allclose(np.asarray(cpu(*args)), ref, rtol=1e-5, atol=1e-6)
    assert _rel_err(npu_model.run_flat([args[0].numpy()], runtime="qnn_htp")[0], ref) <= CNNS["small_cnn"][1]
    # the CPU interpreter cannot run the NPU file: one error that says where it runs
    with pytest.raises(tte.TteError, match="DISPATCH_OP") as e:
        npu_model(*args)
    assert "qnn_htp" in e.value.hint


def test_a_vendor_whose_sdk_is_missing_is_one_clear_error(tmp_path):
    model, args = zoo.small_cnn()
    with pytest.raises(npu.NpuCompileError) as e:
        tte.experimental_add_compilation_backend("mediatek:MT6989").convert(model, args)
    msg = str(e.value)
    assert "MediaTek_MT6989" in msg and "NeuroPilot" in msg and "ai-edge-litert-sdk-mediatek" in msg
    assert e.value.exit_code == 4 and isinstance(e.value, RuntimeError)
    with pytest.raises(tte.TteError, match="unknown qualcomm SoC 'SM1'.*SM8650"):
        tte.experimental_add_compilation_backend("qualcomm:SM1")
    with pytest.raises(tte.TteError, match="VENDOR:SOC"):
        npu.parse_targets("snapdragon")


def test_cli_compile_every_qualcomm_soc_inspect_and_run_on_the_simulator(cli, tmp_path, cnn_tflite):
    src = cnn_tflite
    out = tmp_path / "npu"
    r = cli("compile", src, "--soc", "qualcomm:all", "-o", out)
    assert r.returncode == 0, r.stderr
    socs = npu.socs("qualcomm")
    assert len(socs) == 10
    assert sorted(p.name for p in out.iterdir()) == sorted([f"cnn_Qualcomm_{s}.tflite" for s in socs] + ["cnn.tflite"])
    assert r.stdout.count("7/7 ops on the NPU") == 10
    assert (out / "cnn.tflite").read_bytes() == src.read_bytes()  # the CPU fallback beside them
    r = cli("inspect", out / "cnn_Qualcomm_SM8650.tflite")
    assert r.returncode == 0, r.stderr
    assert "compiled for Qualcomm SM8650: 1 NPU partition" in r.stdout and "left on the CPU: none" in r.stdout
    r = cli("inspect", src, "--soc", "qualcomm:SM8450,qualcomm:SM8850")
    assert r.returncode == 0, r.stderr
    assert "NPU Qualcomm_SM8450: 7/7 ops in 1 partition; on the CPU: none" in r.stdout
    assert "NPU Qualcomm_SM8850: 7/7 ops" in r.stdout
    r = cli("run", out / "cnn_Qualcomm_SM8850.tflite", "--runtime", "qnn_htp")
    assert r.returncode == 0, r.stderr
    assert "output_0: float32[1, 10]" in r.stdout
    r = cli("run", out / "cnn_Qualcomm_SM8850.tflite")
    assert r.returncode == 5 and "qnn_htp" in r.stderr


def test_cli_ai_pack(cli, tmp_path, cnn_tflite):
    src = cnn_tflite
    pack = tmp_path / "pack"
    r = cli("compile", src, "--soc", "qualcomm:SM8650,qualcomm:SM8750", "--ai-pack", pack)
    assert r.returncode == 0, r.stderr
    assets = pack / "cnn" / "src" / "main" / "assets"
    assert sorted(p.name for p in assets.iterdir()) == ["model#group_Qualcomm_SM8650", "model#group_Qualcomm_SM8750",
                                                        "model#group_other"]
    assert (assets / "model#group_other" / "cnn.tflite").read_bytes() == src.read_bytes()
    xml = (pack / "device_targeting_configuration.xml").read_text()
    assert 'model="SM8650"' in xml and 'model="SM8750"' in xml
    r = cli("compile", src, "--soc", "qualcomm:SM8650", "--ai-pack", pack)  # not over an existing pack
    assert r.returncode == 2 and "not an empty folder" in r.stderr


def test_cli_compile_errors(cli, tmp_path, cnn_tflite):
    src = cnn_tflite
    r = cli("compile", src, "--soc", "qualcomm:SM8650,mediatek:MT6989,google_tensor:Tensor_G4")
    assert r.returncode == 4, r.stderr
    err = r.stderr.strip().splitlines()
    assert err[0].startswith("error: NPU compilation failed for 2 SoCs: MediaTek_MT6989") and "Tensor_G4" in err[0]
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn.tflite"]  # nothing written, not even SM8650
    for argv, code, text in [(("--soc", "qualcomm:SM0"), 2, "unknown qualcomm SoC"),
                             ((), 2, "needs --soc"),
                             (("--soc", "qualcomm:SM8650", "--topology", "v5e"), 2, "--topology applies to .tpu"),
                             (("--soc", "qualcomm:SM8650", "-o", src), 2, "is a file")]:
        r = cli("compile", src, *argv)
        assert r.returncode == code and text in r.stderr, (argv, r.stderr)
    r = cli("compile", src, "--soc", "qualcomm:SM8650")
    assert r.returncode == 0, r.stderr
    r = cli("compile", tmp_path / "cnn_Qualcomm_SM8650.tflite", "--soc", "qualcomm:SM8650")
    assert r.returncode == 2 and "already compiled" in r.stderr
    r = cli("run", src, "--runtime", "qnn_htp")
    assert r.returncode == 2 and "not compiled for an NPU" in r.stderr
    # a compiled file whose NPU bytecode span is damaged is refused before anything reads it
    data = bytearray((tmp_path / "cnn_Qualcomm_SM8650.tflite").read_bytes())
    bad = tmp_path / "cut.tflite"
    bad.write_bytes(bytes(data[:len(data) - 1000]))
    r = cli("inspect", bad)
    assert r.returncode == 5 and "outside the file" in r.stderr, r.stderr
