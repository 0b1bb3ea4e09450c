"""Tests for lossscale.Policy and get_policy (jmp-compatible policies).

The first part ports jmp's own ``jmp/_src/policy_test.py`` (jmp 0.0.4) case
by case, run against lossscale's policy; the rest covers what lossscale adds
or promises beyond it, and its agreement with ``jmp.get_policy``.
"""

import itertools
import pickle
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale
from lossscale import _policy

HALF_DTYPES = (np.float16, jnp.float16, jnp.bfloat16)
FULL_DTYPES = (np.float32, jnp.float32)
DTYPES = HALF_DTYPES + FULL_DTYPES
NUMPYS = (np, jnp)

# jmp's own names for the dtypes (jmp._src.policy.dtype_to_names).
DTYPE_TO_NAMES = {
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("full", "f32", "float32"),
    jnp.float64: ("f64", "float64"),
}


def get_dtype_name(dtype):
    names = {
        np.float16: "float16",
        jnp.bfloat16: "bfloat16",
        np.float32: "float32",
    }
    return names[dtype]


def current_platform():
    return jax.local_devices()[0].platform


def skip_if_unsupported(dtype):
    platform = current_platform()
    if (platform == "gpu" and dtype == jnp.bfloat16) or (
        platform == "tpu" and dtype in (np.float16, jnp.float16)
    ):
        pytest.skip(f"{get_dtype_name(dtype)} not supported on {platform}")


def assert_dtypes_equal(tree_a, tree_b):
    assert jax.tree.structure(tree_a) == jax.tree.structure(tree_b)
    for a, b in zip(
        jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True
    ):
        assert a.dtype == b.dtype


# --- jmp's policy_test.py, ported -----------------------------------------


PRODUCT = list(itertools.product(DTYPES, NUMPYS))


@pytest.mark.parametrize(("dtype", "np_"), PRODUCT)
def test_jmp_policy_cast_to_param(dtype, np_):
    skip_if_unsupported(dtype)
    policy = lossscale.Policy(dtype, dtype, dtype)
    assert policy.param_dtype == dtype
    tree = {"a": np_.ones([])}
    assert_dtypes_equal(policy.cast_to_param(tree), {"a": np_.ones([], dtype)})


@pytest.mark.parametrize(("dtype", "np_"), PRODUCT)
def test_jmp_policy_cast_to_compute(dtype, np_):
    skip_if_unsupported(dtype)
    policy = lossscale.Policy(dtype, dtype, dtype)
    assert policy.compute_dtype == dtype
    tree = {"a": np_.ones([])}
    assert_dtypes_equal(
        policy.cast_to_compute(tree), {"a": np_.ones([], dtype)}
    )


@pytest.mark.parametrize(("dtype", "np_"), PRODUCT)
def test_jmp_policy_cast_to_output(dtype, np_):
    skip_if_unsupported(dtype)
    policy = lossscale.Policy(dtype, dtype, dtype)
    assert policy.output_dtype == dtype
    tree = {"a": np_.ones([])}
    assert_dtypes_equal(policy.cast_to_output(tree), {"a": np_.ones([], dtype)})


@pytest.mark.parametrize(("dtype", "np_"), PRODUCT)
def test_jmp_policy_with_output_dtype(dtype, np_):
    policy = lossscale.Policy(np_.float32, np_.float32, np_.float32)
    policy = policy.with_output_dtype(dtype)
    assert policy.output_dtype == dtype


@pytest.mark.parametrize(
    ("dtype_name", "dtype"),
    [
        ("float16", np.float16),
        ("float32", np.float32),
        ("bfloat16", jnp.bfloat16),
    ],
)
def test_jmp_get_policy(dtype_name, dtype):
    policy = lossscale.get_policy(dtype_name)
    assert policy.param_dtype == dtype
    assert policy.compute_dtype == dtype
    assert policy.output_dtype == dtype


def test_jmp_get_policy_almost_dtype():
    # jmp's message starts "Unknown dtype"; lossscale's messages start in
    # lower case, as all of lossscale's do.
    with pytest.raises(ValueError, match=r"(?i)unknown dtype"):
        lossscale.get_policy("compute_float16")


@pytest.mark.parametrize(("dtype", "np_"), PRODUCT)
def test_jmp_get_policy_mixed(dtype, np_):
    full = np_.float32
    policy = lossscale.get_policy(f"c={get_dtype_name(dtype)}")
    assert policy.param_dtype == full
    assert policy.compute_dtype == dtype
    assert policy.output_dtype == dtype


