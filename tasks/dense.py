"""Dense decode task types (ids 16-63). Importing this module registers them:

    16 gemv_m1         y = W x (+ residual), optional fused RMSNorm prologue
    17 rmsnorm         y = x * rsqrt(mean(x^2) + eps) * w
    18 gate_up_silu    h = silu(Wg x) * (Wu x), optional fused RMSNorm prologue
    19 silu_mul        h = silu(g) * u
    20 embedding       y = table[token[0]]
    21 lm_head_argmax  partial argmax (+ optional logits) over vocab tiles, optional fused final norm
    22 argmax_reduce   token = argmax over the partials
    23 group_gemm_m1   routed MoE expert GEMM, one live row per active expert
    24 gemv_m1_fp8     gemv_m1 with e4m3 weights and per-channel scales

Declarations live in dense_matvec.py and dense_elementwise.py; each device body is tasks/<name>.cuh, sharing tasks/dense_common.cuh.
"""
from . import dense_elementwise  # noqa: F401
from . import dense_matvec  # noqa: F401
from .dense_common import FLAG_LOGITS, FLAG_NORM, FLAG_RESIDUAL, MAX_K  # noqa: F401
from .dense_matvec import EXPERT_ROWS  # noqa: F401
