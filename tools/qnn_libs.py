"""Test arrangement: Qualcomm's QNN host libraries where LiteRT's Qualcomm compiler plugin finds them.

LiteRT's plugin (``ai_edge_litert/vendors/qualcomm/compiler``) loads QNN's host libraries
(libQnnHtp.so, libQnnSystem.so, libQnnIr.so, libQnnSaver.so, libQnnLpai.so). Their official
source, ``ai-edge-litert-sdk-qualcomm``, downloads Qualcomm's QAIRT SDK from Qualcomm's host when
it is installed, which CI cannot reach. The ``onnxruntime-qnn`` wheel on PyPI (a [test] extra)
ships the same libraries (QNN 2.51; the plugin was built against 2.50) minus libQnnLpai.so, of
which the plugin uses no symbol: an empty library stands in for it.

This links them into ``<venv>/qairt/lib/x86_64-linux-clang`` (a QAIRT SDK's layout), which
``torchtpu_export.targets.litert.npu`` searches after ``QNN_SDK_ROOT``. ``make`` runs it after installing.
Users with the real SDK need none of this.
"""
from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess
import sys
import tempfile


def main() -> int:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        print(f"qnn_libs: QNN's host libraries are for x86-64 Linux, not {sys.platform}/{platform.machine()}")
        return 0
    try:
        import onnxruntime_qnn
    except ImportError:
        print("qnn_libs: onnxruntime-qnn is not installed (pip install -e '.[test]'); NPU tests will fail")
        return 0
    src = os.path.dirname(os.path.abspath(onnxruntime_qnn.__file__))
    libs = sorted(glob.glob(os.path.join(src, "libQnn*.so")) + glob.glob(os.path.join(src, "libHtpPrepare.so"))
                  + glob.glob(os.path.join(src + ".libs", "*.so*")))  # and the C++ runtime auditwheel bundled
    dest = os.path.join(sys.prefix, "qairt", "lib", "x86_64-linux-clang")
    os.makedirs(dest, exist_ok=True)
    for lib in libs:
        link = os.path.join(dest, os.path.basename(lib))
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(lib, link)
    stub = os.path.join(dest, "libQnnLpai.so")
    if not os.path.exists(stub):
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            print("qnn_libs: no C compiler for the empty libQnnLpai.so (apt-get install gcc); NPU tests will fail")
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            c_file = os.path.join(tmp, "empty.c")
            with open(c_file, "w") as f:
                f.write("/* libQnnLpai.so: LiteRT's Qualcomm plugin links it and calls nothing in it */\n")
            subprocess.run([cc, "-shared", "-fPIC", "-o", stub, c_file], check=True)
    print(f"qnn_libs: {len(libs)} QNN libraries from onnxruntime-qnn {onnxruntime_qnn.__version__} and an empty "
          f"libQnnLpai.so in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
