"""HiGHS, the solver of :mod:`jaxpar._src.search.optimal`'s linear and integer programs, called
through its own Python binding ``highspy``.

``scipy.optimize.milp`` wraps the same solver, but importing ``scipy.optimize`` costs 0.4-0.6 s
of CPU in a fresh process (``highspy``: 0.02-0.05 s), and the plan phase of a first call paid
it.  The programs are handed over as scipy handed them: columns (variables) with costs and
bounds, a column-wise (CSC) constraint matrix with row bounds, one fresh solver per solve, the
same options (a time limit, a relative MIP gap of 1e-6, presolve off for relaxations) and the
logging off (``output_flag``: no banner, no log).  ``highspy`` is imported on the first solve,
not with jaxpar: processes that never solve (Ray actors, launched ranks) do not pay for it.

>>> import numpy as np
>>> # min -x0 - 2 x1  s.t.  x0 + x1 <= 1.5,  x binary
>>> m = Model.from_triplets(np.array([-1.0, -2.0]), rows=np.array([0, 0]),
...                         cols=np.array([0, 1]), values=np.array([1.0, 1.0]),
...                         row_lower=np.array([-np.inf]), row_upper=np.array([1.5]),
...                         lower=np.zeros(2), upper=np.ones(2))
>>> relaxed = solve(m, integer=None, time_limit=10.0)
>>> relaxed.optimal, relaxed.x.tolist(), relaxed.objective
(True, [0.5, 1.0], -2.5)
>>> exact = solve(m, integer=np.ones(2, dtype=bool), time_limit=10.0)
>>> exact.optimal, exact.x.tolist(), exact.objective
(True, [0.0, 1.0], -2.0)
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIP_REL_GAP = 1e-6  # branch and bound stops this close (relative) to its best bound


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Model:
    """A linear program ``min cost . x  s.t.  row_lower <= A x <= row_upper,
    lower <= x <= upper``, with ``A`` column-wise: column ``j``'s row indices (ascending) and
    values are ``index[start[j]:start[j + 1]]`` and ``value[...]``."""

    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    start: np.ndarray  # int32, one more than columns
    index: np.ndarray  # int32
    value: np.ndarray

    @staticmethod
    def from_triplets(cost: np.ndarray, *, rows: np.ndarray, cols: np.ndarray,
                      values: np.ndarray, row_lower: np.ndarray, row_upper: np.ndarray,
                      lower: np.ndarray, upper: np.ndarray) -> Model:
        """The model whose matrix has ``values[i]`` at ``(rows[i], cols[i])``: no (row, column)
        may appear twice (HiGHS refuses a duplicate entry; the programs here have none)."""
        n, m = len(cost), len(row_lower)
        # Column-major order, rows ascending within a column: the order scipy's CSC matrix
        # gave HiGHS (the simplex's pivots, hence ties between equal optima, follow it).
        order = np.argsort(cols.astype(np.int64) * max(m, 1) + rows, kind="stable")
        start = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.bincount(cols, minlength=n), out=start[1:])
        return Model(np.ascontiguousarray(cost, dtype=np.float64),
                     np.ascontiguousarray(lower, dtype=np.float64),
                     np.ascontiguousarray(upper, dtype=np.float64),
                     np.ascontiguousarray(row_lower, dtype=np.float64),
                     np.ascontiguousarray(row_upper, dtype=np.float64),
                     start, rows[order].astype(np.int32),
                     np.ascontiguousarray(values[order], dtype=np.float64))


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Solution:
    """What a solve found: ``x`` (None: no solution), whether it is proven optimal, its
    objective, branch and bound's proven lower bound (integer programs; None otherwise) and
    HiGHS's word on the model's status."""

    x: np.ndarray | None
    optimal: bool
    objective: float | None
    dual_bound: float | None
    message: str


def solve(model: Model, *, integer: np.ndarray | None, time_limit: float) -> Solution:
    """Solves ``model``, as an integer program over the columns ``integer`` marks (a boolean
    mask) or, when it is None, as a linear program without presolve (the relaxation's vertex
    is what its caller wants, and presolve would move it).  An integer program stopped by its
    time limit still returns the best solution found (``optimal`` false)."""
    # Imported here, not at the top: see the module's docstring.  The binding's own class, not
    # highspy.Highs: that one prints HiGHS's banner when made, before any option can be set.
    import highspy
    from highspy._core import _Highs

    h = _Highs()
    for name, value in (("output_flag", False), ("time_limit", float(time_limit)),
                        ("mip_rel_gap", MIP_REL_GAP),
                        ("presolve", "choose" if integer is not None else "off")):
        h.setOptionValue(name, value)
    n = len(model.cost)
    kinds = np.zeros(n, dtype=np.int32) if integer is None else integer.astype(np.int32)
    h.passModel(n, len(model.row_lower), len(model.value), int(highspy.MatrixFormat.kColwise),
                int(highspy.ObjSense.kMinimize), 0.0, model.cost, model.lower, model.upper,
                model.row_lower, model.row_upper, model.start, model.index, model.value, kinds)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    ok = highspy.HighsModelStatus.kOptimal
    limits = (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kIterationLimit,
              highspy.HighsModelStatus.kSolutionLimit)
    found = status == ok or (integer is not None and status in limits
                             and info.objective_function_value != highspy.kHighsInf)
    message = f"HiGHS model status: {h.modelStatusToString(status)}"
    if not found:
        return Solution(None, False, None, None, message)
    return Solution(np.array(h.getSolution().col_value), status == ok,
                    float(info.objective_function_value),
                    float(info.mip_dual_bound) if integer is not None else None, message)
