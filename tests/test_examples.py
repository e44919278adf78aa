"""The examples and the demo run end to end (small sizes), as users would start them."""

import os
import re
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from tests.util import FAST_COMPILE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = "gpt_semi_auto.py"  # run once, by the demo's test below, which checks what it prints
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples"))
                  if f.endswith(".py") and f not in ("gpt.py", DEMO))


def run_example(script, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_FLAGS}")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stdout


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs_with_smoke_flag(script):
    run_example(script, "--smoke")


def test_demo_plan_collectives_and_loss_going_down():
    """The demo started as a user starts it (a fresh process; 12 steps of one layer, not
    ``make demo``'s 60 of two): what it prints."""
    out = run_example(DEMO, "--steps", "12", "--layers", "1")
    first, last = map(float, re.search(r"loss: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert last < first - 0.5
    table = out.split("Collectives XLA inserted (per training step):\n")[1].split("\n\n")[0]
    rows = [line.split() for line in table.splitlines()[1:]]  # kind, count, group, axes, ...
    # Megatron per layer: attention and MLP outputs all-reduced over mp; gradients over dp
    assert {row[3] for row in rows} == {"mp", "dp"}, table
    assert sum(int(row[1]) for row in rows if row[0] == "all-gather") <= 1, table
    layouts = dict(re.findall(r"^  (params\.\S+) +(\S.*)$", out, re.M))  # name, spec
    assert layouts["params.blocks.0.mlp.fc1.kernel.value"] == str(P(None, "mp"))
    assert layouts["params.blocks.0.mlp.fc2.kernel.value"] == str(P("mp"))


def test_gpt_3d_search_chooses_the_three_kinds_and_the_optimizer_level():
    """``examples/gpt_3d.py``'s default plan (``--plan-only``: the search, no compile or
    training; the smoke run above and ``tests/test_pipeline_groups.py`` check its numerics):
    on (dp, tp, pp) = (2, 2, 2) the search itself cuts the pipeline, splits stage weights
    over ``tp``, puts the batch's rows on ``dp``, and under the 85 MiB budget, which the
    parallel optimizer off does not fit, chooses its level."""
    out = run_example("gpt_3d.py", "--plan-only")
    chose = out.split("what the search chose, kind by kind:\n")[1]
    assert re.search(r"pipeline \(pp\): 4 layers cut \[2, 2\] into 2 stages \(balanced", chose)
    on_tp = int(re.search(r"operator \(tp\): (\d+) of 12 stage weights split over tp", chose)[1])
    weights = re.findall(r"^    (\S+): (P\(.*\))$", chose, re.M)
    assert on_tp >= 1 and len(weights) == on_tp, chose
    assert all("'tp'" in spec for _, spec in weights), chose
    assert re.search(r"data \(dp\): inputs and targets P\(\(?'dp'", chose), chose  # rows on dp
    assert re.search(r"parallel optimizer: level[13] chosen \([\d.]+ MiB predicted per device, "
                     r"budget 85\.00 MiB; tried off: no plan fits", chose), chose
