"""How the hostile-input tests judge a CLI run: its peak resident memory in a process of its own, and a clean
refusal (the exit code asked for, no traceback, no internal error)."""
import os
import subprocess
import sys


# the process's own peak (VmHWM): ru_maxrss would carry over the peak of the test process that started it
# (fork copies the parent's high-water mark and exec keeps it)
PEAK_RSS = """
import atexit, sys
def _report():
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
    sys.stderr.write(f"\\nPEAK_RSS_KB {hwm.split()[1]}\\n")
atexit.register(_report)
from torchtpu_export.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli_peak_rss_mb(*argv, prelude: str = "") -> tuple:
    """The CLI in a process of its own (``prelude`` run first), and that process's peak resident memory in MB."""
    r = subprocess.run([sys.executable, "-c", prelude + PEAK_RSS, *map(str, argv)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    peak = int(r.stderr.rsplit("PEAK_RSS_KB", 1)[1].split()[0]) / 1024
    return r, peak


def _clean(r, code):
    assert r.returncode == code and "Traceback" not in r.stderr and "internal error" not in r.stderr, \
        (r.returncode, r.stderr[-2000:])
