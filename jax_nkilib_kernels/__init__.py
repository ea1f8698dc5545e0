"""Device-side NKI entry points (installed as ``jax_nkilib_kernels``).

These modules import the Neuron SDK's ``nki`` and the NKI Library (``nkilib``); only ``NkiCompiler`` loads them.
Where an NKI Library kernel is already an HBM-in/HBM-out ``@nki.jit`` function, its spec points straight at it;
where it is not (destination-passing outputs, SBUF operands, config objects), a thin adapter here allocates the
outputs, calls the library kernel and returns them. Adapters never re-implement a kernel.
"""
