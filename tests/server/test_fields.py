"""The per-layer vector type: every entry a float once validated, a null marked as
missing so that numpy finds it, a sent NaN never taken for a missing entry."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from ampwatch.server.fields import MISSING_ENTRY, WireFloat, WireFloats, missing_entries

VECTOR = TypeAdapter(WireFloats)


def test_a_vector_validates_to_floats_with_its_nulls_marked_missing():
    values = VECTOR.validate_json(b'[1.5, 2, "NaN", "Infinity", "-Infinity", null, 0]')
    assert all(type(v) is float for v in values)
    assert values[:2] == [1.5, 2.0] and values[3:5] == [math.inf, -math.inf]
    array = np.array(values, dtype=np.float64)
    assert missing_entries(array).tolist() == [False] * 5 + [True, False]
    assert math.isnan(values[2]) and math.isnan(values[5])  # both NaN, only one missing
    assert np.array(values[5]).tobytes() == np.array(MISSING_ENTRY).tobytes()


@pytest.mark.parametrize("body", [b"[true]", b'["1.5"]', b'["nan"]', b"[[1.0]]", b"[{}]"])
def test_a_vector_refuses_what_is_not_a_number(body):
    with pytest.raises(ValidationError):
        VECTOR.validate_json(body)


def test_a_sent_nan_is_not_missing_even_from_python():
    values = VECTOR.validate_python([float("nan"), None])
    assert missing_entries(np.array(values)).tolist() == [False, True]


@pytest.mark.parametrize(("body", "expected"), [(b"3", 3.0), (b'"Infinity"', math.inf),
                                                (b"-0.5", -0.5)])
def test_a_scalar_validates_to_a_float(body, expected):
    value = TypeAdapter(WireFloat).validate_json(body)
    assert type(value) is float and value == expected


@pytest.mark.parametrize("body", [b"true", b'"3"', b"null"])
def test_a_scalar_refuses_what_is_not_a_number(body):
    with pytest.raises(ValidationError):
        TypeAdapter(WireFloat).validate_json(body)
