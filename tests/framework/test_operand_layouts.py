"""The leading ``...`` layout token and ``check_operand_layouts``, the idiomatic ops' one layout check."""

import jax.numpy as jnp
import pytest

from jax_nkilib._src.framework.layout import Layout, LayoutMismatch, bind_layouts
from jax_nkilib._src.framework.validation import check_operand_layouts


def test_leading_ellipsis_matches_any_number_of_leading_dims():
    layout = Layout.parse("..., S, D")
    assert str(layout) == "[..., S, D]" and layout.rank == 2
    for shape in [(4, 8), (2, 4, 8), (3, 2, 4, 8)]:
        dims, chosen = bind_layouts([("x", shape, (layout,)), ("t", (4, 4), (Layout.parse("S, D/2"),))])
        assert dims == {"S": 4, "D": 8} and chosen["x"] is layout


def test_leading_ellipsis_mismatches_report_the_position_in_the_shape():
    with pytest.raises(LayoutMismatch) as info:
        bind_layouts([("x", (2, 3, 8), (Layout.parse("..., H"),)), ("w", (3, 5), (Layout.parse("..., H"),))])
    assert info.value.operand == "w"
    assert "must have layout [..., H]: dimension 1 (H) should be 8" in info.value.reason
    with pytest.raises(LayoutMismatch, match=r"rank >= 2\); got rank 1"):
        bind_layouts([("x", (8,), (Layout.parse("..., S, H"),))])


def test_ellipsis_only_leads():
    with pytest.raises(ValueError, match="may only be the first token"):
        Layout.parse("B, ..., H")


def test_check_operand_layouts_binds_and_skips_absent_operands():
    x, w = jnp.zeros((2, 3, 8)), jnp.zeros((8,))
    layouts = {"x": "..., H", "weight": "H", "bias": "H"}
    assert check_operand_layouts("op", layouts, x=x, weight=w, bias=None) == {"H": 8}
    assert check_operand_layouts("op", layouts, x=jnp.zeros((8,)), weight=None, bias=w) == {"H": 8}
    tables = ("S, D/2", "B, S, D/2")
    dims = check_operand_layouts("op", {"x": "..., S, D", "t": tables}, x=jnp.zeros((2, 5, 8)), t=jnp.zeros((2, 5, 4)))
    assert dims == {"S": 5, "D": 8, "B": 2}


def test_check_operand_layouts_names_the_argument_and_layout():
    layouts = {"x": "..., H", "weight": "H"}
    x = jnp.zeros((2, 3, 8))
    with pytest.raises(ValueError, match=r"jax_nkilib.rms_norm: `weight` must have layout \[H\].*got shape \(5,\)"):
        check_operand_layouts("jax_nkilib.rms_norm", layouts, x=x, weight=jnp.zeros((5,)))
    with pytest.raises(ValueError, match=r"op: `x` must have layout \[\.\.\., H\] \(rank >= 1\); got rank 0"):
        check_operand_layouts("op", layouts, x=jnp.zeros(()), weight=None)
    with pytest.raises(ValueError, match=r"op: `x` must have layout \[\.\.\., H\] with H >= 1; got shape \(3, 0\)"):
        check_operand_layouts("op", layouts, positive=("H",), x=jnp.zeros((3, 0)), weight=None)
    assert check_operand_layouts("op", layouts, x=jnp.zeros((0, 8)), weight=None) == {"H": 8}  # leading dims free


def test_check_operand_layouts_checks_arrays_and_dtypes():
    layouts = {"x": "..., H", "scale": "H"}
    with pytest.raises(TypeError, match=r"op: `x` must be an array \[\.\.\., H\]; got list"):
        check_operand_layouts("op", layouts, x=[1.0], scale=None)
    with pytest.raises(TypeError, match=r"op: `x` \[\.\.\., H\] must have a floating dtype"):
        check_operand_layouts("op", layouts, x=jnp.zeros((2,), jnp.int32), scale=None)
    x, scale = jnp.zeros((2, 4)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(TypeError, match="`scale`"):
        check_operand_layouts("op", layouts, x=x, scale=scale)
    assert check_operand_layouts("op", layouts, dtypes={"scale": None}, x=x, scale=scale) == {"H": 4}


def test_check_operand_layouts_starts_from_known_dims():
    layouts = {"cos": "batch, seq, head_dim", "sin": "batch, seq, head_dim"}
    table = jnp.zeros((2, 3, 4))
    known = {"batch": 2, "seq": 3, "head_dim": 4}
    assert check_operand_layouts("op", layouts, known=known, cos=table, sin=table) == known
    with pytest.raises(
        ValueError, match=r"op: `cos` must have layout \[batch, seq, head_dim\]: dimension 2 \(head_dim\)"
    ):
        check_operand_layouts("op", layouts, known={**known, "head_dim": 8}, cos=table, sin=table)
    dims, _ = bind_layouts([("t", (3, 4), (Layout.parse("S, D/2"),))], known={"D": 8})
    assert dims == {"D": 8, "S": 3}
