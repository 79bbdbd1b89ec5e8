"""``python -m torchtpu_export`` is the ``torchtpu-export`` command."""
import sys

from torchtpu_export.cli import main

sys.exit(main())
