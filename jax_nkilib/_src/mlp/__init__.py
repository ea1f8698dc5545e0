"""The MLP family: the ``mlp`` NKI kernel (layer 1, ``kernel``), its math (``math``) and ``jax_nkilib.mlp``
(layer 2, ``ops``)."""
