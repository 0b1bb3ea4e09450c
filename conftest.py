"""Test configuration shared by tests/ and the doctests in lossscale/.

Every test runs under strict dtype promotion, which turns any silent
float16 -> float32 promotion in the library into an error: what a
mixed-precision library must avoid. optax's own optimizers (e.g. adam's
bias correction) are not written for strict promotion, so tests that run
them inside the wrapper opt out with ``@pytest.mark.standard_promotion``.
"""

import jax
import pytest

# A script run in subprocesses by test_multiprocess.py, not a test module.
collect_ignore = ["tests/multiprocess_worker.py"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "standard_promotion: run under JAX's standard dtype promotion "
        "(for tests that run optax optimizers not written for strict mode)",
    )
    config.addinivalue_line(
        "markers",
        "slow: a smoke run (demo, notebooks, benchmark, several processes, "
        "pyright) or the long tail of a sweep (the optax zoo, every mesh "
        "layout); -m 'not slow' keeps one case of every behaviour",
    )


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    marker = request.node.get_closest_marker("standard_promotion")
    mode = "standard" if marker else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield


# jax 0.7 can abort at interpreter exit, in the clean-up it registers with
# atexit (clear_backends: "corrupted size vs. prev_size", seen after an
# equinox filter_jit step followed by another jitted step; later JAX does
# not). The tests skip that clean-up on 0.7, as the process ends anyway.
if jax.__version_info__ < (0, 8):
    import atexit

    from jax._src import api as _api

    atexit.unregister(_api.clean_up)

# Eight simulated CPU devices for the multi-device tests; this must run before
# JAX initialises its backends, which nothing has done at conftest import.
jax.config.update("jax_num_cpu_devices", 8)
