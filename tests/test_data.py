"""Calibration/validation data and models given from Python (``qdq_optuna.model.data``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader

from qdq_optuna import ModelError, UserError
from qdq_optuna.examples import zoo
from qdq_optuna.model import calibration
from qdq_optuna.model.data import data_digest, describe_model, input_data, model_argument


class Reader(CalibrationDataReader):
    """What quantize_static users write: one feed per get_next(), None at the end."""

    def __init__(self, batches: list[np.ndarray], name: str = "input") -> None:
        self.feeds = iter([{name: b} for b in batches])

    def get_next(self):
        return next(self.feeds, None)


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return zoo.build("tiny_residual")  # input [1, 3, 16, 16] float32


def _batches(n: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 3, 16, 16)).astype(dtype) for _ in range(n)]


def test_a_calibration_data_reader_is_stacked(model, tmp_path):
    batches = _batches(5)
    data = input_data(Reader(batches), model)
    assert list(data) == ["input"] and data["input"].shape == (5, 3, 16, 16)
    np.testing.assert_array_equal(data["input"], np.concatenate(batches))
    # the same as the .npz route, and usable for statistics as it is
    np.savez(tmp_path / "c.npz", input=np.concatenate(batches))
    from_file = input_data(tmp_path / "c.npz", model)
    np.testing.assert_array_equal(from_file["input"], data["input"])
    stats = calibration.collect_statistics(model, ["input"], data)
    assert stats["input"].amax == pytest.approx(float(np.abs(data["input"]).max()), rel=1e-6)


def test_dicts_lists_and_generators(model):
    batches = _batches(3, np.float64)
    as_dict = input_data({"input": np.concatenate(batches)}, model)
    assert as_dict["input"].dtype == np.float32  # cast to the model's type, as for .npz files
    as_list = input_data([{"input": b} for b in batches], model)
    as_gen = input_data(({"input": b} for b in batches), model, what="validation data")
    for d in (as_list, as_gen):
        np.testing.assert_array_equal(d["input"], as_dict["input"])
    assert data_digest(as_list) == data_digest(as_dict)
    assert data_digest(as_list) != data_digest({"input": as_dict["input"][:2]})


@pytest.mark.parametrize("data, message", [
    (Reader(_batches(2), name="image"), r"calibration data \(Reader\): array 'image' is not a "
                                        r"model input \(inputs: input\)"),
    (Reader([]), r"calibration data \(Reader\): holds no feeds"),
    ([{"input": _batches(1)[0]}, {"other": _batches(1)[0]}],
     r"feed 2 has inputs \['other'\], the first feed \['input'\]"),
    ([np.zeros(3)], r"feed 1 is a ndarray, not a dict"),
    ([{"input": np.float32(1.0)}], r"feed 1, input 'input' is a scalar"),
    ({"input": np.zeros((2, 3, 8, 8), np.float32)}, r"calibration data \(dict\): input 'input' "
                                                    r"has size 8 on axis 2"),
    ({"input": np.zeros((2, 3, 16, 16), np.int64)}, r"has dtype int64 but the model expects float32"),
    ({}, r"input 'input' is missing"),
    (42, r"calibration data: expected an .npz path, a dict of arrays, an iterable of feed dicts or "
         r"a CalibrationDataReader, got int"),
])
def test_bad_data_is_one_line_naming_the_input(model, data, message):
    with pytest.raises(UserError, match=message) as info:
        input_data(data, model)
    assert "\n" not in str(info.value)


def test_model_argument_takes_protos_paths_and_bytes(model, tmp_path):
    assert model_argument(model) is model
    path = tmp_path / "m.onnx"
    assert model_argument(path) == str(path)
    parsed = model_argument(model.SerializeToString())
    assert isinstance(parsed, onnx.ModelProto) and parsed.graph.name == model.graph.name
    assert describe_model(model) == f"<ModelProto {model.graph.name}>"
    assert describe_model(path) == str(path)
    with pytest.raises(ModelError, match="not a serialized ONNX model") as info:
        model_argument(b"\xff" * 64)
    assert len(str(info.value)) < 300
    with pytest.raises(ModelError, match="expected a path or an onnx.ModelProto, got list"):
        model_argument([model])


def test_a_text_file_is_not_an_npz_and_says_so(model, tmp_path):
    """numpy's own message for a text file talks about pickles; ours names the format."""
    path = tmp_path / "images.txt"
    path.write_text("0.1 0.2 0.3\n")
    with pytest.raises(UserError) as info:
        calibration.load_calibration_data(path, model)
    message = str(info.value)
    assert message.startswith(f"calibration data {path}: not an .npz file")
    assert "pickle" not in message and "numpy.savez" in message
    np.savez(tmp_path / "ok.npz", input=np.stack(_batches(2))[:, 0])
    assert calibration.load_calibration_data(tmp_path / "ok.npz", model)["input"].shape[0] == 2
