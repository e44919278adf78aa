"""Users' rules: the README's example, categories, and registering a primitive again."""

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar._src.rules.registry import _RULES
from tests.util import assert_tree_close

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _readme_block() -> str:
    text = README.read_text()
    match = re.search(r"<!-- tests/test_register_rule.py runs this block -->\n```python\n"
                      r"(.*?)```", text, re.S)
    assert match, "the README's register_rule example is gone"
    return match.group(1)


@pytest.fixture
def restore_rules():
    saved = dict(_RULES)
    yield
    _RULES.clear()
    _RULES.update(saved)


def test_readme_rule_for_a_new_matrix_product_is_split_as_a_contraction(restore_rules, capsys):
    code = _readme_block()
    scope = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), scope)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # running the cell again replaces the rule silently
        exec(compile(code, "README.md", "exec"), scope)
    assert "my_matmul" in capsys.readouterr().out
    plan, step = scope["plan"], scope["step"]
    (d,) = plan.ops("my_matmul")
    assert d.category == "contraction"
    used = {a for spec in d.in_specs + d.out_specs for dim in spec.dims for a in dim}
    assert used == {"dp", "mp"}, d.strategy_str()  # fully_use_devices: every device
    x = jax.random.normal(jax.random.key(0), (64, 256))
    w = jax.random.normal(jax.random.key(1), (256, 512)) / 16
    assert_tree_close(step(x, w), jnp.tanh(x @ w), rtol=1e-5, atol=1e-5)


def test_replacing_another_functions_rule_warns_once(restore_rules):
    def first(op):
        return jaxpar.RuleBuilder().build([[None] * len(s) for s in op.in_shapes],
                                          [[None] * len(s) for s in op.out_shapes])

    def second(op):
        return first(op)

    jaxpar.register_rule("jaxpar_test_prim")(first)
    with pytest.warns(jaxpar.JaxparWarning, match="'jaxpar_test_prim'.*is replaced by"):
        jaxpar.register_rule("jaxpar_test_prim")(second)
    assert _RULES["jaxpar_test_prim"][0] is second


def test_an_unknown_category_is_refused():
    with pytest.raises(jaxpar.StrategyError, match="category 'matmul' is not one of"):
        jaxpar.register_rule("jaxpar_test_prim", category="matmul")
