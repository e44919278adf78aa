"""Plan reports: every compiled collective with its cause, the page in a real browser, diffs."""

import html
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.report.causes import PREDICTED, XLA_OWN, analyse
from jaxpar._src.report.context import node_contexts
from tests import browser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build")
GPT_FILE = os.path.join(ROOT, "examples", "gpt.py")


@pytest.fixture(scope="module")
def gpt_run():
    """The demo GPT (examples/gpt.py, 2 layers) in semi-automatic mode, compiled and reported."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import gpt
    finally:
        sys.path.pop(0)
    cfg = gpt.GPTConfig(layers=2)
    train_step, params, opt_state = gpt.make_train_step(cfg)
    batch = next(gpt.batches(gpt.corpus(), 16, cfg.seq))
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step = jaxpar.parallelize(train_step, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=(None, None, (2, 1)))
    args = (params, opt_state, batch)
    compiled = step.lower(*args).compile()
    plan = step.plan(*args)
    report = plan.report(compiled=compiled, title="demo GPT")
    return plan, compiled, report


def _model_line(location: str) -> int:
    m = re.fullmatch(r"(?:near )?(.*examples/gpt\.py):(\d+) \(.*\)", location)
    assert m is not None, f"{location!r} is not a line of examples/gpt.py"
    return int(m.group(2))


def test_every_gpt_collective_is_caused_by_a_model_line(gpt_run):
    plan, compiled, report = gpt_run
    hlo_names = {r.name for r in jaxpar.inspect.collectives(compiled)}
    found = report.analysis.collectives
    assert {c.record.name for c in found} == hlo_names and hlo_names
    contexts = node_contexts(plan)
    with open(GPT_FILE) as f:
        source = f.read().splitlines()
    for c in found:
        assert c.status == PREDICTED, c  # the Megatron plan prices every one of them
        assert c.causes, c
        for cause in c.causes:
            line = _model_line(contexts[cause.node].location)
            assert source[line - 1].strip(), (cause, line)
        if c.record.kind == "all-reduce" and c.record.axes == ("mp",):
            # Megatron: the partial sums of the row-parallel projections
            assert {x.operator for x in c.causes} == {"dot_general"}
            assert all(x.reason == "partial sums" for x in c.causes)
            assert all(re.search(r"\((Attention|MLP)\.__call__\)", contexts[x.node].location)
                       for x in c.causes)
    assert not report.analysis.absent or all(x.predicted for x in report.analysis.absent)


def test_gpt_nodes_know_their_layer_and_module(gpt_run):
    plan, _, _ = gpt_run
    contexts = node_contexts(plan)
    dots = [(contexts[d.node].layer, contexts[d.node].module) for d in plan.ops("dot_general")]
    assert {layer for layer, _ in dots} >= {"blocks.0", "blocks.1"}
    assert any(module[-2:] == ("Attention", "Linear") for _, module in dots)
    assert sum(contexts[d.node].backward for d in plan.ops("dot_general")) > len(dots) / 3


def _rows(dom: str) -> dict[str, tuple[str, str]]:
    """``{instruction: (status, cause text)}`` of the page's collectives table."""
    out = {}
    pattern = r'<tr data-hlo="([^"]+)" data-status="([^"]+)">(.*?)</tr>'
    for name, status, body in re.findall(pattern, dom, flags=re.S):
        cause = re.search(r'<td class="cause">(.*)</td>', body, flags=re.S)
        text = re.sub(r"<[^>]+>", " ", cause.group(1)) if cause else ""
        out[html.unescape(name)] = (html.unescape(status), " ".join(html.unescape(text).split()))
    return out


_EXERCISE = """<script>
window.addEventListener('load', function () {
  var root = document.querySelector('.jxr'), out = [];
  var mode = root.querySelector('select.jxr-mode');
  ['layer', 'loc', 'module', 'op'].forEach(function (m) {
    mode.value = m; mode.dispatchEvent(new Event('change'));
    out.push(m + ':' + root.querySelectorAll('.jxr-tree > details').length);
  });
  mode.value = 'layer'; mode.dispatchEvent(new Event('change'));
  root.querySelectorAll('.jxr-tree details').forEach(function (d) { d.open = true; });
  setTimeout(function () {
    var rows = root.querySelectorAll('tr[data-n]');
    out.push('rows:' + rows.length);
    if (rows.length) rows[rows.length - 1].click();
    out.push('grids:' + root.querySelectorAll('tr.jxr-grids svg').length);
    document.documentElement.setAttribute('data-exercise', out.join(' '));
  }, 300);
});
</script>"""


