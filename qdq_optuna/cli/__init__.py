"""The command line: ``qdq-optuna`` (a thin layer over the library)."""

from qdq_optuna.cli.commands import main

__all__ = ["main"]
