"""The MLP kernels (layer 1): ``mlp`` (CTE/TKG dispatch, FP8 and MX weights) and the MXFP8 SwiGLU pair
``mlp_forward_mxfp8_nki`` / ``mlp_backward_mxfp8_nki``, with their references."""
