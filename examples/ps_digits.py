"""Parameter-server training on Ray: the digits classifier, 2 servers and 3 workers.

    pip install 'jaxpar[ps]'
    python examples/ps_digits.py [--smoke] [--mode sync|async] [--steps 120] [--address ADDR]

Starts a local Ray (or joins ``--address``), splits the classifier's parameters across the
server actors by size, and trains on scikit-learn's digits: each step's batch is divided among
the worker actors, which compute gradients with JAX; the servers apply optax's Adam.  A worker
joins half-way through.  Prints the test accuracy and what the servers did.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from jaxpar import ps  # noqa: E402

BATCH = 96


def classifier(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(classifier(params, x), y).mean()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps, 2 workers, for CI")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--address", default=None, help="a Ray cluster to join")
    args = parser.parse_args(argv)
    steps, workers = (10, 2) if args.smoke else (args.steps, 3)

    import ray

    # the functions above live in __main__: Ray ships them to the actors by value
    ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype(np.float32), y.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1440], order[1440:]
    rng = np.random.default_rng(1)
    params = {"w1": (rng.normal(size=(64, 64)) / 8).astype(np.float32),
              "b1": np.zeros(64, np.float32),
              "w2": (rng.normal(size=(64, 10)) / 8).astype(np.float32),
              "b2": np.zeros(10, np.float32)}
    batches = [(x[idx], y[idx]) for i in range(steps)
               for idx in [train[(i * BATCH) % (len(train) - BATCH):][:BATCH]]]

    def grow(trainer, info):
        if info.step == steps // 2 and len(trainer.workers) == workers:
            print(f"step {info.step}: adding worker {trainer.add_worker()}")
        if info.step % max(1, steps // 6) == 0:
            print(f"step {info.step:4d}  loss {info.loss:.4f}  workers {list(info.workers)}")

    with ps.ParameterServerTrainer(loss_fn, params, optax.adam(1e-2), server_num=2,
                                   worker_num=workers, mode=args.mode) as trainer:
        trainer.train(batches, callbacks=[grow])
        final = trainer.params
        report = trainer.report()
    logits = classifier(final, x[test])
    accuracy = float(np.mean(np.argmax(logits, -1) == y[test]))
    print(f"{args.mode}: test accuracy {accuracy:.3f} after {steps} steps")
    print(f"servers applied {report.applied} worker gradients in {report.steps} steps; "
          f"stale gradients refused: {report.stale_rejections}")
    ray.shutdown()
    return {"accuracy": accuracy, "report": report}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
