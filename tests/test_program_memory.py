"""``plan.memory_bytes`` against what XLA compiles (``jaxpar/_src/program_memory.py``).

A small GPT train step (``examples/gpt.py``, Adam) in data parallel on 8 devices, with the
parallel optimizer off and at levels 1 and 3 (issue 11): the predicted memory per device is
within 17% of ``compiled.memory_analysis()``'s total (arguments + outputs - aliased +
temporaries) at every level, and orders the levels as the compiled programs do.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import jaxpar

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import gpt  # noqa: E402

# Reached on this model: off +4%, level 1 -9%, level 3 -16% (on bench/zero.py's larger GPT,
# 2 and 4 layers of d 128: within 9% at every level; README).  Level 3 was -11% while its
# gradients were all-reduced: reduce-scattering them leaves the compiled total where it was
# (1.600 MB against 1.592) but lowers the model's by 65 KB (each whole local sum counted as a
# temporary of its contraction alone): XLA keeps more of them alive than that.
TOLERANCE = 0.17


@pytest.fixture(scope="module")
def measured():
    cfg = gpt.GPTConfig(layers=2, d_model=64, ff=256, seq=32, annotate=False)
    step, params, opt_state = gpt.make_train_step(cfg)
    batch = np.asarray(next(gpt.batches(gpt.corpus(), 16, cfg.seq)))
    args = (params, opt_state, batch)
    mesh = jaxpar.make_mesh((8,), ("dp",))
    out = {}
    for level in (0, 1, 3):
        options = {} if level == 0 else dict(
            enable_parallel_optimizer=True,
            parallel_optimizer_config={"optimizer_level": f"level{level}",
                                       "parallel_optimizer_threshold": 0})
        with jaxpar.auto_parallel_context(**options):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            predicted = f.plan(*args).memory_bytes
            compiled = jaxpar.inspect.memory(f.lower(*args).compile())["total"]
        out[level] = (predicted, compiled)
    return out


@pytest.mark.parametrize("level", (0, 1, 3))
def test_predicted_memory_tracks_the_compiled_total(measured, level):
    predicted, compiled = measured[level]
    assert abs(predicted / compiled - 1) <= TOLERANCE, (level, predicted, compiled)


def test_predicted_memory_orders_the_levels_as_compiled(measured):
    predicted = [measured[level][0] for level in (0, 1, 3)]
    compiled = [measured[level][1] for level in (0, 1, 3)]
    assert compiled[0] > compiled[1] > compiled[2], compiled
    assert predicted[0] > predicted[1] > predicted[2], predicted
