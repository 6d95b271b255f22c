"""A corpus of hostile inputs for the ``qdq-optuna`` command line, built at test time.

Every :class:`Case` writes its bad file(s) into its own folder and returns the CLI arguments
that feed them to ``qdq-optuna``; ``needles`` are words the one-line error must contain (the
file, tensor or option at fault). Nothing binary is committed: every file is generated from
``zoo.tiny_chain`` or from a fixed seed.

``tests/test_hostile_inputs.py`` runs each case through the real CLI in a subprocess.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.examples import zoo

#: written by the YAML payload of ``cache_python_tag`` if a loader ever executes it
PWNED_MARKER = "pwned.txt"


@dataclass(frozen=True)
class Ctx:
    """Where a case lives: ``root`` holds its inputs, ``good`` is the shared valid model,
    ``out`` is the ``tune --output`` folder (the only thing the CLI may create)."""

    root: Path
    good: Path
    out: Path


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Ctx], list[str]]
    needles: tuple[str, ...]


CASES: list[Case] = []


def case(*needles: str) -> Callable[[Callable[[Ctx], list[str]]], Callable[[Ctx], list[str]]]:
    """Register ``fn`` (named after the case) with the words its error line must contain."""

    def register(fn: Callable[[Ctx], list[str]]) -> Callable[[Ctx], list[str]]:
        CASES.append(Case(fn.__name__, fn, needles))
        return fn

    return register


# -- helpers ---------------------------------------------------------------------------------


def chain() -> onnx.ModelProto:
    return zoo.build("tiny_chain")


def save(path: Path, model: onnx.ModelProto) -> Path:
    """Write ``model`` exactly as given (no checks, no external data)."""
    path.write_bytes(model.SerializeToString())
    return path


def inspect(path: Path, *extra: str) -> list[str]:
    return ["inspect", str(path), *extra]


def tune(ctx: Ctx, *extra: str, model: Path | None = None) -> list[str]:
    return [
        "tune", "--model", str(model or ctx.good), "--output", str(ctx.out),
        "--backend", "costmodel", "--mode", "quick", "--timing", "fast", *extra,
    ]


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def dynamic_chain() -> onnx.ModelProto:
    """tiny_chain with a symbolic batch dim ``N`` on ``input``."""
    model = chain()
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.ClearField("dim_value")
    dim.dim_param = "N"
    del model.graph.value_info[:]
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    return model


def external_chain(folder: Path, location: str) -> Path:
    """tiny_chain saved with its weights in ``folder/weights.bin``, then every tensor's
    ``location`` rewritten to ``location``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(
        chain(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
        location="weights.bin", size_threshold=0,
    )
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    return save(path, model)


def yaml_file(ctx: Ctx, name: str, text: str) -> Path:
    path = ctx.root / name
    path.write_text(text, encoding="utf-8")
    return path


# -- unreadable files ------------------------------------------------------------------------


@case("random.onnx")
def random_bytes(ctx: Ctx) -> list[str]:
    path = ctx.root / "random.onnx"
    path.write_bytes(random.Random(1234).randbytes(4096))
    return inspect(path)


@case("empty.onnx", "empty")
def empty_file(ctx: Ctx) -> list[str]:
    path = ctx.root / "empty.onnx"
    path.write_bytes(b"")
    return inspect(path)


@case("truncated.onnx")
def truncated_protobuf(ctx: Ctx) -> list[str]:
    data = chain().SerializeToString()
    path = ctx.root / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    return inspect(path)


@case("not valid UTF-8")
def invalid_utf8_text(ctx: Ctx) -> list[str]:
    """Protobuf decodes text fields only when they are read: a producer name that is not UTF-8
    (found by benchmarks/fuzz_loading.py)."""
    model = chain()
    model.producer_name = "qdq-fuzz"
    data = bytearray(model.SerializeToString())
    i = data.index(b"qdq-fuzz")
    data[i + 3] = 0xF5
    path = ctx.root / "bad_text.onnx"
    path.write_bytes(bytes(data))
    return inspect(path)


@case("tensor.onnx")
def tensor_proto(ctx: Ctx) -> list[str]:
    """A valid protobuf, but a TensorProto, not a ModelProto."""
    tensor = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(4, 16), "weights")
    path = ctx.root / "tensor.onnx"
    path.write_bytes(tensor.SerializeToString())
    return inspect(path)


