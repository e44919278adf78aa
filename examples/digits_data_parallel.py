"""A digits classifier trained data-parallel with ``jaxpar.Model`` on 8 emulated devices.

    python examples/digits_data_parallel.py [--smoke] [--epochs 20] [--plot loss.png]
    jaxpar run -n 2 --devices-per-process 4 examples/digits_data_parallel.py   # 2 processes

MindSpore's data-parallel tutorial, in JAX: scikit-learn's digits (shipped inside the package, no
download), a ``jaxpar.dataset`` pipeline, a Flax NNX classifier, ``Model.train`` in
``data_parallel`` mode (every device trains on its slice of each batch, a
``DistributedGradReducer`` averages the gradients), then the test accuracy, the all-reduce XLA
compiled, and the loss curve.  Under ``jaxpar run`` each process reads its shard of the data
and the 8 devices are those of all processes together.
"""

from __future__ import annotations

import argparse
import os

DEVICES = int(os.environ.get("JAX_NUM_CPU_DEVICES", 8))  # jaxpar run sets it per process
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import dataset as ds  # noqa: E402

jaxpar.init()  # joins the other processes under jaxpar run; nothing to do in one process


class Classifier(nnx.Module):
    """Dense 64 -> 128 -> 10, as in MindSpore's data-parallel example."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def datasets(batch: int) -> tuple[ds.Dataset, ds.Dataset]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1536], order[1536:]
    train_set = ds.NumpySlicesDataset((x[train], y[train]), ["image", "label"], shuffle=True,
                                      **ds.process_shard())
    test_set = ds.NumpySlicesDataset((x[test], y[test]), ["image", "label"])
    return (train_set.batch(batch, drop_remainder=True),
            test_set.batch(len(test) // 8 * 8, drop_remainder=True))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two epochs, for CI")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--plot", default="", help="save the loss curve to this PNG")
    args = parser.parse_args(argv)
    epochs = 2 if args.smoke else args.epochs

    jaxpar.set_seed(1)
    jaxpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                     comm_fusion={"allreduce": {"mode": "auto"}})
    train_set, test_set = datasets(batch=128)
    model = jaxpar.Model(Classifier(nnx.Rngs(0)), cross_entropy, optax.adam(3e-3),
                         metrics={"accuracy": jaxpar.metrics.Accuracy()})
    monitor = jaxpar.LossMonitor(per_print_times=len(train_set))
    model.train(epochs, train_set, callbacks=[monitor, jaxpar.TimeMonitor()],
                progress=not args.smoke)
    result = model.eval(test_set)
    x, y = next(iter(train_set))
    colls = jaxpar.inspect.collectives(model.lower(x, y).compile())
    print(f"test accuracy {result['accuracy']:.3f}, loss {result['loss']:.4f}")
    print(f"the compiled step: {colls.count('all-reduce')} all-reduce of "
          f"{colls.total_bytes('all-reduce') / 1024:.1f} KiB over {colls[0].group_size} devices")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(model.history)
        ax.set(xlabel="step", ylabel="loss", title="digits, data parallel on 8 devices")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"loss curve: {args.plot}")
    return {"history": model.history, "accuracy": result["accuracy"], "collectives": colls}


if __name__ == "__main__":
    main()
