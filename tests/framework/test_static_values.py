"""The static-value checks of the idiomatic ops (framework/validation.py): each error names the op and the argument,
and a traced value is refused with the advice to make it static."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_nkilib._src.framework.validation import check_positive_finite, static_bool, static_bounds, static_float

OP = "jax_nkilib.op"


def test_static_float():
    assert static_float(OP, "eps", 1) == 1.0 and static_float(OP, "eps", np.float32(0.5)) == 0.5
    assert static_float(OP, "eps", jnp.asarray([2.0])) == 2.0  # a concrete one-element array
    assert static_float(OP, "eps", 0.0, minimum=0.0) == 0.0
    for value, error, fragment in [
        (float("nan"), ValueError, "got nan"),
        (np.inf, ValueError, "got inf"),
        (-1.0, ValueError, ">= 0"),
        (True, TypeError, "got True"),
        ("1", TypeError, "got '1'"),
        (None, TypeError, "got None"),
        (jnp.ones(2), TypeError, "(2,)"),
    ]:
        with pytest.raises(error, match=r"jax_nkilib.op: `eps` must be a finite Python float") as info:
            static_float(OP, "eps", value, minimum=0.0)
        assert fragment in str(info.value)
    with pytest.raises(ValueError, match="> 0"):
        static_float(OP, "scale", 0.0, minimum=0.0, exclusive=True)
    with pytest.raises(TypeError, match="`eps` must be static .*not a traced value"):
        jax.jit(lambda e: static_float(OP, "eps", e))(1.0)


def test_static_bool_and_bounds():
    assert static_bool(OP, "flag", np.bool_(True)) is True
    with pytest.raises(TypeError, match="`flag` must be a Python bool; got 1"):
        static_bool(OP, "flag", 1)
    assert static_bounds(OP, "clamp", (None, 3)) == (None, 3.0)
    assert static_bounds(OP, "clamp", (-np.inf, np.float32(2.0))) == (-np.inf, 2.0)
    assert static_bounds(OP, "clamp", (1.0, 1.0)) == (1.0, 1.0)
    for value, error, fragment in [
        ((2.0, 1.0), ValueError, "lower > upper"),
        ((np.nan, 1.0), ValueError, "NaN"),
        ([0.0, 1.0], TypeError, "tuple"),
        ((0.0,), TypeError, "tuple"),
        ((0.0, "1"), TypeError, "upper bound is '1'"),
    ]:
        with pytest.raises(error, match="jax_nkilib.op: `clamp`") as info:
            static_bounds(OP, "clamp", value)
        assert fragment in str(info.value)
    with pytest.raises(TypeError, match=r"`clamp\[lower\]` must be static"):
        jax.jit(lambda c: static_bounds(OP, "clamp", (c, None)))(1.0)


def test_check_positive_finite_checks_concrete_values_only():
    check_positive_finite(OP, "scale", 0.5)
    check_positive_finite(OP, "scale", jnp.asarray([1.0, 2.0], jnp.bfloat16))
    for bad in (0.0, -1, np.nan, jnp.float32(np.inf), np.array([1.0, 0.0])):
        with pytest.raises(ValueError, match=r"jax_nkilib.op: `scale` \(a scale\) must be finite and > 0"):
            check_positive_finite(OP, "scale", bad)
    jax.jit(lambda s: check_positive_finite(OP, "scale", s) or s)(0.0)  # traced: the op documents what happens
