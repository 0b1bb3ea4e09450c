"""lossscale: mixed-precision training with JAX and optax.

:func:`autocast` runs any JAX function with 16-bit matmuls and float32
where 16 bits are unsafe; pure-functional loss-scale states (no-op,
static, dynamic) that are pytrees, and an optax wrapper that unscales
gradients, skips non-finite updates without a host round-trip, and adapts
the scale.
"""

from lossscale import _interop as _interop
from lossscale._accumulation import MultiSteps
from lossscale._autocast import FUNCTION_RULES as AUTOCAST_FUNCTION_RULES
from lossscale._autocast import PRIMITIVE_RULES as AUTOCAST_RULES
from lossscale._autocast import (
    Float8,
    Float8Cast,
    Float8Recipe,
    Matmul,
    MatmulInfo,
    autocast,
    compute_scope,
    float32_scope,
    matmuls,
)
from lossscale._diagnose import Diagnosis, diagnose
from lossscale._finite import all_finite
from lossscale._grad import value_and_grad
from lossscale._inspect import (
    compare_config,
    get_loss_scale,
    loss_scale_config,
    metrics,
    nonfinite_paths,
)
from lossscale._policy import (
    Policy,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from lossscale._rescale import rescale_gradient
from lossscale._scales import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from lossscale._transform import (
    LossScaledState,
    loss_scaled,
    loss_scaled_by_group,
)
from lossscale._tree import select_tree

__version__ = "0.3.0.dev0"

_interop.register_flax_serialization(
    (NoOpLossScale, StaticLossScale, DynamicLossScale)
)

__all__ = (
    "AUTOCAST_FUNCTION_RULES",
    "AUTOCAST_RULES",
    "Diagnosis",
    "DynamicLossScale",
    "Float8",
    "Float8Cast",
    "Float8Recipe",
    "LossScale",
    "LossScaledState",
    "Matmul",
    "MatmulInfo",
    "MultiSteps",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "compare_config",
    "compute_scope",
    "diagnose",
    "float32_scope",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "loss_scale_config",
    "loss_scaled",
    "loss_scaled_by_group",
    "matmuls",
    "metrics",
    "nonfinite_paths",
    "rescale_gradient",
    "select_tree",
    "value_and_grad",
)
