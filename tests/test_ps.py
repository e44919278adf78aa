"""Parameter-server mode on a real local Ray: servers and workers are actor processes.

The synchronous runs are compared with jaxpar's data-parallel training on the same batches,
through worker deaths, an added and a removed worker, and a server restored from its
checkpoint; the asynchronous one must reach a comparable accuracy.
"""

import functools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import ray

import jaxpar
from jaxpar import ps

# ray.init starts its processes with fork+exec, which JAX's warning about fork cannot tell apart
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")

ROOT = Path(__file__).parent.parent
BATCH = 96
OPT = optax.sgd(0.2, momentum=0.9)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    os.environ["PYTHONPATH"] = os.pathsep.join(  # the actors import jaxpar from this checkout
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # this module's functions go to the actors by value: an actor that imported the module
    # would import pytest too (0.3 CPU s in each of the 15 actors)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # no idle workers prestarted: every actor here has its own runtime_env (the trainer sets
    # env vars), so Ray could not use them and they only take the two cores from the actors
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             _system_config={"enable_worker_prestart": False,
                             "prestart_worker_first_driver": False})
    yield
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def actor_options(tmp_path_factory):
    """One JAX compilation cache for every actor of the module: a restarted or added worker
    loads the gradient step another worker compiled (~1 CPU s each) instead of compiling it
    again; the programs and numbers are the same."""
    cache = tmp_path_factory.mktemp("jax_cache")
    return {"runtime_env": {"env_vars": {"JAX_COMPILATION_CACHE_DIR": str(cache),
                                         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}}}


@pytest.fixture(scope="module")
def digits_file(tmp_path_factory):
    """The digits as the workers read them: a file (scikit-learn's import costs each reading
    worker 2 CPU s)."""
    path = tmp_path_factory.mktemp("data") / "digits.npz"
    x, y = digits()
    np.savez(path, x=x, y=y)
    return str(path)


def classifier(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(classifier(params, x), y).mean()


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16).astype(np.float32), y.astype(np.int32)


def batches(x, y, steps, seed=0):
    order = np.random.default_rng(seed).permutation(len(x))
    out = []
    for i in range(steps):
        idx = order[(i * BATCH) % (len(x) - BATCH):][:BATCH]
        out.append((x[idx], y[idx]))
    return out


def init_params():
    rng = np.random.default_rng(0)
    return {"w1": (rng.normal(size=(64, 32)) / 8).astype(np.float32),
            "b1": np.zeros(32, np.float32),
            "w2": (rng.normal(size=(32, 10)) / 6).astype(np.float32),
            "b2": np.zeros(10, np.float32)}


def dp_step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = OPT.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


@functools.cache
def dp_train():
    """One parallelized step for the module: every test's reference reuses its compilation
    (the shapes are the same), instead of planning and compiling a new closure each time."""
    return jaxpar.parallelize(dp_step, mesh=jaxpar.make_mesh((8,), ("dp",)),
                              parallel_mode="data_parallel", batch_argnums=(2, 3))


def data_parallel(params, data, state=None):
    """The reference: jaxpar's data-parallel train step on 8 devices, same batches.  Returns
    the parameters, the losses and the optimizer state (to go on from)."""
    train = dp_train()
    state = OPT.init(params) if state is None else state
    losses = []
    for x, y in data:
        params, state, loss = train(params, state, x, y)
        losses.append(float(loss))
    return jax.tree.map(np.asarray, params), losses, state


def accuracy(params, x, y):
    return float(np.mean(np.argmax(classifier(params, x), -1) == y))


def assert_same_params(a, b):
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=2e-5, err_msg=name)


def read_part(path, step, part, num_parts):
    """Runs on the workers: their part of batch ``step``, read from the file ``path``."""
    with np.load(path) as data:
        x, y = data["x"], data["y"]
    xb, yb = batches(x, y, step + 1, seed=5)[step]
    rows = ps.part_slice(BATCH, part, num_parts)
    return xb[rows], yb[rows]


