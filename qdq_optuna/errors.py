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
