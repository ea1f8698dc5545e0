"""The MXFP8 SwiGLU MLP kernels (``experimental/mlp_mxfp8``): ``mlp_forward_mxfp8_nki`` and its backward kernel."""
