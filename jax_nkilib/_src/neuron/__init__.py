"""The Neuron path: what the installed SDK provides, the kernel compilers (nki-backed and dry-run) and the
custom-call lowering, which this package registers as every kernel's default lowering rule."""

from ..framework.primitive import register_neuron_lowering
from .lowering import neuron_lowering_rule

register_neuron_lowering(neuron_lowering_rule)