@pytest.mark.parametrize(("dtype", "np_"), PRODUCT)
def test_jmp_get_policy_compute(dtype, np_):
    full = np_.float32
    policy = lossscale.get_policy(f"c={get_dtype_name(dtype)},o=full")
    assert policy.param_dtype == full
    assert policy.compute_dtype == dtype
    assert policy.output_dtype == full


def test_jmp_half_dtype():
    if current_platform() == "tpu":
        assert lossscale.half_dtype() == jnp.bfloat16
    else:
        assert lossscale.half_dtype() == jnp.float16


def test_jmp_cast_to_full():
    half_tree: dict[str, Any] = dict(
        o=object(),
        h=jnp.ones([], dtype=lossscale.half_dtype()),
        f=jnp.ones([]),
        i=jnp.ones([], dtype=jnp.int16),
    )
    full_tree = dict(
        o=half_tree["o"],
        h=half_tree["h"].astype(jnp.float32),
        f=half_tree["f"],
        i=half_tree["i"],
    )
    assert lossscale.cast_to_full(half_tree) == full_tree
    assert_dtypes_equal(
        {
            k: v
            for k, v in lossscale.cast_to_full(half_tree).items()
            if k != "o"
        },
        {k: v for k, v in full_tree.items() if k != "o"},
    )


@pytest.mark.standard_promotion  # jmp's == compares a float16 and a float32
def test_jmp_cast_to_half():
    dtype = lossscale.half_dtype()
    half_tree: dict[str, Any] = dict(
        o=object(),
        h=jnp.ones([], dtype=dtype),
        f=jnp.ones([]),
        i=jnp.ones([], dtype=jnp.int16),
    )
    full_tree = dict(
        o=half_tree["o"],
        h=half_tree["h"],
        f=half_tree["f"].astype(dtype),
        i=half_tree["i"],
    )
    assert lossscale.cast_to_half(full_tree) == half_tree
    out = lossscale.cast_to_half(full_tree)
    assert out["f"].dtype == dtype and out["i"].dtype == jnp.int16


@pytest.mark.parametrize("dtype", DTYPES)
def test_jmp_str(dtype):
    policy = lossscale.Policy(dtype, dtype, dtype)
    policy_str = str(policy)
    for str_piece in policy_str.split(","):
        dtype_str = str_piece.split("=")[1]
        assert dtype_str == DTYPE_TO_NAMES[np.dtype(dtype).type][0]


# --- agreement with jmp.get_policy ------------------------------------------

JMP_VALID = [
    "f16",
    "float16",
    "bf16",
    "bfloat16",
    "f32",
    "float32",
    "full",
    "f64",
    "float64",
    "half",
    "c=f16",
    "c=bf16",
    "c=half",
    "p=f32,c=bf16,o=f32",
    "p=f32,c=f16,o=f32",
    "params=float32,compute=bfloat16,output=float32",
    "p=f16,c=f16",
    "p=f16,c=bf16",
    "p=bf16",
    "o=f16",
    "c=f16,o=full",
    "o=bf16,p=f32",
    "compute=half,output=full",
    "p=half,c=half,o=half",
    "p=f64,c=f32",
    "p=full,c=bf16,o=full",
]


@pytest.mark.parametrize("spec", JMP_VALID)
def test_agrees_with_jmp(spec):
    jmp = pytest.importorskip("jmp")
    theirs = jmp.get_policy(spec)
    ours = lossscale.get_policy(spec)
    assert ours.param_dtype == np.dtype(theirs.param_dtype)
    assert ours.compute_dtype == np.dtype(theirs.compute_dtype)
    assert ours.output_dtype == np.dtype(theirs.output_dtype)
    # and our str() is one jmp parses to the same dtypes.
    again = jmp.get_policy(str(ours))
    assert np.dtype(again.compute_dtype) == ours.compute_dtype
    assert np.dtype(again.output_dtype) == ours.output_dtype


# --- round trips, equality, hashing --------------------------------------


ALL_SPECS = [
    "half",
    "c=half,o=f32",
    "mixed_float16",
    "mixed_bfloat16",
    *JMP_VALID,
]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_str_round_trips(spec):
    policy = lossscale.get_policy(spec)
    again = lossscale.get_policy(str(policy))
    assert again == policy
    assert hash(again) == hash(policy)
    assert eval(repr(policy), {"Policy": lossscale.Policy}) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_half_round_trips_as_half():
    policy = lossscale.get_policy("c=half")
    assert str(policy) == "p=full,c=half,o=half"
    # "half" is a policy of its own: equal to itself, not to the dtype it
    # resolves to here (which depends on the backend).
    assert policy != lossscale.get_policy(f"c={lossscale.half_dtype().name}")


