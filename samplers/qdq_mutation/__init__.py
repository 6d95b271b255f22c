from ._sampler import QDQMutationSampler
from ._visit import VISIT_ATTR, Move, MoveStats, Visit, VisitSpec

__all__ = ["QDQMutationSampler", "VISIT_ATTR", "Move", "MoveStats", "Visit", "VisitSpec"]
