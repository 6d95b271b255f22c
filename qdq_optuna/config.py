"""Settings of a tuning run: one dataclass, three presets, YAML in and out."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from qdq_optuna.errors import OptionError


class StartFrom(str, enum.Enum):
    """``Config.start``: which starts the descent runs from (``best``: the fastest start
    within the bound, with the recipe as a second lane when close; ``all``: every start)."""

    BEST = "best"
    FLOAT = "float"
    RECIPE = "recipe"
    ALL = "all"


#: ``--start``: where the whole-model descent starts (see :attr:`Config.start`)
START_CHOICES = tuple(m.value for m in StartFrom)
#: ``--start best``: the runtime's recipe gets a descent of its own (a second lane) when its
#: latency is within this factor of the fastest start's
RECIPE_LANE_RATIO = 1.25


def flag(default, *, help: str, type: str | None = None, short: str | None = None,
         metavar: str | None = None, choices: tuple[str, ...] | None = None) -> dataclasses.Field:
    """A setting that is also a ``qdq-optuna`` flag, defined once on its field (as
    ``TuneOptions``' are): :func:`qdq_optuna.cli.commands.add_config_options` builds the flag;
    ``type`` names one of the CLI's checked number types. A flag not given leaves the
    preset's (``--mode``) or the YAML file's value."""
    return dataclasses.field(default=default, metadata={
        "flag_help": help, "type": type, "short": short, "metavar": metavar, "choices": choices})


def field_flags(f: dataclasses.Field) -> list[str]:
    """The command-line flags of a :class:`Config` or ``TuneOptions`` field, as the CLI builds
    them from its metadata (empty: the field is no flag)."""
    m = f.metadata
    if not (m.get("group") or "flag_help" in m):
        return []
    return ([m["short"]] if m.get("short") else []) + [
        m.get("flag") or "--" + f.name.replace("_", "-")]


@dataclass
class Config:
    """Search settings (``--config FILE.yaml`` holds any of them; ``--mode`` presets the budget).

    The defaults are what ``qdq-optuna tune`` uses; :meth:`preset` applies ``--mode``.
    """

    performance_threshold: float = flag(
        1.0, type="threshold", metavar="RATIO",
        help="the speedup a change that adds Q/DQ must show to replace the standing model "
             "(default 1.0: any gain, confirmed by an interleaved re-measurement on a measured "
             "backend)")
    """the speedup a change that adds Q/DQ must show to replace the standing model (1.0: any
    gain, on a measured backend one an interleaved re-measurement confirms; 1.02: 2 % faster). A
    change that only removes Q/DQ needs only to be not slower."""
    default_q_scale: float = 0.1
    """activation scale used when no calibrated statistics are given"""
    default_q_zero_point: int | None = None
    """activation zero point used when no calibrated statistics are given (None: for uint8, 0
    on a non-negative tensor and 128 otherwise; 0 for int8)"""
    default_quant_type: str | None = None
    """None: follows the runtime (uint8 for ONNX Runtime CPU, int8 for TensorRT)"""
    maximum_sequence_region_size: int = flag(
        10, type="positive_int", metavar="N",
        help="largest sequence region top-down refinement cuts (default 10 nodes)")
    """largest sequence region top-down refinement cuts, in nodes
    (``--maximum-sequence-region-size``)"""
    minimum_topdown_search_size: int = flag(
        10, type="positive_int", metavar="N",
        help="blocks of more nodes than this are refined top-down (default 10)")
    """blocks of more nodes than this are refined top-down into smaller regions
    (``--minimum-topdown-search-size``)"""
    schemes_per_region: int = flag(
        30, type="positive_int", short="-n", metavar="N",
        help="finished trials per pattern study (default 30; --mode sets it too)")
    """finished trials per pattern study (a cap: see converged_patience)"""
    converged_patience: int = flag(
        1, type="count", metavar="N",
        help="our sampler: stop a pattern study early after N exploration trials in a row "
             "that did not improve (default 1; 0: spend every budget)")
    """our sampler only, single process: a pattern study stops before its budget once this many
    trials in a row were exploration (the best scheme had no untried one-move neighbour left)
    without improving on it; 0 spends every budget in full"""
    start: str = flag(
        "best", choices=START_CHOICES,
        help="where the descent starts: best (the fastest whole-model start, and a second "
             "descent from the runtime's recipe when its latency is within "
             f"{RECIPE_LANE_RATIO:g}x of that start's; default), float, recipe, all (a descent "
             "from every start)")
    """where the search starts: ``best`` (the fastest whole-model start: float, every point, the
    runtime's recipe, the user's seeds; and a second descent from the recipe when it is close;
    on a measured backend the recipe stands unless an A/B shows the fastest start beats it),
    ``float``, ``recipe``, or ``all`` (a descent from every start)"""
    refine_rounds: int = flag(
        4, type="count", metavar="N",
        help="descent rounds after the first (default 4; a round that changes nothing ends it "
             "earlier); 0: one pass over the patterns")
    """rounds of the descent after the first (a round visits every pattern whose surroundings
    changed); the descent stops earlier when a round changes nothing. 0: one pass"""
    skip_failed_moves: int = 3
    """a move of a kind (adding or removing Q/DQ between the same producer and consumer ops)
    that failed this many times in a descent and never paid is not tried again; 0: every move"""
    prune_by_runtime: bool = True
    """read what the runtime ran for each standing model (once per change) and measure no move
    that only removes Q/DQ it fused into integer kernels where they measured faster than float
    (docs/time_to_result.md)"""
    kernel_evidence: bool = True
    """with prune_by_runtime on a measured backend: time each integer kernel the runtime ran
    against its float kernel on this machine (cached per runtime and CPU flags); a fused Q/DQ
    is pruned only where its integer kernel measured faster, and removals where float measured
    faster are tried first (qdq_optuna/measure/kernels.py)"""
    subgraph_screen: bool = False
    """on a measured backend: before a candidate's whole-model A/B, time the region whose Q/DQ
    it changes, cut from the candidate and its reference (an interleaved A/B of the two small
    models); a region measured slower is screened out, every other candidate gets the
    whole-model A/B, and the report counts how often the two rankings agreed"""
    subgraph_screen_audit: bool = False
    """with subgraph_screen: a candidate whose region measured slower still gets its
    whole-model A/B (nothing is screened out), so the report counts how often the screen's
    drops were right (benchmarks/subgraph_screen.py measures the screen this way)"""
    seed_compute_inputs: bool = True
    """our sampler also starts from the scheme with Q/DQ on Conv/Gemm/MatMul inputs only"""
    top_percent_to_mutate: float = 0.1
    """our sampler: the share of a study's finished trials eligible as parents of a mutation"""
    minimum_schemes_to_mutate: int = 10
    """our sampler: at least this many best schemes are eligible as parents"""
    maximum_mutations: int = 3
    """our sampler: a mutated scheme differs from its parent by 1 to this many moves"""
    maximum_generation_attempts: int = 100
    """our sampler: attempts to draw a scheme not tried before, then a random one"""
    concat_group_min_samples: int = 5
    """our sampler: with ``schemes_per_region`` sets how often a move switches a whole Concat
    group (``min(1, max(this / schemes_per_region, 0.05))``)"""
    fusion_group_probability: float = 0.35
    """our sampler: the chance of a fusion-group move (a compute op and its epilogue together)
    when no Concat move was drawn"""
    pattern_cache_minimum_distance: int = 4
    """``pattern_cache.yaml`` keeps a scheme only when it differs from every better kept one of
    its pattern in at least this many points"""
    pattern_cache_max_entries_per_pattern: int = 32
    """``pattern_cache.yaml`` keeps at most this many schemes per pattern"""
    verbose: bool = False
    """Optuna logs at INFO (every trial it finishes), not only warnings (``-v``)"""

    def __post_init__(self) -> None:
        checks = [
            ("performance_threshold", self.performance_threshold >= 1.0, ">= 1.0"),
            ("default_q_scale", self.default_q_scale > 0, "> 0"),
            ("maximum_sequence_region_size", self.maximum_sequence_region_size >= 1, ">= 1"),
            ("minimum_topdown_search_size", self.minimum_topdown_search_size >= 1, ">= 1"),
            ("schemes_per_region", self.schemes_per_region >= 1, ">= 1"),
            ("converged_patience", self.converged_patience >= 0, ">= 0"),
            ("refine_rounds", self.refine_rounds >= 0, ">= 0"),
            ("start", self.start in START_CHOICES, f"one of {', '.join(START_CHOICES)}"),
            ("skip_failed_moves", self.skip_failed_moves >= 0, ">= 0"),
            ("top_percent_to_mutate", 0.0 < self.top_percent_to_mutate <= 1.0, "in (0, 1]"),
            ("minimum_schemes_to_mutate", self.minimum_schemes_to_mutate >= 1, ">= 1"),
            ("maximum_mutations", self.maximum_mutations >= 1, ">= 1"),
            ("maximum_generation_attempts", self.maximum_generation_attempts >= 1, ">= 1"),
            ("concat_group_min_samples", self.concat_group_min_samples >= 0, ">= 0"),
            ("fusion_group_probability", 0.0 <= self.fusion_group_probability <= 1.0, "in [0, 1]"),
            ("pattern_cache_minimum_distance", self.pattern_cache_minimum_distance >= 0, ">= 0"),
            ("pattern_cache_max_entries_per_pattern",
             self.pattern_cache_max_entries_per_pattern >= 0, ">= 0"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise OptionError(f"config {name} must be {want}, got {getattr(self, name)!r}")

    @classmethod
    def preset(cls, mode: str, **overrides: object) -> Config:
        presets = {
            "quick": {"schemes_per_region": 10, "minimum_schemes_to_mutate": 4},
            "default": {},
            "extensive": {"schemes_per_region": 80, "maximum_mutations": 4,
                          "minimum_schemes_to_mutate": 16},
        }
        if mode not in presets:
            raise OptionError(f"--mode: unknown {mode!r} (choose from {', '.join(presets)})")
        values = {**presets[mode], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise OptionError(f"config: unknown setting {unknown[0]!r}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Config:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise OptionError(f"--config {path}: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise OptionError(f"--config {path}: expected a mapping of settings")
        return cls.from_dict(data)

    def search_relevant(self) -> dict:
        """Settings that change the search's result (part of the resume fingerprint)."""
        d = self.to_dict()
        d.pop("verbose", None)
        d.pop("pattern_cache_minimum_distance", None)
        d.pop("pattern_cache_max_entries_per_pattern", None)
        # settings added later count only when changed: a run stored before them resumes
        for key, default in (("kernel_evidence", True), ("subgraph_screen", False),
                             ("subgraph_screen_audit", False)):
            if d.get(key) == default:
                d.pop(key)
        return d
