"""Errors that reach the user as one clear line (exit code 2), never as a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a file, tensor, option or setting the user can fix.

    The message must name the offending file / tensor / option. The CLI prints
    ``qdq-optuna: error: <message>`` and exits with status 2.
    """

    exit_code = 2


class ModelError(UserError):
    """The ONNX model cannot be used (unreadable, invalid, unsupported)."""


class OptionError(UserError):
    """A command-line option or Config value is invalid."""


class ToolError(UserError):
    """A third-party tool (ONNX Runtime's quantizer, Model Optimizer) failed on the model: one
    line when the user asked for that tool's output; a search that only wanted it as one
    start among several goes on without it."""


def install_hint(extra: str) -> str:
    """How to add an optional extra: no package index has qdq-optuna, so the command a user can
    run is the one from the checkout (the same extra works on a wheel built from it)."""
    return f'pip install ".[{extra}]" in the qdq_optuna checkout'


def interrupted_by(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, a Ctrl-C: a KeyboardInterrupt that
    lands inside a library's own clean-up (Optuna's tell, for one) can come out as another
    error, and the run must still end as interrupted, not as an internal error."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [exc]
    while chain:
        exc = chain.pop()
        if exc is None or id(exc) in seen:
            continue
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        chain += [exc.__cause__, exc.__context__]
    return False
