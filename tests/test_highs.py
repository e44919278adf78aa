"""HiGHS called through highspy (search/highs.py): known answers of small linear and integer
programs, the time-limit and infeasible paths, the column-wise matrix, a silent solver, and a
first parallelized call that solves with HiGHS without importing scipy."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxpar._src.errors import PlanError
from jaxpar._src.search import highs, optimal
from jaxpar._src.search.problem import Problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _knapsack(row_lower=(-np.inf,) * 3) -> highs.Model:
    """max 5a + 4b + 3c  s.t.  2a + 3b + c <= 5,  4a + b + 2c <= 11,  3a + 4b + 2c <= 8."""
    a = np.array([[2.0, 3.0, 1.0], [4.0, 1.0, 2.0], [3.0, 4.0, 2.0]])
    r, k = np.nonzero(a)
    return highs.Model.from_triplets(-np.array([5.0, 4.0, 3.0]), rows=r, cols=k, values=a[r, k],
                                     row_lower=np.array(row_lower),
                                     row_upper=np.array([5.0, 11.0, 8.0]),
                                     lower=np.zeros(3), upper=np.ones(3))


def test_known_answers_of_a_relaxation_and_its_integer_program():
    model = _knapsack()
    relaxed = highs.solve(model, integer=None, time_limit=10.0)
    # the relaxation fills the first row with b at 2/3: 5 + 4 * 2/3 + 3
    assert relaxed.optimal and relaxed.dual_bound is None
    np.testing.assert_allclose(relaxed.x, [1.0, 2.0 / 3.0, 1.0], atol=1e-9)
    assert relaxed.objective == pytest.approx(-32.0 / 3.0)
    exact = highs.solve(model, integer=np.ones(3, dtype=bool), time_limit=10.0)
    # {a, b} = 9 beats {a, c} = 8 and {b, c} = 7; {a, b, c} breaks the first row
    assert exact.optimal
    np.testing.assert_allclose(exact.x, [1.0, 1.0, 0.0], atol=1e-9)
    assert exact.objective == pytest.approx(-9.0) and exact.dual_bound == pytest.approx(-9.0)
    # only b integral: b = 0 leaves 5 + 3 = 8; b = 1 leaves 2a + c <= 2, 3a + 2c <= 4, whose
    # best is a = 1/2, c = 1: 4 + 2.5 + 3 = 9.5
    mixed = highs.solve(model, integer=np.array([False, True, False]), time_limit=10.0)
    assert mixed.optimal and mixed.objective == pytest.approx(-9.5)
    np.testing.assert_allclose(mixed.x, [0.5, 1.0, 1.0], atol=1e-9)


@pytest.mark.parametrize("integer", [None, np.ones(3, dtype=bool)])
def test_no_solution_says_why(integer):
    # 2a + 3b + c = 6 needs a = b = c = 1, which breaks the third row
    infeasible = highs.solve(_knapsack((6.0, 0.0, 0.0)), integer=integer, time_limit=10.0)
    assert infeasible.x is None and not infeasible.optimal and infeasible.objective is None
    assert "Infeasible" in infeasible.message
    timed_out = highs.solve(_knapsack(), integer=integer, time_limit=0.0)
    assert timed_out.x is None and not timed_out.optimal
    assert "Time limit" in timed_out.message


def test_optimal_search_out_of_time_raises_plan_error_naming_the_status():
    costs = {0: np.array([1.0, 3.0]), 1: np.array([3.0, 1.0])}
    problem = Problem.from_tables(costs, {(0, 1): np.array([[0.0, 1.0], [1.0, 0.0]])})
    # (0, 0): 1 + 3, (0, 1): 1 + 1 + 1 (the edge), (1, 0): 3 + 3 + 1, (1, 1): 3 + 1
    solved = optimal.solve_optimal(problem)
    assert solved.optimal and solved.choice == {0: 0, 1: 1}
    assert solved.objective == pytest.approx(3.0)
    with pytest.raises(PlanError, match="found no solution.*Time limit"):
        optimal.solve_optimal(problem, time_limit=0.0)


def test_matrix_is_column_wise_with_rows_ascending():
    rng = np.random.default_rng(0)
    dense = np.where(rng.uniform(size=(7, 5)) < 0.4, rng.uniform(1, 2, (7, 5)), 0.0)
    r, k = np.nonzero(dense)
    shuffle = rng.permutation(len(r))
    model = highs.Model.from_triplets(np.zeros(5), rows=r[shuffle], cols=k[shuffle],
                                      values=dense[r, k][shuffle], row_lower=np.zeros(7),
                                      row_upper=np.ones(7), lower=np.zeros(5),
                                      upper=np.ones(5))
    assert model.start.tolist() == [0, *np.cumsum((dense != 0).sum(axis=0)).tolist()]
    rebuilt = np.zeros_like(dense)
    for j in range(5):
        rows = model.index[model.start[j]:model.start[j + 1]]
        assert np.all(np.diff(rows) > 0)
        rebuilt[rows, j] = model.value[model.start[j]:model.start[j + 1]]
    np.testing.assert_array_equal(rebuilt, dense)


def test_the_solver_prints_nothing(capfd):
    highs.solve(_knapsack(), integer=np.ones(3, dtype=bool), time_limit=10.0)
    highs.solve(_knapsack(), integer=None, time_limit=10.0)
    out, err = capfd.readouterr()  # the file descriptors: HiGHS writes from C++
    assert out == "" and err == ""


def test_a_first_parallelized_call_solves_with_highs_and_never_imports_scipy():
    script = textwrap.dedent("""
        import sys
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        import jaxpar
        from jaxpar._src.search import highs
        assert "highspy" not in sys.modules  # imported on the first solve only
        solves = []
        real = highs.solve
        highs.solve = lambda *a, **k: solves.append(1) or real(*a, **k)

        def fn(x, w):  # values used thrice: a graph the exact eliminations leave a core of
            h1 = x @ w
            h2 = jax.numpy.tanh(h1) @ w
            return jax.numpy.sum(h1 * h2 * ((h1 * h2) @ w))

        mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
        args = (jax.numpy.ones((16, 32)), jax.numpy.ones((32, 32)))
        jax.block_until_ready(jaxpar.parallelize(fn, mesh=mesh, parallel_mode="auto_parallel")(
            *args))
        scipy = sorted(m for m in sys.modules if m == "scipy" or m.startswith("scipy."))
        print(len(solves), "highspy" in sys.modules, scipy)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    solves, imported, scipy = out.stdout.split(maxsplit=2)
    assert int(solves) >= 1 and imported == "True" and scipy.strip() == "[]"
