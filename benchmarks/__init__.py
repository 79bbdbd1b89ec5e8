"""Benchmarks: run each from the repository root as ``python -m benchmarks.NAME`` (all: ``make bench``)."""


def publish(text: str, output: str | None) -> int:
    """A benchmark's report: printed, and written to ``output`` where given. Returns the exit code (0)."""
    print(text)
    if output:
        with open(output, "w") as f:
            f.write(text)
    return 0
