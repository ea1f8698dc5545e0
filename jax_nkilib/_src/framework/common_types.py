"""The NKI Library's shared enums (``nkilib.core.utils.common_types``), with the kernels' class and member names.

Layer-1 functions take these members or their names as strings (``normalization_type="RMS_NORM"``).
"""

from __future__ import annotations

import enum


class QKVOutputLayout(enum.Enum):
    """``BSD``: ``[B, S, (nq + 2 nkv) d]``; ``NBSd``: ``[heads, B, S, d]``; ``NBdS``: ``[heads, B, d, S]``."""

    BSD = 0
    NBSd = 1
    NBdS = 2


class NormType(enum.Enum):
    """``RMS_NORM_SKIP_GAMMA``: RMS normalisation without the gamma multiply."""

    NO_NORM = 0
    RMS_NORM = 1
    LAYER_NORM = 2
    RMS_NORM_SKIP_GAMMA = 3


class ActFnType(enum.Enum):
    """``SiLU``/``Swish``: ``x sigmoid(x)``; ``GELU``: erf form; ``GELU_Tanh_Approx``: tanh form; ``ReLU``."""

    SiLU = 0
    GELU = 1
    GELU_Tanh_Approx = 2
    Swish = 3
    ReLU = 4


class QuantizationType(enum.Enum):
    """``STATIC``: one FP8 scale per tensor; ``ROW``: one per row (channel); ``MX``: one e8m0 scale per 32 elements;
    ``STATIC_MX``/``ROW_MX``: MX formats with identity micro-scales and a tensor/row scale."""

    NONE = 0
    STATIC = 1
    ROW = 2
    MX = 3
    STATIC_MX = 4
    ROW_MX = 5


class DtypeMode(enum.Enum):
    """FP8 E4M3 variant: ``NON_OCP`` ``float8_e4m3`` (max 240), ``OCP`` ``float8_e4m3fn`` (max 448), ``AUTO``
    (the hardware's choice: OCP where supported)."""

    NON_OCP = "non_ocp"
    OCP = "ocp"
    AUTO = "auto"


class QKVWeightLayout(enum.Enum):
    """``CONTIGUOUS``: ``[H, I]``; ``MX_CONTIGUOUS``: ``[H/4, I, 4]`` (4 consecutive H rows innermost);
    ``MX_INTERLEAVED``: the same after the DMA-transpose row interleave."""

    CONTIGUOUS = 0
    MX_CONTIGUOUS = 1
    MX_INTERLEAVED = 2


class MLPGateUpWeightLayout(enum.Enum):
    """``CONTIGUOUS``: ``[H, I]``; ``H_X4_INNERMOST`` / ``H_X4_MIDDLE``: the MX ``[128, H/512, I/512, 4, 128, 4]``
    swizzles."""

    CONTIGUOUS = 0
    H_X4_INNERMOST = 1
    H_X4_MIDDLE = 2


class RouterActFnType(enum.Enum):
    """The NKI Library's router activation (``nkilib.core.utils.common_types``): ``SIGMOID`` per selected logit,
    ``SOFTMAX`` over the top-K logits, ``NOAUX_TC`` group-limited selection (DeepSeek-V3 style)."""

    SIGMOID = 0
    SOFTMAX = 1
    NOAUX_TC = 2


class ExpertAffinityScaleMode(enum.Enum):
    """When the MoE kernels weight an expert's output by its routing affinity: ``NO_SCALE`` never, ``POST_SCALE``
    after the down projection, ``PRE_SCALE`` on the expert's input, ``PRE_SCALE_DELAYED`` on the intermediate."""

    NO_SCALE = 0
    POST_SCALE = 1
    PRE_SCALE = 2
    PRE_SCALE_DELAYED = 3