def test_get_policy_of_a_policy_returns_it():
    policy = lossscale.get_policy("c=bf16")
    assert lossscale.get_policy(policy) is policy


def test_equality_by_value_and_dtype_spellings():
    a = lossscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    b = lossscale.Policy("f32", "bfloat16", np.dtype("float32"))
    c = lossscale.Policy(np.float32, "bf16", "full")
    assert a == b == c
    assert len({a, b, c}) == 1
    assert a != lossscale.Policy(jnp.float32, jnp.float16, jnp.float32)
    assert a != "p=f32,c=bf16,o=f32"  # a string is not a policy


def test_attributes_are_numpy_dtypes():
    policy = lossscale.get_policy("p=f32,c=bf16,o=f16")
    assert policy.param_dtype == np.dtype(jnp.float32)
    assert policy.compute_dtype == np.dtype(jnp.bfloat16)
    assert policy.output_dtype == np.dtype(jnp.float16)
    for dtype in (
        policy.param_dtype,
        policy.compute_dtype,
        policy.output_dtype,
    ):
        assert isinstance(dtype, np.dtype)


def test_immutable():
    policy = lossscale.get_policy("bf16")
    with pytest.raises(AttributeError, match="immutable"):
        policy.compute_dtype = jnp.float32  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        policy._specs = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        policy.extra = 1  # type: ignore[attr-defined]
    assert policy.compute_dtype == jnp.bfloat16


def test_with_output_dtype_returns_a_new_policy():
    policy = lossscale.get_policy("p=f32,c=bf16")
    out = policy.with_output_dtype("f32")
    assert out == lossscale.get_policy("p=f32,c=bf16,o=f32")
    assert policy.output_dtype == jnp.bfloat16
    assert str(policy.with_output_dtype("half")) == "p=full,c=bf16,o=half"


def test_static_jit_argument_without_retrace():
    traces = []

    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_output(policy.cast_to_compute(x) * 2)

    jf = jax.jit(f, static_argnums=1)
    x = jnp.ones(3)
    out = jf(x, lossscale.get_policy("p=f32,c=bf16,o=f32"))
    assert out.dtype == jnp.float32
    jf(x, lossscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32))  # equal
    jf(x, lossscale.get_policy("params = f32 , compute = bf16"))  # o -> bf16
    assert len(traces) == 2  # the third is a different policy: o=bf16
    assert jf(x, lossscale.get_policy("p=f32,c=bf16")).dtype == jnp.bfloat16
    assert len(traces) == 2


# --- grammar beyond jmp -----------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (" p = f32 , c = bf16 , o = f32 ", "p=f32,c=bf16,o=f32"),
        ("p=f32,c=bf16 ", "p=f32,c=bf16"),
        (" bf16 ", "bf16"),
        ("c= half", "c=half"),
        ("mixed_float16", "p=f32,c=f16,o=f16"),
        ("mixed_bfloat16", "p=f32,c=bf16,o=bf16"),
        (" mixed_bfloat16 ", "p=f32,c=bf16,o=bf16"),
    ],
)
def test_extensions(spec, expected):
    assert lossscale.get_policy(spec) == lossscale.get_policy(expected)


