"""``python -m torchtpu_export.targets.litert.web MODEL.tflite`` is ``torchtpu-export serve-web MODEL.tflite``."""
import sys

from torchtpu_export.cli import main

sys.exit(main(["serve-web", *sys.argv[1:]]))
