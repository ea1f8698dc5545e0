"""The loss kernels (layer 1): ``cross_entropy_forward`` and ``cross_entropy_backward`` (NKI Library
``experimental/loss``), with their vocabulary-chunked JAX references."""