@case("picture.onnx")
def png_named_onnx(ctx: Ctx) -> list[str]:
    """Content decides, not the extension: a PNG called .onnx is refused ..."""
    png = (
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00"
        b"\x00\x1f\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\xcf\xc0\xf0\x1f\x00\x05\x00\x01\xff"
        b"\x89\x99=\x1d\x00\x00\x00\x00IEND\xaeB`\x82"
    )
    path = ctx.root / "picture.onnx"
    path.write_bytes(png)
    return inspect(path)


@case("config.onnx")
def json_named_onnx(ctx: Ctx) -> list[str]:
    path = ctx.root / "config.onnx"
    path.write_text(json.dumps({"model": "resnet50", "opset": 17, "nodes": []}), encoding="utf-8")
    return inspect(path)


@case("folder.onnx", "directory")
def directory(ctx: Ctx) -> list[str]:
    path = ctx.root / "folder.onnx"
    path.mkdir()
    (path / "model.onnx").write_bytes(chain().SerializeToString())
    return inspect(path)


@case("missing.onnx")
def missing_file(ctx: Ctx) -> list[str]:
    return inspect(ctx.root / "missing.onnx")


# -- broken graphs ---------------------------------------------------------------------------


@case("cycle.onnx", "relu2_out", "cycle")
def cycle(ctx: Ctx) -> list[str]:
    """relu1 reads relu2's output while conv2 -> relu2 read relu1's."""
    model = chain()
    node(model, "relu1").input[0] = "relu2_out"
    return inspect(save(ctx.root / "cycle.onnx", model))


@case("unsorted.onnx", "sorted")
def unsorted_nodes(ctx: Ctx) -> list[str]:
    model = chain()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    return inspect(save(ctx.root / "unsorted.onnx", model))


@case("noinit.onnx", "conv2.weight", "missing initializer")
def missing_initializer(ctx: Ctx) -> list[str]:
    model = chain()
    keep = [t for t in model.graph.initializer if t.name != "conv2.weight"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return inspect(save(ctx.root / "noinit.onnx", model))


@case("dupnames.onnx", "relu1")
def duplicate_node_names(ctx: Ctx) -> list[str]:
    model = chain()
    node(model, "relu2").name = "relu1"
    return inspect(save(ctx.root / "dupnames.onnx", model))


@case("duptensor.onnx", "conv1_out")
def duplicate_tensor_names(ctx: Ctx) -> list[str]:
    """Two nodes produce ``conv1_out``."""
    model = chain()
    node(model, "conv2").output[0] = "conv1_out"
    node(model, "relu2").input[0] = "conv1_out"
    return inspect(save(ctx.root / "duptensor.onnx", model))


@case("dangling.onnx", "nowhere")
def output_not_produced(ctx: Ctx) -> list[str]:
    model = chain()
    model.graph.output[0].name = "nowhere"
    return inspect(save(ctx.root / "dangling.onnx", model))


@case("opset99.onnx", "opset")
def opset_99(ctx: Ctx) -> list[str]:
    model = chain()
    model.opset_import[0].version = 99
    return inspect(save(ctx.root / "opset99.onnx", model))


@case("noopset.onnx", "opset")
def no_default_opset(ctx: Ctx) -> list[str]:
    model = chain()
    del model.opset_import[:]
    return inspect(save(ctx.root / "noopset.onnx", model))


@case("ir99.onnx")
def ir_version_99(ctx: Ctx) -> list[str]:
    model = chain()
    model.ir_version = 99
    return inspect(save(ctx.root / "ir99.onnx", model))


@case("unknownop.onnx", "Frobnicate")
def unknown_operator(ctx: Ctx) -> list[str]:
    model = chain()
    node(model, "relu1").op_type = "Frobnicate"
    return inspect(save(ctx.root / "unknownop.onnx", model))


@case("badattr.onnx", "conv1")
def bad_attribute(ctx: Ctx) -> list[str]:
    """A Conv whose kernel_shape contradicts its weight."""
    model = chain()
    conv = node(model, "conv1")
    del conv.attribute[:]
    conv.attribute.append(helper.make_attribute("kernel_shape", [7, 7]))
    return inspect(save(ctx.root / "badattr.onnx", model))


@case("nonodes.onnx")
def graph_without_nodes(ctx: Ctx) -> list[str]:
    graph = helper.make_graph(
        [], "empty",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return inspect(save(ctx.root / "nonodes.onnx", model))


@case("quantized.onnx", "QuantizeLinear")
def already_quantized(ctx: Ctx) -> list[str]:
    model = chain()
    node(model, "conv2").input[0] = "relu1_dq"
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(0.05, dtype=np.float32), "q_scale"),
        numpy_helper.from_array(np.array(0, dtype=np.uint8), "q_zero"),
    ])
    qdq = [
        helper.make_node("QuantizeLinear", ["relu1_out", "q_scale", "q_zero"], ["relu1_q"],
                         name="relu1_q"),
        helper.make_node("DequantizeLinear", ["relu1_q", "q_scale", "q_zero"], ["relu1_dq"],
                         name="relu1_dq"),
    ]
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes[:2] + qdq + nodes[2:])
    return inspect(save(ctx.root / "quantized.onnx", model))


