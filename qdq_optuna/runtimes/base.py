"""Runtime: everything one target runtime decides, in one object chosen once per run.

A run asks its profile (never the runtime's name) for the rules that place Q/DQ, the defaults
(float-part precision, scales inside trials), the recipe start, how the accuracy guard runs a
candidate, what the runtime ran and, where measured, its integer-vs-float kernel timing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from qdq_optuna.backends import BACKENDS
from qdq_optuna.backends.base import Backend, SessionSettings
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.errors import OptionError
from qdq_optuna.model.precision import FP32, HighPrecisionModel, resolve_high_precision
from qdq_optuna.placement.dynamic import QuantMode
from qdq_optuna.placement.export import Scales
from qdq_optuna.placement.rules import RuntimeRules


@dataclass(frozen=True)
class RecipeFileSpec:
    """One file a runtime's own quantization tool writes, kept in the run folder as the tool
    wrote it and measured against what would ship (``search/_recipe_file.py``).

    ``name`` names it (``recipe_NAME.onnx``, report.json's ``recipe_files``); ``tool`` is what
    wrote it; ``make(model, input_shapes=, data=)`` writes it again (bytes, or None where the
    tool has nothing to do for this model or it does not fit one file); ``placement``: whether
    its static Q/DQ placement is read back and re-exported with our scales (a file of another
    mode has none to read); ``start(pm, model, input_shapes=, data=, keep=)``: where set, the
    file's placement as a start of its own (a ``Start``, or None where the tool is not meant
    for the model), the file kept at ``keep`` as it is made (the classic recipe's start is
    :meth:`Runtime.recipe_start`)."""

    name: str
    tool: str
    make: Callable[..., bytes | None]
    placement: bool = True
    start: Callable[..., Any] | None = None


class Runtime:
    """One runtime's profile; a subclass per runtime (``runtimes/<name>.py``, ``PROFILE``)."""

    #: the runtime's name (``--runtime``; a backend's ``BackendSpec.runtime``)
    name: str = ""
    #: where Q/DQ may go, fusion groups, quant types (``rules.default_quant_type``)
    rules: RuntimeRules
    #: the float part's precision when neither ``--high-precision`` nor the backend says
    default_precision: str = "fp32"
    #: ``--scales auto``: calibrated scales inside trials, or placeholders (``default``)
    default_scales: Scales = Scales.CALIBRATED

    #: the quantization modes this runtime has kernels for (``--modes``): static Q/DQ
    #: everywhere; dynamic int8 and weight-only only where the profile says so
    modes: tuple[QuantMode, ...] = (QuantMode.STATIC,)
    #: the modes a run searches without ``--modes`` (None: every mode offered)
    default_modes: tuple[QuantMode, ...] | None = None
    #: the ops it runs dynamically when the run searches the dynamic mode
    dynamic_ops: frozenset[str] = frozenset()

    def lacking_modes(self) -> dict[QuantMode, str]:
        """Modes this runtime has kernels for in some version but not in the one installed,
        with the line that says so (``--modes`` refuses them with it)."""
        return {}

    def searched_modes(self, requested: str | list[str] | None,
                       precision: str) -> tuple[QuantMode, ...]:
        """The modes a run searches: ``--modes`` (None: the profile's default modes),
        checked; the per-node modes (dynamic, weight-only) need an FP32 float part (their
        kernels take FP32), so they are left out under ``--high-precision fp16|bf16`` unless
        asked for, and refused then."""
        modes = QuantMode.parse(requested, self.modes, self.name, self.default_modes,
                                self.lacking_modes())
        per_node = [m for m in modes if m.per_node]
        if per_node and precision != FP32:
            if requested is not None:
                raise OptionError(f"--modes {per_node[0].value}: its kernels take FP32; the "
                                  f"float part is {precision} (--high-precision fp32)")
            modes = tuple(m for m in modes if not m.per_node)
        return modes

    def rules_for_modes(self, modes: tuple[QuantMode, ...]) -> RuntimeRules:
        """The rules with the per-node insertion points of ``modes`` (the rules as they are
        for static only: the search it has always been)."""
        rules = self.rules
        if QuantMode.DYNAMIC in modes and self.dynamic_ops:
            rules = dataclasses.replace(rules, dynamic_ops=self.dynamic_ops)
        weight_only = tuple(m for m in modes if m.bits)
        if weight_only:
            rules = dataclasses.replace(rules, weight_only_modes=weight_only)
        return rules

    def high_precision(self, requested: str | None, backend: str) -> str:
        """The float part's precision for ``--high-precision`` on ``backend`` (checked against
        what its table row refuses; its row's default, else this runtime's)."""
        spec = BACKENDS.get(backend)
        default = (spec.precision if spec is not None else None) or self.default_precision
        return resolve_high_precision(requested, backend, default,
                                      spec.refuses if spec is not None else None)

    def backend_options(self, model: Any, requested_precision: str | None,
                        threads: int | None, input_shapes: dict | None) -> dict:
        """Extra keyword arguments for this runtime's own backends (none by default)."""
        return {}

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep: Callable[[bytes], None] | None = None):
        """The runtime's classic quantization recipe as a whole-model start; ``keep``: what the
        recipe tool's own file is handed to as the tool wrote it (the run folder's writer;
        runtimes that have one)."""
        raise NotImplementedError

    #: whether the recipe is a tool run here whose own file is a start (:meth:`recipe_file`)
    has_recipe_file: bool = False

    def recipe_file(self, model: Any, *, input_shapes: Any = None,
                    data: Any = None) -> bytes | None:
        """The recipe tool's own file made again (same model, data, settings: same bytes);
        None where the runtime has no such tool here or the model does not fit one file."""
        return None

    #: what writes the recipe file (report.json's ``recipe_files[].tool``)
    recipe_tool: str = ""

    def recipe_files(self) -> tuple[RecipeFileSpec, ...]:
        """Every recipe file of this runtime, the classic recipe's (:meth:`recipe_file`)
        first; each is measured as written and ships when the tuned model is slower beyond
        noise and it keeps the accuracy bound."""
        if not self.has_recipe_file:
            return ()
        return (RecipeFileSpec(self.name, self.recipe_tool, self.recipe_file),)

    #: op type -> the builder of its integer kernel's model (``measure/kernels.py``'s
    #: ``OpUnitBuilder``): the ops besides Conv/Gemm/MatMul this runtime has integer kernels
    #: for, each node of them timed integer against float for the limit (none by default)
    op_units: Mapping[str, Callable] = MappingProxyType({})

    #: session settings that can change what this runtime runs for a placement (its own
    #: optimizer undoing or worsening one): each that changes the shipped model's kernels is
    #: A/B-timed on it, and the faster beyond noise ships with it (``search/_runtime_settings.py``)
    session_settings: tuple[SessionSettings, ...] = ()

    def settings_matter(self, model: bytes, settings: SessionSettings) -> bool:
        """Whether ``settings`` change what this runtime runs for ``model`` (one that
        changes nothing is not timed); a runtime that cannot tell times each."""
        return True

    def scores_fused(self, high_precision: HighPrecisionModel | None) -> bool:
        """Whether the accuracy guard scores candidates through ONNX Runtime's fused kernels
        (``ErrorScorer(optimize=...)``) rather than the Q/DQ as written."""
        return False

    def error_runner(self, input_shapes: dict | None,
                     backend: Backend | None) -> Callable | None:
        """What runs a candidate for the accuracy guard, when not ONNX Runtime (None)."""
        return None

    def scored_as(self, bf16: bool, fused: bool, runner: Callable | None) -> str:
        """How the accuracy guard ran the saved model, in the report's words (``runner``:
        this profile's :meth:`error_runner`, None when ONNX Runtime scored it)."""
        if bf16:
            return ("BF16 values in FP32 arithmetic (ONNX Runtime's CPU provider has no BF16 "
                    "kernels)")
        if fused:
            return ("the saved model in ONNX Runtime CPU with all graph optimizations (the fused "
                    "integer kernels an ONNX Runtime deployment runs)")
        return ("the saved model in ONNX Runtime CPU with graph optimizations off: each Q/DQ "
                "computed as written, which is what TensorRT's kernels compute up to their "
                "rounding (ONNX Runtime's own fusions refuse FP16 Q/DQ graphs)")

    def what_ran(self, backend: Backend, model: bytes) -> WhatRan | None:
        """What the runtime fused, ran standalone, kept float, reformatted for ``model``."""
        return backend.what_ran(model)

    def kernel_timing(self, backend: Backend,
                      weight_only: tuple[QuantMode, ...] = ()) -> Callable:
        """``fn(float_model, qdq_model, **kw) -> KernelTable``: each integer kernel this
        runtime runs timed against its float kernel on ``backend`` (this machine), its units
        cut as the rules fuse them (:func:`qdq_optuna.measure.kernels.kernel_table`); a
        MatMul/Gemm's dynamic kernel too where the runtime has one, and its kernel in each of
        the ``weight_only`` modes (the ones a run searches)."""
        from qdq_optuna.measure.kernels import kernel_table

        return functools.partial(kernel_table, backend,
                                 output_q=bool(self.rules.output_quantized_ops),
                                 dynamic=QuantMode.DYNAMIC in self.modes,
                                 weight_only=weight_only,
                                 op_units=dict(self.op_units) or None)

    def __repr__(self) -> str:
        return f"<runtime {self.name}>"