def test_keras_semantics():
    # Keras's mixed_float16: float32 variables, float16 compute, and layer
    # outputs in the compute dtype.
    policy = lossscale.get_policy("mixed_float16")
    assert policy.param_dtype == jnp.float32
    assert policy.compute_dtype == jnp.float16
    assert policy.output_dtype == jnp.float16


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("p=f32,x=f16", r"unknown key 'x'.*'p' or 'params'"),
        ("param=f32", r"unknown key 'param'.*'compute'"),
        ("p=f8", r"unknown dtype 'f8'.*'bf16'.*'half'"),
        ("float8", r"unknown dtype 'float8'"),
        ("", r"unknown dtype ''"),
        ("f32,bf16", r"unknown dtype 'f32,bf16'"),
        ("p=f32,", r"key=name, got ''"),
        ("p=f32=f16", r"key=name"),
        ("p=f32,c", r"key=name, got 'c'"),
        ("p=f32,params=f16", r"params dtype twice"),
        ("mixed_float32", r"unknown dtype 'mixed_float32'.*mixed_float16"),
        ("F32", r"unknown dtype 'F32'"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        lossscale.get_policy(spec)
    assert repr(spec) in str(info.value)


@pytest.mark.parametrize("bad", [None, 16, jnp.float32])
def test_get_policy_type_error(bad):
    with pytest.raises(TypeError, match="spec must be a policy string"):
        lossscale.get_policy(bad)


@pytest.mark.parametrize(
    "bad", [jnp.int32, "int8", "f8", object(), jnp.float8_e4m3fn]
)
def test_policy_bad_dtype(bad):
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        lossscale.Policy(jnp.float32, bad, jnp.float32)


# --- casting ------------------------------------------------------------


def test_casts_only_floating_arrays():
    policy = lossscale.get_policy("p=f32,c=bf16,o=f16")
    key = jax.random.key(0)
    raw_key = jax.random.PRNGKey(0)
    marker = object()
    tree = {
        "f32": jnp.ones(2),
        "f16": jnp.ones(2, jnp.float16),
        "np": np.ones(2, np.float32),
        "int": jnp.arange(3),
        "bool": jnp.array([True]),
        "key": key,
        "raw_key": raw_key,
        "py_float": 1.5,
        "py_int": 2,
        "np_scalar": np.float32(1.5),
        "complex": jnp.ones(2, jnp.complex64),
        "none": None,
        "obj": marker,
    }
    out = policy.cast_to_compute(tree)
    assert out["f32"].dtype == jnp.bfloat16
    assert out["f16"].dtype == jnp.bfloat16
    # numpy arrays are cast (as in jmp) and stay numpy arrays, on the host.
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == jnp.bfloat16
    for name in ("int", "bool", "key", "raw_key", "complex", "obj"):
        assert out[name] is tree[name], name
    assert out["py_float"] == 1.5 and type(out["py_float"]) is float
    assert out["py_int"] == 2 and type(out["py_int"]) is int
    assert out["np_scalar"] is tree["np_scalar"]
    assert out["none"] is None
    # The PRNG keys still work as keys.
    jax.random.normal(out["key"], ())
    assert policy.cast_to_output(tree)["f32"].dtype == jnp.float16
    assert policy.cast_to_param(out)["f32"].dtype == jnp.float32


def test_cast_of_the_same_dtype_returns_the_leaf():
    policy = lossscale.get_policy("f32")
    x = jnp.ones(2)
    assert policy.cast_to_compute({"x": x})["x"] is x


def test_cast_values_exact():
    policy = lossscale.get_policy("c=bf16")
    x = jnp.array([1.0, 3.0, 1.0 + 2.0**-10], jnp.float32)
    out = policy.cast_to_compute(x)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.array([1.0, 3.0, 1.0], np.float32)
    )


def test_cast_under_jit_and_strict_promotion():
    # Under strict promotion a float32 x bfloat16 product is an error; the
    # policy's casts make both sides bfloat16 and the output float32.
    policy = lossscale.get_policy("p=f32,c=bf16,o=f32")
    w = jnp.ones((3, 2), jnp.float32)
    x = jnp.ones((4, 3), jnp.bfloat16)
    with pytest.raises(Exception, match="promot"):
        jnp.dot(x, w)

    @jax.jit
    def apply(w, x):
        w, x = policy.cast_to_compute((w, x))
        return policy.cast_to_output(jnp.dot(x, w))

    out = apply(w, x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(out), np.full((4, 2), 3.0, np.float32)
    )


# --- half, resolved when used ---------------------------------------------


def _fake_tpu(monkeypatch):
    monkeypatch.setattr(
        jax,
        "local_devices",
        lambda *a, **k: [types.SimpleNamespace(platform="tpu")],
    )


def test_half_is_not_resolved_at_parse_time(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the backend was queried")

    monkeypatch.setattr(jax, "local_devices", boom)
    policy = lossscale.get_policy("p=f32,c=half")
    assert str(policy) == "p=full,c=half,o=half"
    assert policy == lossscale.Policy("f32", "half", "half")
    hash(policy)
    with pytest.raises(AssertionError, match="queried"):
        _ = policy.compute_dtype


def test_half_is_resolved_when_used(monkeypatch):
    policy = lossscale.get_policy("c=half")
    x = jnp.ones(2)
    assert policy.compute_dtype == jnp.float16  # this test runs on CPU
    assert policy.cast_to_compute(x).dtype == jnp.float16
    _fake_tpu(monkeypatch)
    assert lossscale.half_dtype() == jnp.bfloat16
    assert policy.compute_dtype == jnp.bfloat16
    assert policy.output_dtype == jnp.bfloat16
    assert policy.param_dtype == jnp.float32
    assert policy.cast_to_compute(x).dtype == jnp.bfloat16
    assert lossscale.cast_to_half(x).dtype == jnp.bfloat16


def test_half_dtype_is_a_numpy_dtype():
    assert isinstance(lossscale.half_dtype(), np.dtype)
    assert _policy.half_dtype() == lossscale.half_dtype()
