"""Every error a user can see, one class each, with the exit code the CLI uses.

Each also subclasses the matching built-in, so callers catch what Python users expect: bad
input and corrupt artifacts are ValueErrors, unsupported ops NotImplementedErrors, unwritable
outputs OSErrors, capture and converter failures RuntimeErrors.

Messages say what is wrong and what to do about it. The CLI prints
``str(error)`` on one line (plus the hint) and exits with ``exit_code``;
a traceback is shown only with ``--debug``.
"""
from __future__ import annotations


class TteError(Exception):
    """Base class of the errors torchtpu-export raises on purpose."""

    exit_code = 1
    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    def user_message(self) -> str:
        msg = str(self)
        return f"{msg}\n  hint: {self.hint}" if self.hint else msg


class InputError(TteError, ValueError):
    """A file, flag or input given by the user is missing or malformed."""

    exit_code = 2


class UnsafeInputError(InputError):
    """The input would have to be unpickled, which runs arbitrary code."""

    exit_code = 2


class CaptureError(TteError, RuntimeError):
    """torch.export could not capture the model."""

    exit_code = 3


class UnsupportedOpError(TteError, NotImplementedError):
    """A target cannot express an op of the model.

    ``op`` is the ATen overload name, ``count`` how many nodes use it, and
    ``source`` the user's source line of the first such node (if known).
    """

    exit_code = 4

    def __init__(self, op: str, *, target: str, reason: str = "", count: int = 1,
                 source: str | None = None, hint: str | None = None):
        self.op, self.target, self.reason, self.count, self.source = op, target, reason, count, source
        nodes = f"{count} node{'s' if count != 1 else ''}"
        msg = f"{op} is not supported by the {target} target ({nodes})"
        if reason:
            msg += f": {reason}"
        if source:
            msg += f"\n  at {source}"
        super().__init__(msg, hint=hint)


class ArtifactError(TteError, ValueError):
    """An artifact (.tpu, .tflite, .onnx, .pt2) is corrupt, truncated or of an unknown version."""

    exit_code = 5


class NumericsError(TteError, ValueError):
    """A converted model disagrees with torch eager beyond tolerance."""

    exit_code = 6


class OutputError(TteError, OSError):
    """The output path cannot be written."""

    exit_code = 7


class ConversionError(TteError, RuntimeError):
    """A converter failed on a supported op (a bug of ours: please report it)."""

    exit_code = 8


class Terminated(BaseException):
    """SIGTERM or SIGHUP during a command: unwinds like Ctrl-C, so temporary files are removed."""

    def __init__(self, signum: int):
        import signal
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Exit codes, as documented in the README and `torchtpu-export --help`.
EXIT_CODES = {
    0: "success",
    1: "unexpected internal error (run with --debug and report it)",
    InputError.exit_code: "bad input: missing/corrupt model file, bad --inputs, unknown flag value",
    CaptureError.exit_code: "torch.export could not capture the model",
    UnsupportedOpError.exit_code: "the model uses an op the target cannot express",
    ArtifactError.exit_code: "corrupt, truncated or incompatible artifact",
    NumericsError.exit_code: "--check: the artifact disagrees with torch eager",
    OutputError.exit_code: "the output path cannot be written",
    ConversionError.exit_code: "the converter failed on a supported op",
    129: "hung up (SIGHUP); no output file was left behind",
    130: "interrupted (Ctrl-C); no output file was left behind",
    143: "terminated (SIGTERM); no output file was left behind",
}