def test_sync_equals_data_parallel_with_worker_reads_elastic_workers_faults_and_a_dead_server(
        tmp_path, actor_options, digits_file):
    """One trainer for four runs (its five actors start once: each start costs seconds); each
    run ends where data-parallel training on the same batches, with the same optimizer state,
    does:

    1. 8 steps on batches the scheduler ships;
    2. 5 steps on parts the workers read themselves;
    3. 9 steps with workers added, killed, failing half-way through a push and removed;
    4. 8 steps in which a server dies and comes back from its checkpoint.
    """
    x, y = digits()
    data = batches(x, y, 8)
    expected, losses, state = data_parallel(init_params(), data)
    read = batches(x, y, 5, seed=5)  # what read_part reads in steps 0-4 of the second run
    expected_read, _, state = data_parallel(expected, read, state)
    data3 = batches(x, y, 9, seed=1)
    expected3, _, state = data_parallel(expected_read, data3, state)
    data4 = batches(x, y, 8, seed=2)
    expected4, _, _ = data_parallel(expected3, data4, state)
    added = []
    base3 = 8 + 5  # the server step the third run starts at

    def chaos(trainer, info):
        k = info.step - base3
        if k == 1:
            added.append(trainer.add_worker())  # joins at the run's step 2
        if k == 3:
            ray.kill(trainer.workers[0])  # dies between steps: restarted at step 4
        if k == 4:  # in the run's step 5, worker 1 dies after pushing to server 0 only
            ray.get(trainer.workers[1].inject_fault.remote(base3 + 5, 1))
        if k == 6:
            trainer.remove_worker(2)  # leaves at step 7

    killed = []

    def kill_server(trainer, info):
        if info.step == 27 and not killed:  # 28 steps done; the last checkpoint is step 27
            killed.append(True)
            ray.kill(trainer.servers[1])

    with ps.ParameterServerTrainer(loss_fn, init_params(), OPT, server_num=2, worker_num=3,
                                   checkpoint_every=3, checkpoint_dir=str(tmp_path),
                                   actor_options=actor_options) as trainer:
        history = trainer.train(data)
        got = trainer.params
        report = trainer.report()
        reader = ps.read_on_workers(functools.partial(read_part, digits_file), BATCH)
        read_history = trainer.train(reader, steps=5)
        got_read = trainer.params
        report_read = trainer.report()
        history3 = trainer.train(data3, callbacks=[chaos])
        got3 = trainer.params
        report3 = trainer.report()
        history4 = trainer.train(data4, callbacks=[kill_server])
        got4 = trainer.params
        report4 = trainer.report()

    # 1. the scheduler ships the batches
    assert_same_params(got, expected)
    np.testing.assert_allclose([h.loss for h in history], losses, rtol=1e-4)
    assert all(len(h.workers) == 3 for h in history)
    assert report.steps == (8, 8)
    assert report.applied == (3 * 8, 3 * 8)  # workers x steps on every server
    assert report.duplicates_ignored == 0 and report.worker_restarts == 0
    assert ps.assign_by_size([64 * 32 * 4, 32 * 4, 32 * 10 * 4, 10 * 4], 2) == (0, 1, 1, 1)

    # 2. the workers read their parts
    assert_same_params(got_read, expected_read)
    assert [h.samples for h in read_history] == [BATCH] * 5
    assert [h.step for h in read_history] == [8, 9, 10, 11, 12]
    assert report_read.applied == (3 * 13, 3 * 13)
    with pytest.raises(jaxpar.JaxparError, match="give steps="):
        trainer.train(reader)

    # 3. elastic workers and worker faults
    workers = [h.workers for h in history3]
    assert workers[:2] == [(0, 1, 2)] * 2
    assert workers[2:7] == [(0, 1, 2, added[0])] * 5  # picked up at the next step
    assert workers[7:] == [(0, 1, added[0])] * 2
    assert_same_params(got3, expected3)  # no part lost, none applied twice
    assert report3.worker_restarts == 2
    assert report3.duplicates_ignored == 1  # worker 1's part of step 5, pushed again
    assert report3.applied == (report_read.applied[0] + sum(map(len, workers)),) * 2
    assert report3.server_restores == 0 and report3.redone_steps == 0

    # 4. a dead server comes back from its checkpoint
    assert report4.server_restores == 1
    assert report4.redone_steps == 1  # step 27 (the 6th of this run) computed again
    assert [h.step for h in history4] == [22, 23, 24, 25, 26, 27, 27, 28, 29]
    assert all(h.workers == (0, 1, added[0]) for h in history4)
    assert report4.steps == (30, 30)
    assert report4.applied == (report3.applied[0] + 3 * 8,) * 2  # the redone step counted once
    assert report4.worker_restarts == 2
    assert_same_params(got4, expected4)
    assert sorted(os.listdir(tmp_path)) == ["server_0", "server_1"]


