"""Layout views: calling a kernel with operands and outputs in another axis order than the kernel's layout.

A layer-2 op holds its tensors in JAX layouts (``[batch, seq, heads, head_dim]``) while the NKI kernel wants its
own (``[d_head, B, n_heads, S]``). Instead of transposing around the kernel call, which on CPU/GPU makes XLA
materialise tensors in the kernel's layout, the op calls the kernel with a *view*: for each viewed operand or
output, the order of the kernel layout's dimension names in which it is given, e.g.
``{"x_in": "B, S, n_heads, d_head"}``. The primitive carries the view as the static ``layout`` param, a tuple of
``(name, permutation)`` with ``given = transpose(kernel_layout_value, permutation)``.

* Validation, abstract evaluation, Neuron limits and ``explain`` work on the kernel layout.
* On Neuron, the lowering transposes the viewed operands to the kernel layout, calls the kernel and transposes the
  outputs back: exactly the transposes a hand-written call would need.
* The JAX reference runs on the given layout directly when the spec's reference is view-aware, else between
  transposes.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from . import compat
from .layout import Layout
from .spec import KernelSpec

View = tuple  # tuple[tuple[str, tuple[int, ...]], ...]


def _permutation(kernel: Layout, given_text: str, where: str) -> tuple[int, ...]:
    given = [token.strip() for token in given_text.split(",")]
    kernel_tokens = [dim.text for dim in kernel.dims]
    if sorted(given) != sorted(kernel_tokens):
        raise ValueError(f"{where}: layout view [{given_text}] must order the dimensions of {kernel}")
    return tuple(kernel_tokens.index(token) for token in given)


def make_view(spec: KernelSpec, views: Mapping[str, str], ranks: Mapping[str, int], params) -> View:
    """The ``layout`` param for ``views`` (operand or output name -> given order of the kernel's dimension names).

    ``ranks`` gives the rank of each operand present (it selects among an operand's layouts of different ranks);
    views of absent optional operands are ignored.
    """
    absent = {operand.name for operand in spec.operands if operand.name not in ranks}
    layouts = {}
    for operand in spec.operands:
        if operand.name in ranks:
            options = operand.layouts_for(params)
            layouts[operand.name] = next((option for option in options if option.rank == ranks[operand.name]),
                                         options[0])
    for output in spec.outputs:
        layouts[output.name] = output.layout  # outputs computed by a spec's output_avals hook have no layout
    view = []
    for name, text in views.items():
        if name in absent:
            continue
        if name not in layouts:
            raise ValueError(f"{spec.public_name}: layout view for unknown operand or output `{name}`")
        perm = _permutation(layouts[name], text, f"{spec.public_name}: `{name}`")
        if perm != tuple(range(len(perm))):
            view.append((name, perm))
    return tuple(sorted(view))


def permutation_of(view: View, name: str) -> tuple[int, ...] | None:
    for key, perm in view:
        if key == name:
            return perm
    return None


def kernel_shape(shape, perm) -> tuple[int, ...]:
    """Shape in the kernel layout of a value given with ``perm``."""
    out = [0] * len(shape)
    for position, axis in enumerate(perm):
        out[axis] = shape[position]
    return tuple(out)


def given_shape(shape, perm) -> tuple[int, ...]:
    return tuple(shape[axis] for axis in perm)


def kernel_aval(aval, perm):
    return aval if perm is None else compat.ShapedArray(kernel_shape(aval.shape, perm), aval.dtype)


def given_aval(aval, perm):
    return aval if perm is None else compat.ShapedArray(given_shape(aval.shape, perm), aval.dtype)


def to_kernel(value, perm):
    """Transpose a value given with ``perm`` into the kernel layout."""
    return value if perm is None else jnp.transpose(value, tuple(sorted(range(len(perm)), key=perm.__getitem__)))


def to_given(value, perm):
    """Transpose a kernel-layout value into the order given by ``perm``."""
    return value if perm is None else jnp.transpose(value, perm)


def given_axis(perm, kernel_axis: int) -> int:
    """Where the kernel layout's axis ``kernel_axis`` sits in the given order."""
    return kernel_axis if perm is None else perm.index(kernel_axis)
