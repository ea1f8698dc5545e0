"""jax_nkilib.nki.dynamic_elementwise_add against a float64 NumPy oracle: the sum on the first num_m_tiles * 128 rows
and the documented zeros on the rows the kernel leaves unwritten, a run-time count (no recompilation), the VJP, vmap
(a shared count folds into the columns), Neuron lowering and its limits, run-time checks and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import dynamic_elementwise_add
from tests.support import nki_standin
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

M, H = 384, 512


def oracle(a, b, num_m_tiles):
    """``a + b`` in float64 on rows below ``clip(num_m_tiles, 0, M/128) * 128``; the reference's zeros elsewhere."""
    rows = min(max(int(num_m_tiles), 0), a.shape[0] // 128) * 128
    out = np.zeros(a.shape)
    out[:rows] = f64(a)[:rows] + f64(b)[:rows]
    return out


def count(n):
    return jnp.full((1, 1), n, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tiles", [0, 1, 3])
def test_forward_adds_the_counted_rows_and_zeros_the_rest(tiles, dtype):
    a, b = random((M, H), dtype, seed=1), random((M, H), dtype, seed=2)
    out = dynamic_elementwise_add(a, b, count(tiles))
    assert out.shape == (M, H) and out.dtype == dtype
    expected = oracle(a, b, tiles)
    assert_close(out, expected, dtype, ops=1)
    assert not np.asarray(f64(out)[tiles * 128 :]).any()  # the unwritten rows: exactly zero here


def test_odd_widths_run_the_reference():
    a, b = random((128, 37), seed=3), random((128, 37), seed=4)
    assert_close(dynamic_elementwise_add(a, b, count(1)), oracle(a, b, 1), jnp.float32, ops=1)


def test_the_count_is_a_runtime_value_and_out_of_range_counts_clamp():
    a, b = random((M, H), jnp.bfloat16, seed=5), random((M, H), jnp.bfloat16, seed=6)
    add = jax.jit(dynamic_elementwise_add)
    for tiles in (2, 0, 7, -1):  # one compiled program for every count
        assert_close(add(a, b, count(tiles)), oracle(a, b, tiles), jnp.bfloat16, ops=1)
    assert add._cache_size() == 1


def test_runtime_checks_report_a_count_out_of_range():
    a, b = random((256, 512), seed=7), random((256, 512), seed=8)
    with jax_nkilib.config(runtime_checks=True):
        checked = checkify.checkify(dynamic_elementwise_add, errors=checkify.user_checks)
        error, _ = checked(a, b, count(3))
        with pytest.raises(checkify.JaxRuntimeError, match=r"num_m_tiles = 3 is outside \[0, M/128 = 2\]"):
            error.throw()
        error, _ = checked(a, b, count(2))
        assert error.get() is None


def test_vjp_passes_the_cotangent_on_the_written_rows_only():
    a, b, dy = (random((256, 512), seed=s) for s in (9, 10, 11))
    _, pullback = jax.vjp(lambda a, b: dynamic_elementwise_add(a, b, count(1)), a, b)
    da, db = pullback(dy)
    expected = np.concatenate([f64(dy)[:128], np.zeros((128, 512))])
    np.testing.assert_array_equal(f64(da), expected)
    np.testing.assert_array_equal(f64(db), expected)


def test_vmap_with_a_shared_count_folds_into_the_columns():
    a, b = random((3, 256, 512), jnp.bfloat16, seed=12), random((3, 256, 512), jnp.bfloat16, seed=13)
    shared = jax.vmap(dynamic_elementwise_add, (0, 0, None))
    out = shared(a, b, count(1))
    for i in range(3):
        assert_close(out[i], oracle(a[i], b[i], 1), jnp.bfloat16, ops=1)
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(shared, a, b, count(1)))
    assert cfg["input_specs"][0][0] == [256, 1536]
    counts = jnp.array([0, 1, 2], jnp.int32).reshape(3, 1, 1)
    per_element = jax.vmap(dynamic_elementwise_add)(a, b, counts)  # a batched count: lax.map
    for i in range(3):
        assert_close(per_element[i], oracle(a[i], b[i], i), jnp.bfloat16, ops=1)


def test_neuron_lowering_one_call_and_its_limits():
    a = jax.ShapeDtypeStruct((M, H), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(dynamic_elementwise_add, a, a, n)
        (cfg,) = kernel_configs(text)
        assert cfg["entry_point"].endswith("dynamic_shapes.dynamic_elementwise_add:dynamic_elementwise_add")
        assert [spec[0] for spec in cfg["input_specs"]] == [[M, H], [M, H], [1, 1]]
        assert compute_operations(text) == []
        with pytest.warns(NeuronFallbackWarning, match="documented for bfloat16"):
            f32 = jax.ShapeDtypeStruct((M, H), jnp.float32)
            assert kernel_configs(neuron_text(dynamic_elementwise_add, f32, f32, n)) == []
        with pytest.warns(NeuronFallbackWarning, match="H=640 is not a multiple of the kernel's column tile 512"):
            odd = jax.ShapeDtypeStruct((M, 640), jnp.bfloat16)
            neuron_text(dynamic_elementwise_add, odd, odd, n)


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda a, b, n: dynamic_elementwise_add(a[:200], b[:200], n), ValueError, "M % 128 == 0"),
        (lambda a, b, n: dynamic_elementwise_add(a, b[:, :256], n), ValueError, "argument `input_b`"),
        (lambda a, b, n: dynamic_elementwise_add(a, b.astype(jnp.float32), n), TypeError, "same dtype"),
        (lambda a, b, n: dynamic_elementwise_add(a, b, n[0]), ValueError, "argument `num_m_tiles`"),
        (lambda a, b, n: dynamic_elementwise_add(a, b, n.astype(jnp.float32)), TypeError, "`num_m_tiles`"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((256, 512), jnp.bfloat16), random((256, 512), jnp.bfloat16, seed=1), count(1))
    assert fragment in str(info.value)


def test_nki_compiler_hands_the_library_kernel_its_three_tensors(monkeypatch):
    """Against the stand-in SDK: the count reaches the library kernel as an int32 [1, 1] array, after the addends."""
    entry = "nkilib.experimental.dynamic_shapes.dynamic_elementwise_add:dynamic_elementwise_add"
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {entry: nki_standin.library_function(entry)})
    standin.rule("dynamic_elementwise_add", lambda input_a, **_: np.empty(input_a.shape, input_a.dtype))
    a = random((256, 1024), jnp.bfloat16)
    text = neuron_text(dynamic_elementwise_add, a, a, count(1))
    assert [c["func_name"] for c in kernel_configs(text)] == ["dynamic_elementwise_add"]
    (compilation,) = standin.compilations
    inputs = compilation["inputs"]
    assert list(inputs) == ["input_a", "input_b", "num_m_tiles"]
    assert inputs["num_m_tiles"].shape == (1, 1) and inputs["num_m_tiles"].dtype == np.int32
