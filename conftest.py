"""Test configuration shared by tests/ and the doctests in lossscale/.

Strict dtype promotion turns any silent float16 -> float32 promotion in the
library into an error, which is what a mixed-precision library must avoid.
"""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
