"""Settings of a tuning run: one dataclass, three presets, YAML in and out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from qdq_optuna.errors import OptionError

#: ``--start``: where the whole-model descent starts (see :attr:`Config.start`)
START_CHOICES = ("best", "float", "recipe", "all")


@dataclass
class Config:
    #: the speedup a change that adds Q/DQ must show to replace the standing model (1.0: any
    #: gain, on a measured backend one an interleaved re-measurement confirms; 1.02: 2 %
    #: faster). A change that only removes Q/DQ needs only to be not slower.
    performance_threshold: float = 1.0
    #: activation scale / zero point used when no calibrated statistics are given
    default_q_scale: float = 0.1
    default_q_zero_point: int | None = None
    #: None: follows the runtime (uint8 for ONNX Runtime CPU, int8 for TensorRT)
    default_quant_type: str | None = None
    maximum_sequence_region_size: int = 10
    minimum_topdown_search_size: int = 10
    #: finished trials per pattern study (a cap: see converged_patience)
    schemes_per_region: int = 30
    #: our sampler only, single process: a pattern study stops before its budget once this
    #: many trials in a row were exploration (the best scheme had no untried one-move
    #: neighbour left) without improving on it; 0 spends every budget in full
    converged_patience: int = 1
    #: where the search starts: ``best`` (the fastest whole-model start: float, every point,
    #: the runtime's recipe, the user's seeds; and a second descent from the recipe when it is
    #: close; on a measured backend the recipe stands unless an A/B shows the fastest start
    #: beats it), ``float``, ``recipe``, or ``all`` (a descent from every start)
    start: str = "best"
    #: rounds of the descent after the first (a round visits every pattern whose surroundings
    #: changed); the descent stops earlier when a round changes nothing. 0: one pass
    refine_rounds: int = 4
    #: a move of a kind (adding or removing Q/DQ between the same producer and consumer ops)
    #: that failed this many times in a descent and never paid is not tried again; 0: every move
    skip_failed_moves: int = 3
    #: read what the runtime ran for each standing model (once per change) and measure no
    #: move that only removes Q/DQ it fused into integer kernels (docs/time_to_result.md)
    prune_by_runtime: bool = True
    #: with prune_by_runtime on a measured backend: time each integer kernel the runtime ran
    #: against its float kernel on this machine (cached per runtime and CPU flags); a fused
    #: Q/DQ is pruned only where its integer kernel measured faster, and removals where float
    #: measured faster are tried first (qdq_optuna/measure/kernels.py)
    kernel_evidence: bool = True
    #: on a measured backend: before a candidate's whole-model A/B, time the region whose Q/DQ
    #: it changes, cut from the candidate and its reference (an interleaved A/B of the two
    #: small models); a region measured slower is screened out, every other candidate gets the
    #: whole-model A/B, and the report counts how often the two rankings agreed
    subgraph_screen: bool = False
    #: our sampler also starts from the scheme with Q/DQ on Conv/Gemm/MatMul inputs only
    seed_compute_inputs: bool = True
    top_percent_to_mutate: float = 0.1
    minimum_schemes_to_mutate: int = 10
    maximum_mutations: int = 3
    maximum_generation_attempts: int = 100
    concat_group_min_samples: int = 5
    fusion_group_probability: float = 0.35
    pattern_cache_minimum_distance: int = 4
    pattern_cache_max_entries_per_pattern: int = 32
    verbose: bool = False

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
        for key, default in (("kernel_evidence", True), ("subgraph_screen", False)):
            if d.get(key) == default:
                d.pop(key)
        return d
