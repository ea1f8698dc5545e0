"""The convolution kernels (layer 1): ``conv1d``, ``depthwise_conv1d_implicit_gemm``."""