# -- shapes ----------------------------------------------------------------------------------


@case("'input'", "--input-shapes")
def symbolic_batch_without_shapes(ctx: Ctx) -> list[str]:
    return inspect(save(ctx.root / "dynamic.onnx", dynamic_chain()))


@case("'input'", "--input-shapes")
def input_without_shape(ctx: Ctx) -> list[str]:
    model = chain()
    model.graph.input[0].type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]
    return inspect(save(ctx.root / "noshape.onnx", model))


def _shapes_case(spec: str) -> Callable[[Ctx], list[str]]:
    def build(ctx: Ctx) -> list[str]:
        return inspect(save(ctx.root / "dynamic.onnx", dynamic_chain()), "--input-shapes", spec)

    return build


for _id, _spec, _needles in [
    ("shapes_bad_syntax", "input=1x3x16x16", ("--input-shapes", "input=1x3x16x16")),
    ("shapes_no_dims", "input:", ("--input-shapes", "input:")),
    ("shapes_negative_dim", "input:-1x3x16x16", ("--input-shapes", "input")),
    ("shapes_unknown_input", "images:1x3x16x16", ("--input-shapes", "images")),
    ("shapes_wrong_rank", "input:1x3x16", ("--input-shapes", "input")),
    ("shapes_zero_dim", "input:0x3x16x16", ("--input-shapes", "input")),
    ("shapes_absurd_dims", "input:1x3x100000000x100000000", ("--input-shapes", "input")),
    ("shapes_conflict_static", "input:1x4x16x16", ("--input-shapes", "input")),
    ("shapes_huge_number", "input:" + "9" * 400 + "x3x16x16", ("--input-shapes", "input")),
]:
    CASES.append(Case(_id, _shapes_case(_spec), _needles))


@case("'input'", "absurd")
def absurd_static_dims(ctx: Ctx) -> list[str]:
    """Input 1x3x10^9x10^9 written into the model: refused before anything is allocated."""
    model = chain()
    del model.graph.value_info[:]
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = 10**9
    return inspect(save(ctx.root / "absurd.onnx", model))


@case("huge_init.onnx", "conv1.weight")
def absurd_initializer_dims(ctx: Ctx) -> list[str]:
    """An initializer that claims 10^9 x 10^9 elements but holds 8 bytes."""
    model = chain()
    tensor = next(t for t in model.graph.initializer if t.name == "conv1.weight")
    del tensor.dims[:]
    tensor.dims.extend([10**9, 10**9])
    tensor.ClearField("float_data")
    tensor.raw_data = b"\x00" * 8
    return inspect(save(ctx.root / "huge_init.onnx", model))


# -- external data ---------------------------------------------------------------------------


@case("model.onnx", "evil.bin", "outside")
def external_data_parent_folder(ctx: Ctx) -> list[str]:
    path = external_chain(ctx.root / "m", "../evil.bin")
    (ctx.root / "evil.bin").write_bytes((ctx.root / "m" / "weights.bin").read_bytes())
    return inspect(path)


@case("model.onnx", "secret.bin", "outside")
def external_data_absolute_path(ctx: Ctx) -> list[str]:
    secret = ctx.root / "secret.bin"
    path = external_chain(ctx.root / "m", str(secret.resolve()))
    secret.write_bytes((ctx.root / "m" / "weights.bin").read_bytes())
    return inspect(path)


@case("model.onnx", "gone.bin")
def external_data_missing(ctx: Ctx) -> list[str]:
    return inspect(external_chain(ctx.root / "m", "gone.bin"))


