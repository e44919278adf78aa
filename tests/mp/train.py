"""A multi-process training job for the launcher tests: run it under ``jaxpar run``.

    jaxpar run -n 2 --devices-per-process 4 tests/mp/train.py OUT.npz

It trains the same model three ways on a (2, 4) mesh over every device of the job and writes
the final parameters (process 0): a semi-automatic Megatron train step (``parallelize``), a
data-parallel hand-written loop (``per_replica`` + ``DistributedGradReducer``) fed by a dataset
sharded per process, and ``Model.train``.  Run as one process with 8 devices it must write the
same numbers.
"""

import os
import sys

import jaxpar

jaxpar.init()  # before anything touches a device

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxpar import dataset as ds  # noqa: E402


def mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def loss_fn(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def sgd(params, grads, lr=0.1):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def main(out: str) -> None:
    assert jax.device_count() == 8, jax.device_count()
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    jaxpar.set_seed(0)
    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(64, 16)).astype(np.float32)
    y_all = rng.normal(size=(64, 8)).astype(np.float32)
    init = {"w1": rng.normal(size=(16, 32)).astype(np.float32) / 4,
            "w2": rng.normal(size=(32, 8)).astype(np.float32) / 6}
    params = jaxpar.parameter_broadcast(init, mesh)

    # 1. semi-automatic Megatron: column-split w1, row-split w2, batch on dp
    def step(params, x, y):
        return sgd(params, jax.grad(loss_fn)(params, x, y))

    megatron = jaxpar.parallelize(step, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=({"w1": (1, 4), "w2": (4, 1)}, (2, 1), (2, 1)))
    x, y = ds.to_global((x_all, y_all), mesh)
    p1 = params
    for _ in range(3):
        p1 = megatron(p1, x, y)

    # 2. data parallel by hand: each process reads its shard of the data set
    reducer = jaxpar.DistributedGradReducer(params)

    @jaxpar.per_replica(mesh=mesh, batch_argnums=(1, 2))
    def dp_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return sgd(params, reducer(grads)), loss

    data = ds.NumpySlicesDataset((x_all, y_all), ["x", "y"], **ds.process_shard(mesh))
    data = data.batch(32 // jax.process_count())
    p2 = params
    for _ in range(2):
        for xb, yb in data.global_batches(mesh):
            p2, _ = dp_step(p2, xb, yb)

    # 3. Model.train in data-parallel mode, on the same per-process shards
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel", mesh=mesh):
        model = jaxpar.Model((params, mlp), lambda o, t: jnp.mean((o - t) ** 2), optax.sgd(0.1))
        model.train(2, data)
        p3 = model.params

    gathered = {f"{k}_{name}": np.asarray(multihost_utils.process_allgather(v, tiled=True))
                for k, p in (("megatron", p1), ("dp", p2), ("model", p3))
                for name, v in p.items()}
    gathered["history"] = np.asarray(model.history)
    if jax.process_index() == 0:
        np.savez(out, **gathered)
    print(f"rank {jaxpar.get_rank()} of {jaxpar.get_group_size()}: done", flush=True)


if __name__ == "__main__":
    if os.environ.get("JAXPAR_TEST_FAIL_RANK") == str(jaxpar.get_rank()):
        raise RuntimeError(f"injected failure on rank {jaxpar.get_rank()}")
    if os.environ.get("JAXPAR_TEST_EXIT_RANK") == str(jaxpar.get_rank()):
        print(f"rank {jaxpar.get_rank()} exits with status 3", flush=True)
        sys.exit(3)  # no exception: without the runner it would wait in the shutdown barrier
    main(sys.argv[1])
