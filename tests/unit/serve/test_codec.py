"""Request decoding: every malformed or mismatched body becomes BadInput (400) or InputMismatch (422)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from gpuyard.serve.codec import (
    BadInput,
    InputMismatch,
    decode_json,
    decode_tensor,
    encode_json,
    encode_tensor,
    input_spec,
)

pytestmark = pytest.mark.unit

SIG = {
    "inputs": {
        "dtype": "float32",
        "shape": [-1, 3],
        "min": [0.0, -1.0, 5.0],
        "max": [1.0, 1.0, 5.0],
        "names": ["a", "b", "c"],
    }
}
SPEC = input_spec(SIG, max_rows=4)


def body(doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_batch_and_single_sample_decode_to_float32_batches() -> None:
    batch = decode_json(body({"inputs": [[0.5, 0, 5], [1, 1, 5]]}), SPEC)
    assert batch.dtype == np.float32 and batch.shape == (2, 3)
    single = decode_json(body({"inputs": [0.5, 0, 5]}), SPEC)
    assert single.shape == (1, 3) and single[0, 0] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("raw", "error", "words"),
    [
        (b"not json", BadInput, "not valid JSON"),
        (b"\xff\xfe", BadInput, "not valid JSON"),
        (body([1, 2, 3]), BadInput, '"inputs"'),
        (body({"inputs": []}), InputMismatch, "non-empty"),
        (body({"inputs": [[1, 2, 3], [1, 2]]}), InputMismatch, "ragged"),
        (body({"inputs": [["1", "2", "5"]]}), InputMismatch, "strings"),
        (body({"inputs": [[None, 0, 5]]}), InputMismatch, "nulls"),
        (body({"inputs": [[True, False, True]]}), InputMismatch, "booleans"),
        (b'{"inputs": [[1e999, 0, 5]]}', InputMismatch, "NaN or infinite"),
        (body({"inputs": [[10**400, 0, 5]]}), InputMismatch, "nulls, objects"),
        (body({"inputs": [[0, 0]]}), InputMismatch, "does not match the model's signature [-1, 3]"),
        (body({"inputs": [[0, 0, 5]] * 5}), InputMismatch, "1 to 4 samples"),
        (body({"inputs": [[0.5, 100.0, 5]]}), InputMismatch, "feature 1 (b)"),
    ],
)
def test_bad_json_bodies_are_refused_with_a_message(raw: bytes, error: type, words: str) -> None:
    with pytest.raises(error, match=None) as info:
        decode_json(raw, SPEC)
    assert words in str(info.value)


def test_range_check_tolerates_mild_shift_and_constant_features() -> None:
    # c was constant (5) in training: values around it are still accepted (span falls back to |5|).
    assert decode_json(body({"inputs": [[1.5, -2.5, 9.0]]}), SPEC).shape == (1, 3)
    with pytest.raises(InputMismatch, match="feature 2"):
        decode_json(body({"inputs": [[0, 0, 11.0]]}), SPEC)


def test_a_narrow_feature_far_from_zero_is_widened_by_its_magnitude_and_the_message_says_so() -> None:
    spec = input_spec({"inputs": {"shape": [-1, 1], "min": [100.0], "max": [101.0]}})
    # Span 1, magnitude 101: accepted from -1 to 202, so a 2% shift is served (it shows up as drift).
    assert decode_json(body({"inputs": [[103.0]]}), spec).shape == (1, 1)
    with pytest.raises(
        InputMismatch, match=r"range \[-1, 202\] \(the training range widened on each side by 1x max"
    ):
        decode_json(body({"inputs": [[203.0]]}), spec)


def test_tensor_bodies_roundtrip_and_reject_wrong_content() -> None:
    x = np.array([[0.1, 0.2, 5.0]], dtype=np.float64)
    assert decode_tensor(save({"inputs": x}), SPEC).dtype == np.float32
    with pytest.raises(BadInput, match="no tensor named 'inputs'"):
        decode_tensor(save({"x": x}), SPEC)
    with pytest.raises(InputMismatch, match="signature"):
        decode_tensor(save({"inputs": np.zeros((2, 4), np.float32)}), SPEC)
    with pytest.raises(BadInput, match="not a safetensors"):
        decode_tensor(b"\x10\x00\x00\x00\x00\x00\x00\x00{}", SPEC)


def test_outputs_encode_in_both_formats() -> None:
    outputs = {
        "predictions": np.array([1, 0]),
        "probabilities": np.array([[0.2, 0.8], [0.6, 0.4]], np.float32),
    }
    doc = json.loads(encode_json(outputs, "m", 3))
    assert doc["model"] == "m" and doc["version"] == 3 and doc["predictions"] == [1, 0]
    back = decode_tensor(save({"inputs": np.zeros((1, 3), np.float32)}), SPEC)
    assert back.shape == (1, 3)
    from safetensors.numpy import load

    assert np.array_equal(load(encode_tensor(outputs))["probabilities"], outputs["probabilities"])


def test_a_signature_without_input_shape_cannot_be_served() -> None:
    from gpuyard.errors import ConfigError

    with pytest.raises(ConfigError, match=r"inputs\.shape"):
        input_spec({"inputs": {}})
    with pytest.raises(ConfigError, match="batch dimension"):
        input_spec({"inputs": {"shape": [-1, -1]}})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_anything_but_input_errors(raw: bytes) -> None:
    for decode in (decode_json, decode_tensor):
        with contextlib.suppress(BadInput, InputMismatch):
            decode(raw, SPEC)


json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_random_json_inputs_never_escape_as_anything_but_input_errors(value: object) -> None:
    try:
        out = decode_json(json.dumps({"inputs": value}).encode(), SPEC)
    except (BadInput, InputMismatch):
        return
    assert out.shape[1:] == (3,) and np.isfinite(out).all()
