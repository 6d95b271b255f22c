"""Settings of a tuning run: one dataclass, three presets, YAML in and out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from .errors import OptionError


@dataclass
class Config:
    #: a pattern's best scheme is committed only if it is this much faster than the reference
    #: (1.02 = 2 % faster), confirmed by an interleaved re-measurement
    performance_threshold: float = 1.02
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
    #: after every pattern is committed, re-tune each pattern this many more times with all
    #: the other patterns' schemes in place, starting from its own (a later pattern's Q/DQ can
    #: change what is best for an earlier one); a pattern whose surroundings did not change is
    #: skipped. Single-objective runs only; 0 keeps the single pattern-by-pattern pass
    refine_rounds: int = 1
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
        return d
