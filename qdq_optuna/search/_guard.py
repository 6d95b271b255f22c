"""The accuracy guard: no model whose outputs drift past the bound is started from, committed
or shipped, whether or not the run asked for accuracy.

Errors are those of the model that would ship: exported with calibrated scales (whatever scales
the trials use), run in ONNX Runtime on the validation data (else the calibration data, else
random inputs) and compared with the FP32 model; the measure is the run's ``--error-measure``
(worst output) or its ``--metric``. The bound is ``--max-output-error`` when given, else
:data:`~qdq_optuna.guard.DEFAULT_MAX_OUTPUT_ERROR`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..export import QDQExporter, QuantPlan
from ._plans import PlanMeasurer


@dataclass
class Guard:
    plans: PlanMeasurer
    #: exports with calibrated scales: the errors of the model that would ship
    exporter: QDQExporter
    bound: float
    #: what the errors are: ``relative_l2`` (worst output) or ``metric module:function``
    measure: str
    #: which data they were measured on (``--validation-data FILE:sha``, ``random:8:1``, ...)
    data: str

    def error(self, plan: QuantPlan) -> dict:
        """Output errors of ``plan`` vs FP32 (``error``: the worst output's, in
        :attr:`measure`), scored once per run."""
        return self.plans.error(self.exporter, plan)

    def allows(self, plan: QuantPlan) -> bool:
        return self.error(plan)["error"] <= self.bound

    def describe(self) -> dict:
        return {"bound": self.bound, "measure": self.measure, "data": self.data}
