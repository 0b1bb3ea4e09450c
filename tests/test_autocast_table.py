"""autocast's rules kept the way JAX keeps its own (issue 32): one record
per primitive keyed on the ``Primitive`` objects, a table per pass that
the higher-order handlers register into, and modules that import only
those below them."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.extend.core import primitives

import lossscale
from lossscale import _compat
from lossscale._autocast import _emit, _equation, _handlers
from lossscale._autocast import _rules as R

PACKAGE = pathlib.Path(lossscale.__file__).parent / "_autocast"

# Each module of the package imports only modules before it here (the
# order the package's docstring gives).
LAYERS = [
    ["_classes", "_rules", "_recipes"],
    ["_cast", "_config", "_float8", "_fold"],
    ["_scaling"],
    ["_fp8", "_islands", "_weights"],
    ["_plan"],
    ["_matmul"],
    ["_equation"],
    ["_infer"],
    ["_emit"],
    ["_higher"],
    ["_control"],
    ["_handlers"],
    ["_run"],
    ["_eager"],
    ["_api", "_report"],
    ["__init__"],
]


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "lossscale._autocast":
                found.update(a.name for a in node.names)
            elif node.module.startswith("lossscale._autocast."):
                found.add(node.module.rsplit(".", 1)[1])
    return found


def test_no_module_of_the_package_imports_one_above_it():
    floor = {m: k for k, layer in enumerate(LAYERS) for m in layer}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(floor)  # every module has its place
    for name in modules:
        for target in _imports(PACKAGE / f"{name}.py"):
            assert floor[target] < floor[name], (name, target)


def test_the_layering_check_sees_an_import_cycle(tmp_path):
    # The negative control: an import of a higher module is found.
    path = tmp_path / "_infer.py"
    path.write_text("from lossscale._autocast import _higher\n")
    assert _imports(path) == {"_higher"}


def test_records_are_keyed_on_the_primitives_jax_binds():
    assert R.TABLE[lax.add_p] is R.RECORDS["add"]
    assert R.TABLE[primitives.dot_general_p].kind is R.Kind.MATMUL
    assert R.TABLE[primitives.exp_p].remat
    assert R.TABLE[primitives.reduce_window_max_p].pooling
    assert R.TABLE[primitives.psum_p].collective
    (name_p,) = _compat.primitives_named(["name"]).values()  # not in 0.7's
    assert not R.TABLE[name_p].island
    assert all(not isinstance(k, str) for k in R.TABLE)
    # The public table is the records' rules, by name.
    assert {
        n: r.kind.rule for n, r in R.RECORDS.items()
    } == lossscale.AUTOCAST_RULES
    assert lossscale.AUTOCAST_RULES["dot_general"] == "compute"
    assert lossscale.AUTOCAST_RULES["tanh"] == "compute"  # bounded


def test_each_pass_owns_its_table_and_the_handlers_fill_both():
    assert set(_equation.KINDS) == set(R.Kind)
    assert set(_equation.HIGHER) == set(_emit.HIGHER)
    names = {p.name for p in _equation.HIGHER}
    assert {"scan", "while", "cond", "custom_jvp_call", "shard_map"} <= names
    assert names <= _handlers.HANDLED
    islands = {p.name for p, h in _equation.HIGHER.items() if h.island}
    assert islands == {"jit", "pjit", "custom_jvp_call"} & names


def test_a_users_rule_is_resolved_to_the_primitive_once():
    f = lossscale.autocast(lambda x: jnp.tanh(x), rules={"tanh": "float32"})
    config = f._config
    record, override = config.record(lax.tanh_p)
    assert override == "tanh" and record.kind is R.Kind.FLOAT32
    assert config.record(lax.tanh_p)[0] is record  # resolved once
    # A primitive this JAX does not list is matched by name.
    g = lossscale.autocast(lambda x: x, rules={"no_such_primitive": "float32"})
    fake = type("P", (), {"name": "no_such_primitive"})()
    assert g._config.record(fake)[1] == "no_such_primitive"


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ({"conv_general_dilated": "float8"}, "only dot_general"),
        ({"dot_general": "float8"}, "needs a float8 recipe"),
    ],
)
def test_a_float8_rule_where_none_can_apply_is_refused(rules, match):
    with pytest.raises(ValueError, match=match):
        lossscale.autocast(lambda x: x, jnp.bfloat16, rules=rules)


def test_the_programs_casts_have_a_record_and_take_no_rule():
    # convert_element_type is a record of its own kind (the program's own
    # cast, kept: "original" in the public table), read like any other.
    (convert_p,) = _compat.primitives_named(["convert_element_type"]).values()
    assert R.TABLE[convert_p].kind is R.Kind.CONVERT
    assert R.TABLE[convert_p].keeps_nothing
    assert lossscale.AUTOCAST_RULES["convert_element_type"] == "original"
    # A rule for it was accepted and ignored, and warned that it matched
    # nothing although the program casts: now refused, naming the key.
    with pytest.raises(ValueError, match="convert_element_type"):
        lossscale.autocast(
            lambda x: x.astype(jnp.float32),
            rules={"convert_element_type": "float32"},
        )
    # The cast is kept as the program wrote it: the product ends float16,
    # not in the compute dtype (the product is rounded once, from its
    # float32 accumulator).
    f = lossscale.autocast(lambda x, w: (x @ w).astype(jnp.float16))
    x = jnp.ones((4, 4))
    casts = [
        (e.invars[0].aval.dtype, e.outvars[0].aval.dtype)
        for e in jax.make_jaxpr(f)(x, x).eqns
        if e.primitive.name == "convert_element_type"
    ]
    assert casts and all(out == jnp.float16 for _, out in casts)
    assert f(x, x).dtype == jnp.float16