def test_async_converges_survives_a_dropped_worker_and_counts_a_restored_servers_losses(
        tmp_path, actor_options):
    """One trainer for two asynchronous runs (its actors start once: each start costs
    seconds): 45 batches in which a worker dies and is dropped, reaching an accuracy comparable
    with synchronous training; then 12 batches in which a server dies and comes back from its
    checkpoint, losing the updates it had applied since."""
    x, y = digits()
    train, test = (x[:1440], y[:1440]), (x[1440:], y[1440:])
    data = batches(*train, 45, seed=3)
    sync_params, _, _ = data_parallel(init_params(), data)

    def kill(trainer, info):
        if info.step == 40:
            ray.kill(trainer.workers[2])

    killed = []

    def kill_server(trainer, info):
        done = info.step + 1  # parts both servers had applied (they save every 8 updates)
        if not killed and done >= first + 8 and done % 8 == 5:
            killed.append(done)
            ray.kill(trainer.servers[0])

    with ps.ParameterServerTrainer(loss_fn, init_params(), OPT, server_num=2, worker_num=3,
                                   mode="async", max_staleness=4, on_worker_failure="drop",
                                   checkpoint_every=8, checkpoint_dir=str(tmp_path),
                                   actor_options=actor_options) as trainer:
        history = trainer.train(data, callbacks=[kill])
        got = trainer.params
        report = trainer.report()
        first = len(history)
        history2 = trainer.train(batches(x, y, 12, seed=4), callbacks=[kill_server])
        report2 = trainer.report()

    # 1. a worker dropped; every sample still trained on once
    assert sum(h.samples for h in history) == 45 * BATCH  # every sample once
    assert report.applied == (len(history),) * 2  # each part applied once on each server
    assert report.workers_dropped == (2,)
    assert {h.workers for h in history[-10:]} <= {(0,), (1,)}
    sync_acc, async_acc = accuracy(sync_params, *test), accuracy(got, *test)
    assert sync_acc > 0.85
    assert async_acc > sync_acc - 0.05, (sync_acc, async_acc)

    # 2. a server restored from its checkpoint
    assert sum(h.samples for h in history2) == 12 * BATCH  # training finished
    assert report2.server_restores == 1
    # server 0 went back to its checkpoint 5 parts before the kill: what it had applied since
    # is lost, with at most one more part per worker (2 are left) pushed to it in the meantime
    assert 5 <= report2.lost_updates <= 5 + 2, (killed, report2)
    done = len(history) + len(history2)
    assert report2.applied[0] == done - report2.lost_updates
    assert report2.applied[1] == done


@pytest.mark.parametrize("options, message", [
    (dict(server_num=5), "5 servers but only 4 parameter tensors"),
    (dict(mode="eventually"), "mode='eventually' is not one of"),
    (dict(checkpoint_every=2), "needs checkpoint_dir"),
    (dict(on_worker_failure="ignore"), "on_worker_failure='ignore'"),
])
def test_bad_configuration_is_refused(options, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        ps.ParameterServerTrainer(loss_fn, init_params(), OPT, **options)


def test_a_bad_configuration_starts_no_ray(monkeypatch):
    """Too many servers for the tensors is refused before ``ray.init()``: a configuration that
    cannot run must not start a local Ray first."""
    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append((a, k)))
    with pytest.raises(jaxpar.JaxparError, match="5 servers but only 4 parameter tensors"):
        ps.ParameterServerTrainer(loss_fn, init_params(), OPT, server_num=5)
    assert inits == []


def test_ps_context_defaults():
    ps.set_ps_context(enable_ps=True, server_num=2, worker_num=2, mode="async")
    try:
        assert jaxpar.get_ps_context("mode") == "async"
        with pytest.raises(jaxpar.JaxparError, match="unknown option"):
            ps.set_ps_context(servers=2)
    finally:
        ps.reset_ps_context()
    assert jaxpar.get_ps_context("server_num") == 1


def test_a_server_goes_back_past_its_newer_checkpoints_and_saves_them_again(tmp_path):
    """A survivor may have saved a step the restored server had not reached; going back must
    drop it, or saving that step again on the way forward fails."""
    server = ps_server(tmp_path)
    grads = {i: np.ones_like(v) for i, v in server.pull()[1].items()}
    for step in range(7):
        server.push_sync(step, 0, 1, 1.0, grads)
    assert server.checkpoints() == [0, 3, 6]
    before = server.pull()[1]
    assert server.restore(3) == 3 and server.checkpoints() == [0, 3]
    for step in range(3, 7):
        server.push_sync(step, 0, 1, 1.0, grads)
    assert server.checkpoints() == [0, 3, 6]
    for i, v in server.pull()[1].items():
        np.testing.assert_array_equal(v, before[i])
    with pytest.raises(jaxpar.JaxparError, match="already holds checkpoints"):
        ps_server(tmp_path)  # a new run in the same directory


def ps_server(directory):
    from jaxpar._src.ps.server import ServerCore

    params = init_params()
    leaves = jax.tree.leaves(params)
    return ServerCore(0, dict(enumerate(leaves)), OPT, checkpoint_every=3,
                      checkpoint_dir=str(directory))
