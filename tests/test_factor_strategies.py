"""enumerate_strategies: rules that differ only in sizes that split alike share one list, equal
to the list enumerated from each rule's own sizes (the enumeration before the sharing)."""

import itertools

import pytest

from jaxpar._src.rules.factors import RuleBuilder, enumerate_strategies, specs_for
from jaxpar._src.spec import MeshShape


def _reference(rule, mesh):
    """The enumeration from the rule's own sizes, one strategy at a time (as before)."""
    choices = rule.splittable()
    seen, out = set(), []
    for pick in itertools.product(*[(None,) + choices for _ in mesh.names]):
        groups = {}
        for axis, f in zip(mesh.names, pick, strict=True):
            if f is not None:
                groups.setdefault(f, []).append(axis)
        if any(rule.sizes[f] % mesh.product(axes) for f, axes in groups.items()):
            continue
        multi = [f for f, axes in groups.items() if len(axes) > 1]
        for combo in itertools.product(*[list(itertools.permutations(groups[f]))
                                         for f in multi]):
            assign = {f: tuple(axes) for f, axes in groups.items()}
            assign.update(zip(multi, combo, strict=True))
            key = tuple(assign.get(f, ()) for f in range(len(rule.sizes)))
            if key not in seen:
                seen.add(key)
                out.append(specs_for(rule, key))
    out.sort(key=lambda s: s.axes_used)
    return tuple(out)


def _matmul(m, k, n, flops=0.0):
    b = RuleBuilder()
    fm, fk, fn = b.factor(m), b.factor(k), b.factor(n)
    return b.build([[fm, fk], [fk, fn]], [[fm, fn]], reductions={fk: "sum"}, flops=flops)


def _reshape(rows, cols):  # one dimension of two factors: only the major one splits
    b = RuleBuilder()
    r, c = b.factor(rows), b.factor(cols)
    return b.build([[r, c]], [[(r, c)]])


MESHES = [MeshShape(("dp", "mp"), (2, 4)), MeshShape(("x",), (8,)),
          MeshShape(("a", "b", "c"), (2, 2, 2)), MeshShape(("dp", "mp"), (3, 2))]
SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48, 64, 96]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_list_equals_the_enumeration_from_the_rules_own_sizes(mesh):
    for m, k, n in itertools.product(SIZES, SIZES[::3], SIZES[1::4]):
        rule = _matmul(m, k, n, flops=2.0 * m * k * n)
        assert enumerate_strategies(rule, mesh) == _reference(rule, mesh), (m, k, n)
    for rows, cols in itertools.product(SIZES, SIZES):
        rule = _reshape(rows, cols)
        assert enumerate_strategies(rule, mesh) == _reference(rule, mesh), (rows, cols)


def test_rules_that_split_alike_share_one_list_and_others_do_not():
    mesh = MeshShape(("dp", "mp"), (2, 4))
    # 16 and 48 have the same divisors among 1, 2, 4, 8 (gcd 8 with the 8 devices)
    a, b = _matmul(16, 64, 32, flops=1.0), _matmul(48, 64, 96, flops=2.0)
    assert a != b and enumerate_strategies(a, mesh) is enumerate_strategies(b, mesh)
    c = _matmul(12, 64, 32)  # 12: not a multiple of 8
    assert enumerate_strategies(c, mesh) != enumerate_strategies(a, mesh)
    assert len(enumerate_strategies(c, mesh)) < len(enumerate_strategies(a, mesh))