def test_report_opens_in_chromium_with_every_collective_and_its_cause(gpt_run):
    browser.chromium()
    plan, compiled, report = gpt_run
    os.makedirs(BUILD, exist_ok=True)
    path = report.save(os.path.join(BUILD, "report_gpt.html"))
    assert os.path.getsize(path) < 2 * 2**20
    page = browser.load(path)
    assert 'data-ready="1"' in page.dom, page.stderr[-2000:]
    assert not re.search(r"<html[^>]*data-js-errors", page.dom), page.dom[:300]
    assert page.console == (), page.console
    rows = _rows(page.dom)
    for record in jaxpar.inspect.collectives(compiled):
        status, cause = rows[record.name]
        assert status == PREDICTED and "examples/gpt.py:" in cause, (record.name, cause)
    for section in ("summary", "collectives", "compare", "timeline", "layouts", "graph"):
        assert f'data-section="{section}"' in page.dom
    browser.screenshot(path, os.path.join(BUILD, "report_gpt.png"))
    # the operator graph: every grouping draws groups; opened groups draw rows; a click, grids
    exercised = os.path.join(BUILD, "report_gpt_exercised.html")
    with open(exercised, "w") as f:
        f.write(report.html.replace("</body>", _EXERCISE + "</body>"))
    page = browser.load(exercised)
    m = re.search(r'data-exercise="([^"]*)"', page.dom)
    assert m is not None and page.console == (), page.stderr[-2000:]
    counts = dict(part.split(":") for part in m.group(1).split())
    assert int(counts["layer"]) == 3  # blocks.0, blocks.1, outside layers
    assert int(counts["loc"]) > 10 and int(counts["module"]) >= 1 and int(counts["op"]) > 5
    assert int(counts["rows"]) == len(plan.decisions)
    assert int(counts["grids"]) >= 1


def _megatron_step(train: bool = True):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))

    def loss(params, x):
        h = jax.nn.relu(x @ params["w1"])
        return jnp.mean((h @ params["w2"]) ** 2)

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"w1": jnp.ones((16, 64)) / 16, "w2": jnp.ones((64, 16)) / 64}
    x = jnp.ones((8, 16))
    f = jaxpar.parallelize(step if train else loss, mesh=mesh,
                           parallel_mode="semi_auto_parallel",
                           in_strategy=({"w1": P(None, "mp"), "w2": P("mp", None)}, P("dp")))
    return f, (params, x)


def test_collectives_no_plan_node_names_are_xlas_own():
    f, args = _megatron_step()
    plan, text = f.plan(*args), f.lower(*args).compile().as_text()
    found = analyse(plan, text)
    assert found.collectives and all(c.causes for c in found.collectives)
    first = found.collectives[0].record.name
    line = next(ln for ln in text.splitlines() if re.match(rf"\s*(ROOT )?%{re.escape(first)} =",
                                                             ln))
    untagged = text.replace(line, re.sub(r"jaxpar#\d+/", "", line))
    again = analyse(plan, untagged)
    assert again.collectives[0].status == XLA_OWN
    assert "XLA's own" in again.collectives[0].cause_text()
    assert [c.status for c in again.collectives[1:]] == [c.status for c in found.collectives[1:]]


def test_plan_report_without_compiled_program_and_notebook_repr(tmp_path):
    f, args = _megatron_step(train=False)
    plan = f.plan(*args)
    fragment = plan._repr_html_()
    assert fragment.startswith('<div class="jxr"') and "Pass the compiled program" in fragment
    assert "<html" not in fragment
    page = plan.report(tmp_path / "plan.html")
    text = (tmp_path / "plan.html").read_text()
    assert text.startswith("<!DOCTYPE html>") and text == page.html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing from the network


def test_diff_between_data_parallel_and_megatron(tmp_path):
    f, args = _megatron_step()
    dp = jaxpar.parallelize(f.__wrapped__, mesh=jaxpar.make_mesh((8,), ("dp",)),
                            parallel_mode="data_parallel", batch_argnums=1)
    a, b = dp.plan(*args), f.plan(*args)
    d = a.diff(b)
    assert ("mesh", "(dp=8)", "(dp=2, mp=4)") in d.settings
    changed = {c.name: (c.before, c.after) for c in d.arguments}
    assert changed["params.w1"] == ("[-, -]", "[-, mp]")
    kinds = {(k, ax): (na, nb) for k, ax, na, _, nb, _ in d.collectives}
    assert kinds[("all-reduce", "dp")][0] > 0 and kinds[("all-reduce", "mp")][0] == 0 \
        and kinds[("all-reduce", "mp")][1] >= 1
    text = str(d)
    assert "params.w1: [-, -] -> [-, mp]" in text and "simulated step time" in text
    assert a.diff(a).same
    report = b.report(other=a)
    assert report.diff is not None and "Changes from the other plan" in report.html


def test_auto_plan_report_lists_runner_ups():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, mesh=mesh,
                           parallel_mode="auto_parallel")
    args = (jnp.ones((64, 256)), jnp.ones((256, 512)), jnp.ones((512, 256)))
    report = f.report(*args)
    assert 'data-section="search"' in report.html
    rows = re.findall(r"<tr><td>dot_general</td>", report.html)
    assert len(rows) >= 1
    assert '"searched":true' in report.html