@case("model.onnx", "weights.bin")
def external_data_short_file(ctx: Ctx) -> list[str]:
    """The weights file exists but is shorter than the tensors it should hold."""
    path = external_chain(ctx.root / "m", "weights.bin")
    weights = ctx.root / "m" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    return inspect(path)


@case("model.onnx", "conv1.weight", "unusable")
def external_data_nul_byte(ctx: Ctx) -> list[str]:
    """A location with a NUL byte (found by benchmarks/fuzz_loading.py)."""
    return inspect(external_chain(ctx.root / "m", "weights.bin\x00x"))


@case("model.onnx", "conv1.weight", "unusable")
def external_data_name_too_long(ctx: Ctx) -> list[str]:
    return inspect(external_chain(ctx.root / "m", "w" * 5000))


# -- tune: pattern cache ---------------------------------------------------------------------


@case("--pattern-cache", "evil.yaml")
def cache_python_tag(ctx: Ctx) -> list[str]:
    text = f'!!python/object/apply:os.system ["echo pwned > {PWNED_MARKER}"]\n'
    return tune(ctx, "--pattern-cache", str(yaml_file(ctx, "evil.yaml", text)))


@case("--pattern-cache", "evil2.yaml")
def cache_nested_python_tag(ctx: Ctx) -> list[str]:
    text = (
        "version: 1\npatterns:\n  abc:\n    schemes:\n"
        f'    - !!python/object/apply:os.system ["echo pwned > {PWNED_MARKER}"]\n'
    )
    return tune(ctx, "--pattern-cache", str(yaml_file(ctx, "evil2.yaml", text)))


@case("--pattern-cache", "list.yaml")
def cache_not_a_mapping(ctx: Ctx) -> list[str]:
    return tune(ctx, "--pattern-cache", str(yaml_file(ctx, "list.yaml", "- a\n- b\n")))


@case("--pattern-cache", "scalar.yaml")
def cache_scalar(ctx: Ctx) -> list[str]:
    return tune(ctx, "--pattern-cache", str(yaml_file(ctx, "scalar.yaml", "42\n")))


@case("--pattern-cache", "other.yaml", "another model")
def cache_for_another_model(ctx: Ctx) -> list[str]:
    text = (
        "version: 1\npatterns:\n"
        "  0123456789abcdef0123456789abcdef:\n"
        "    schemes:\n    - points: [NodeInput/0/0/Conv]\n      latency_ms: 1.5\n"
    )
    return tune(ctx, "--pattern-cache", str(yaml_file(ctx, "other.yaml", text)))


@case("--pattern-cache", "v99.yaml", "version")
def cache_future_version(ctx: Ctx) -> list[str]:
    return tune(ctx, "--pattern-cache",
                str(yaml_file(ctx, "v99.yaml", "version: 99\npatterns: {}\n")))


@case("--pattern-cache", "points.yaml")
def cache_points_not_strings(ctx: Ctx) -> list[str]:
    text = "version: 1\npatterns:\n  abc:\n    schemes:\n    - points: [1, [2]]\n"
    return tune(ctx, "--pattern-cache", str(yaml_file(ctx, "points.yaml", text)))


@case("--pattern-cache", "binary.yaml")
def cache_binary(ctx: Ctx) -> list[str]:
    path = ctx.root / "binary.yaml"
    path.write_bytes(random.Random(7).randbytes(512))
    return tune(ctx, "--pattern-cache", str(path))


@case("--pattern-cache", "nocache.yaml")
def cache_missing(ctx: Ctx) -> list[str]:
    return tune(ctx, "--pattern-cache", str(ctx.root / "nocache.yaml"))


# -- tune: other files -----------------------------------------------------------------------


@case("baseline.onnx", "not a readable ONNX model")
def baseline_random_bytes(ctx: Ctx) -> list[str]:
    path = ctx.root / "baseline.onnx"
    path.write_bytes(random.Random(99).randbytes(1024))
    return tune(ctx, "--qdq-baseline", str(path))


@case("--config", "config.yaml")
def config_python_tag(ctx: Ctx) -> list[str]:
    text = f'!!python/object/apply:os.system ["echo pwned > {PWNED_MARKER}"]\n'
    return tune(ctx, "--config", str(yaml_file(ctx, "config.yaml", text)))


@case("config", "schemes_per_region")
def config_bad_value(ctx: Ctx) -> list[str]:
    return tune(ctx, "--config", str(yaml_file(ctx, "config.yaml", "schemes_per_region: -5\n")))


