"""The CPU-dependent rules under every feature set these machines come in (AVX2 only, VNNI,
BF16, AMX), simulated, so that one developer's machine runs the code paths of the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from qdq_optuna import machine
from qdq_optuna.examples import zoo
from qdq_optuna.machine import FEATURE_SETS, CpuFeatures, current_cpu, simulated_cpu
from qdq_optuna.model import calibration

#: what each feature set must decide
EXPECTED = {  # name: (vnni, saturates_u8s8, bf16, amx)
    "avx2": (False, True, False, False),
    "vnni": (True, False, False, False),
    "bf16": (True, False, True, False),
    "amx": (True, False, True, True),
}
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Some Xeon
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16

processor\t: 1
model name\t: Other
flags\t\t: fpu
"""


def test_every_feature_set_is_tested():
    assert set(EXPECTED) == set(FEATURE_SETS)


@pytest.mark.parametrize("name", sorted(FEATURE_SETS))
def test_simulated_feature_sets_decide_the_rules(name):
    before = os.environ.get(machine.ENV)
    with simulated_cpu(name) as cpu:
        assert current_cpu() == cpu and cpu.source == "simulated"
        assert (cpu.vnni, cpu.saturates_u8s8, cpu.bf16, cpu.amx) == EXPECTED[name]
        assert calibration.cpu_saturates_u8s8() == cpu.saturates_u8s8
        assert set(cpu.flags) == set(FEATURE_SETS[name])
        assert json.loads(json.dumps(cpu.to_json()))["flags"] == list(cpu.flags)
    assert os.environ.get(machine.ENV) == before  # the previous setting comes back


def test_flags_parse_from_cpuinfo_text(monkeypatch, tmp_path):
    """The first processor's flags and model name; a file without flags or none at all claims
    nothing, and then no x86-only rule applies."""
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    cpu = CpuFeatures.read(info)
    assert cpu.model_name == "Some Xeon" and cpu.source == str(info)
    assert cpu.amx and cpu.bf16 and cpu.vnni and not cpu.saturates_u8s8 and not cpu.avx_vnni
    info.write_text(CPUINFO.replace(" avx512_vnni", "").replace(" amx_int8", ""))
    assert CpuFeatures.read(info).saturates_u8s8 and not CpuFeatures.read(info).vnni
    info.write_text("processor\t: 0\nmodel name\t: X\n")
    assert CpuFeatures.read(info).source == "unknown"
    assert not CpuFeatures.read(info).saturates_u8s8
    assert CpuFeatures.read(tmp_path / "absent") == CpuFeatures(arch="x86_64")
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    info.write_text(CPUINFO.replace(" avx512_vnni", "").replace(" amx_int8", ""))
    assert not CpuFeatures.read(info).saturates_u8s8  # ONNX Runtime's x86 kernels absent


def test_this_machines_flags_are_read_from_its_cpuinfo():
    """The rule, not this machine's answer: what /proc/cpuinfo lists is what is claimed."""
    cpu = CpuFeatures.read()
    path = Path("/proc/cpuinfo")
    if not path.exists():
        assert cpu.source == "unknown" and not cpu.flags
        return
    line = next((ln for ln in path.read_text().splitlines() if ln.startswith("flags")), None)
    if line is None:
        assert cpu.source == "unknown"
        return
    listed = set(line.split(":", 1)[1].split())
    assert set(cpu.flags) == listed & set(machine.FLAGS)
    assert cpu.saturates_u8s8 == (cpu.x86 and not listed & {"avx512_vnni", "avx_vnni",
                                                           "amx_int8"})


def test_the_simulation_reaches_worker_processes():
    with simulated_cpu("avx2,avx512f,avx512_vnni"):
        code = ("from qdq_optuna.machine import current_cpu; import json; "
                "print(json.dumps(current_cpu().to_json()))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
    seen = json.loads(out)
    assert seen["flags"] == ["avx2", "avx512f", "avx512_vnni"] and seen["source"] == "simulated"
    assert not seen["saturates_u8s8"]


def _largest_weights(model: onnx.ModelProto) -> dict[str, int]:
    """Per weighted node: its int8 weight's largest magnitude."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits \
                and inits[node.input[0]].data_type == TensorProto.INT8:
            reader = next(n for n in model.graph.node if node.output[0] in n.input)
            w = numpy_helper.to_array(inits[node.input[0]]).astype(np.int32)
            out[reader.name] = int(np.abs(w).max())
    return out


@pytest.mark.parametrize("name", sorted(FEATURE_SETS))
def test_seven_bit_weights_follow_the_simulated_cpu(name):
    """ONNX Runtime's rules: every int8 weight 7-bit where u8 x s8 saturates; OpenVINO's: the
    first layer's; TensorRT's: never; the ONNX Runtime recipe start asks for reduce_range then."""
    from qdq_optuna import PreparedModel
    from qdq_optuna.runtimes.onnxruntime import ort_recipe_options

    saturates = EXPECTED[name][1]
    with simulated_cpu(name):
        assert ort_recipe_options()["reduce_range"] == saturates
        for runtime in ("onnxruntime", "openvino", "tensorrt"):
            pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime=runtime)
            exporter = pm.exporter()
            uses = {u for pp in pm.tunable for u in pp.uses(pp.ids)}
            largest = _largest_weights(exporter.to_model(exporter.plan(uses)))
            assert len(largest) > 3
            seven = {n for n, v in largest.items() if v == 63}
            assert set(largest.values()) <= {63, 127}
            if not saturates or runtime == "tensorrt":
                assert not seven, runtime
            elif runtime == "onnxruntime":
                assert seven == set(largest), runtime
            else:
                assert len(seven) == 1, runtime


@pytest.mark.parametrize("name", sorted(FEATURE_SETS))
def test_openvino_offers_bf16_only_where_the_cpu_has_it(name):
    pytest.importorskip("openvino")
    from qdq_optuna.backends import openvino as ovb

    model = zoo.build("tiny_chain").SerializeToString()
    with simulated_cpu(name):
        hints = ovb.supported_hints()
        assert hints == (("f32", "bf16") if EXPECTED[name][2] else ("f32",))
        hint, why = ovb.choose_precision(model, None, rounds=2, runs=2)
        if len(hints) == 1:
            assert hint == "f32" and "only inference precision" in why
        else:
            assert hint in hints and "faster on the float model" in why
            assert "bf16" in why and "f32" in why
        assert ovb.choose_precision(model, "fp32") == ("f32", "--high-precision fp32")


@pytest.mark.parametrize("name", ["avx2", "bf16"])
def test_the_report_names_the_cpu_it_decided_by(name, tmp_path):
    from qdq_optuna import Config, tune

    path = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_residual"), str(path))
    with simulated_cpu(name) as cpu:
        result = tune(model=str(path), output_dir=str(tmp_path / "out"), backend="costmodel",
                      runtime="onnxruntime", config=Config(schemes_per_region=2,
                                                           refine_rounds=0))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["cpu"] == cpu.to_json() == result.report["cpu"]
    md = (tmp_path / "out" / "report.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("- cpu: "))
    assert all(f in line for f in FEATURE_SETS[name]) and "simulated" in line
    assert ("7-bit weights where u8 x s8 saturates: yes" in line) == cpu.saturates_u8s8
