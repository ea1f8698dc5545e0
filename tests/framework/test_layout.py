"""Layout strings bind named dimensions across operands and explain mismatches."""

import pytest

from jax_nkilib._src.framework.layout import Layout, LayoutMismatch, bind_layouts


def layouts(*texts):
    return tuple(Layout.parse(t) for t in texts)


def test_binds_names_and_checks_expressions():
    dims, chosen = bind_layouts(
        [
            ("x", (8, 2, 3, 5), layouts("d, B, H, S")),
            ("t", (4, 2, 5), layouts("d/2, B, S")),
            ("c", (5, 16), layouts("B, S, 2*d", "S, 2*d")),
            ("f", (128, 3), layouts("128, H")),
        ]
    )
    assert dims == {"d": 8, "B": 2, "H": 3, "S": 5}
    assert str(chosen["c"]) == "[S, 2*d]"


@pytest.mark.parametrize(
    "shapes, fragment",
    [
        ([("x", (8, 2), layouts("d, B")), ("t", (5, 2), layouts("d/2, B"))], "dimension 0 (d/2) should be 4"),
        ([("x", (7, 2), layouts("d, B")), ("t", (3, 2), layouts("d/2, B"))], "d/2 is not an integer for d=7"),
        ([("x", (8,), layouts("d, B"))], "rank 2"),
        ([("x", (8, 2), layouts("d, B")), ("t", (8, 3), layouts("d, B"))], "should be 2"),
        ([("f", (64, 3), layouts("128, H"))], "should be 128"),
    ],
)
def test_mismatches_name_the_operand(shapes, fragment):
    with pytest.raises(LayoutMismatch) as info:
        bind_layouts(shapes)
    assert info.value.operand == shapes[-1][0]
    assert fragment in info.value.reason


def test_invalid_token():
    with pytest.raises(ValueError, match="invalid layout token"):
        Layout.parse("a+b, c")
