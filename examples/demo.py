"""make demo: a ResNet-18 built from code, converted to .tpu and .tflite, reloaded, checked against eager."""
from __future__ import annotations

import os
import sys

from common import check_outputs, convert_both
import zoo
import torchtpu_export as tte


def main() -> int:
    model, args = zoo.resnet18()
    rows = convert_both("resnet18", lambda target: tte.export(model, args, target=target),
                        lambda art, target: art(*args), check_outputs(model, args, rtol=1e-5))
    print(f"ResNet-18 (11.7M parameters, seeded random weights), input {tuple(args[0].shape)}")
    print(f"{'target':<8} {'artifact':<26} {'size':>9} {'convert':>8} {'latency':>9}  agreement with torch eager")
    for r in rows:
        print(f"{r.target:<8} {r.path:<26} {r.size / 2**20:>7.1f}MB {r.convert_s:>7.1f}s {r.latency_ms:>7.1f}ms  "
              f"{'OK' if r.ok else 'FAIL'} ({r.check})")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