@case("--output")
def output_is_a_file(ctx: Ctx) -> list[str]:
    """--output names an existing regular file (not a folder)."""
    blocker = ctx.root / "blocker"
    blocker.write_text("not a folder\n", encoding="utf-8")
    return ["tune", "--model", str(ctx.good), "--output", str(blocker), "--backend", "costmodel",
            "--mode", "quick", "--timing", "fast"]


@case("nomodel.onnx", "no such file")
def tune_missing_model(ctx: Ctx) -> list[str]:
    return tune(ctx, model=ctx.root / "nomodel.onnx")


# -- options ---------------------------------------------------------------------------------


def _option_case(*extra: str) -> Callable[[Ctx], list[str]]:
    def build(ctx: Ctx) -> list[str]:
        return tune(ctx, *extra)

    return build


for _id, _extra, _needles in [
    ("unknown_flag", ("--frobnicate",), ("--frobnicate",)),
    ("sampler_foo", ("--sampler", "foo"), ("--sampler", "foo")),
    ("quant_type_int4", ("--quant-type", "int4"), ("--quant-type", "int4")),
    ("timing_slow", ("--timing", "slow"), ("--timing", "slow")),
    ("mode_turbo", ("--mode", "turbo"), ("--mode", "turbo")),
    ("schemes_per_region_zero", ("--schemes-per-region", "0"), ("--schemes-per-region",)),
    ("schemes_per_region_negative", ("--schemes-per-region", "-3"), ("--schemes-per-region",)),
    ("schemes_per_region_text", ("--schemes-per-region", "many"), ("--schemes-per-region",)),
    ("timeout_negative", ("--timeout", "-1"), ("--timeout",)),
    ("timeout_nan", ("--timeout", "nan"), ("--timeout",)),
    ("threads_zero", ("--threads", "0"), ("--threads",)),
    ("seed_text", ("--seed", "abc"), ("--seed",)),
    ("storage_not_rdb", ("--storage", "redis://localhost:6379/0"), ("--storage", "redis")),
    ("storage_plain_path", ("--storage", "studies.db"), ("--storage", "studies.db")),
    ("backend_unknown", ("--backend", "nosuchbackend"), ("--backend", "nosuchbackend")),
]:
    CASES.append(Case(_id, _option_case(*_extra), _needles))


@case("--model")
def tune_without_model(ctx: Ctx) -> list[str]:
    return ["tune", "--output", str(ctx.out)]  # --output is optional (./qdq_optuna_output)


@case("frobnicate")
def unknown_command(ctx: Ctx) -> list[str]:
    return ["frobnicate", str(ctx.good)]


@case("--runtime", "cuda")
def inspect_bad_runtime(ctx: Ctx) -> list[str]:
    return inspect(ctx.good, "--runtime", "cuda")


@case("--maximum-sequence-region-size")
def inspect_zero_region_size(ctx: Ctx) -> list[str]:
    return inspect(ctx.good, "--maximum-sequence-region-size", "0")


@case("nosuchnet")
def example_unknown_name(ctx: Ctx) -> list[str]:
    return ["example", "nosuchnet", str(ctx.root / "x.onnx")]


@case("name.onnx")
def newline_in_file_name(ctx: Ctx) -> list[str]:
    """A file name with a line break still gives one error line."""
    path = ctx.root / "bad\nname.onnx"
    path.write_bytes(random.Random(5).randbytes(256))
    return inspect(path)


@case("self.onnx", "relu1_out")
def node_reads_own_output(ctx: Ctx) -> list[str]:
    model = chain()
    node(model, "relu1").input[0] = "relu1_out"
    return inspect(save(ctx.root / "self.onnx", model))


@case("bigraw.onnx", "conv1.bias")
def oversized_raw_data(ctx: Ctx) -> list[str]:
    """More weight bytes than the shape needs: the checker lets it pass, ONNX Runtime would not."""
    model = chain()
    tensor = next(t for t in model.graph.initializer if t.name == "conv1.bias")
    tensor.raw_data = tensor.raw_data + b"\x00" * 8
    return inspect(save(ctx.root / "bigraw.onnx", model))


@case("ONNX Runtime", "odd_relu")
def no_onnxruntime_kernel(ctx: Ctx) -> list[str]:
    """A valid ONNX graph that ONNX Runtime has no kernel for (Relu on int16)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="odd_relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.INT16, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT16, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return inspect(save(ctx.root / "int16.onnx", model))