# -- the command line ---------------------------------------------------------------------------
MODULE = '''
import jax.numpy as jnp
import numpy as np


def mlp(x, w1, w2):
    return jnp.maximum(x @ w1, 0) @ w2


def make_args():
    return np.ones((16, 32), np.float32), np.ones((32, 64), np.float32), np.ones((64, 32),
                                                                                  np.float32)
'''


def test_cli_plans_a_file_and_writes_the_report(tmp_path, capsys):
    from jaxpar._src.launch.cli import main

    (tmp_path / "mymodel.py").write_text(MODULE)
    out = tmp_path / "plan.html"
    rc = main(["plan", f"{tmp_path / 'mymodel.py'}:mlp", "--mesh", "2x4", "--mode",
               "semi_auto_parallel", "--builder", f"{tmp_path / 'mymodel.py'}:make_args",
               "--html", str(out), "--json", str(tmp_path / "plan.json")])
    # semi-automatic needs a pin: the message says how, and the exit status is 2
    assert rc == 2 and "fixed strategy" in capsys.readouterr().err
    rc = main(["plan", f"{tmp_path / 'mymodel.py'}:mlp", "--mesh", "2x4", "--args",
               "f32[16,32], f32[32,64], f32[64,32]", "--html", str(out),
               "--json", str(tmp_path / "plan.json")])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "ShardingPlan on mesh (dp=2, mp=4)" in printed and "report written to" in printed
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert jaxpar.ShardingPlan.load(tmp_path / "plan.json").mesh.sizes == (2, 4)


@pytest.mark.parametrize("argv, message", [
    (["nosuchmodule_xyz:f", "--args", "f32[2]"], "cannot import module 'nosuchmodule_xyz'"),
    (["{file}:nope", "--args", "f32[2]"], "has no 'nope'"),
    (["{file}", "--args", "f32[2]"], "is not module:function"),
    (["{file}:mlp", "--args", "f32[16,32"], "expected ',' or ']' in a shape"),
    (["{file}:mlp", "--args", "q7[2]"], "unknown dtype 'q7'"),
    (["{file}:mlp", "--mesh", "2x4", "--axes", "dp", "--args", "f32[2]"], "must name the 2"),
    (["{file}:mlp", "--mesh", "2xfour", "--args", "f32[2]"], "is not a shape"),
    (["{file}:mlp", "--mesh", "2x4", "--args", "f32[16,32]"], "missing 2 required"),
])
def test_cli_input_errors_exit_2_with_a_message(tmp_path, capsys, argv, message):
    from jaxpar._src.launch.cli import main

    (tmp_path / "mymodel.py").write_text(MODULE)
    argv = [a.replace("{file}", str(tmp_path / "mymodel.py")) for a in argv]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar plan: error: ") and message in err, err


def test_python_m_jaxpar_plan_runs_in_a_fresh_process(tmp_path):
    import subprocess

    (tmp_path / "mymodel.py").write_text(MODULE)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the command asks for the mesh's devices itself
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar", "plan", "mymodel:mlp", "--mesh", "8",
         "--mode", "data_parallel", "--batch-argnums", "0", "--builder", "mymodel:make_args",
         "--html", "out.html"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled collectives: none" in result.stdout  # data parallel forward: no exchange
    assert (tmp_path / "out.html").exists()


def test_args_spec_pytrees():
    from jaxpar._src.report.argspec import parse_args_spec

    x, tree, items = parse_args_spec("bf16[4,8], {w1: f32[8,16], 'b': i32[]}, [u8[3], (f64[1],)]")
    assert x.shape == (4, 8) and x.dtype == jnp.bfloat16
    assert tree["w1"].shape == (8, 16) and tree["b"].shape == () and tree["b"].dtype == np.int32
    assert items[0].dtype == np.uint8 and items[1][0].dtype == np.float64



def test_report_of_a_scanned_layer_stack_names_operators_inside_the_loop():
    from tests import models

    params, x = models.init_stack(jax.random.key(0), layers=4, batch=16, d=32)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step = jaxpar.parallelize(jax.grad(models.scan_stack_loss), mesh=mesh,
                              parallel_mode="semi_auto_parallel",
                              in_strategy=({"w": P(None, None, "mp"), "b": P(None, "mp")},
                                           P("dp")))
    report = step.report(params, x)
    found = report.analysis.collectives
    assert found and all(c.causes for c in found)
    plan = step.plan(params, x)
    body = {n for n in range(len(plan.decisions)) if plan.decisions[n].weight == 4}
    looped = [c for c in found if c.record.count == 4]  # runs once per layer
    assert looped and all({x.node for x in c.causes} <= body for c in looped)
    assert "Operator graph" in report.html
