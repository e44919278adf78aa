"""The MindSpore articles' data-parallel and semi-automatic examples, ported line by line.

    python examples/mindspore_article_ports.py [--smoke]

1. Data parallel: "驾驭算力猛兽：昇思MindSpore自动并行训练实战指南" (seeds/004), sections 2.1
   (init and rank), 2.2 scenario A (``DATA_PARALLEL``), 2.3 (``GeneratorDataset`` with
   ``num_shards``/``shard_id``) and 2.4 (``SimpleNet``, ``Model.train`` with the article's rank-0
   ``LossMonitor`` and ``dataset_sink_mode=True``).
2. Semi-automatic: "MindSpore开发之路（二十）：自动并行入门" (seeds/002), section 5:
   ``SEMI_AUTO_PARALLEL`` on ``device_num=8`` with ``net.dense_layer.matmul.shard(((2, 4),
   (4, 1)))``; no mesh is written, the matmul's strategy gives it (MindSpore's device matrix
   ``[2, 4, 1]``: devices 0-3 and 4-7 sum the matmul's partial results).

Every MindSpore line stands as a comment above the jaxpar line that replaces it, where they
differ.  Two differences are of substance: ``get_group_size()`` counts processes here (one
process drives all its devices; MindSpore runs one per device), so ``device_num`` is the device
count; and the article hands ``GeneratorDataset`` the tuple ``(data, label)``, which a
random-access source reads as two rows, so the port gives it the rows ``list(zip(data, label))``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import dataset as ds  # noqa: E402


# -- 1. seeds/004, section 2.1: the distributed environment ----------------------------------
def setup_distributed_env():
    """初始化分布式环境"""
    # context.set_context(mode=context.GRAPH_MODE, device_target="Ascend")
    jaxpar.set_context(mode=jaxpar.GRAPH_MODE)  # the device is whatever JAX runs on
    jaxpar.init()  # init()
    rank_id = jaxpar.get_rank()  # get_rank()
    rank_size = jaxpar.get_group_size()  # get_group_size(): processes here
    print(f"Device initialized. Rank: {rank_id}, Group Size: {rank_size}")
    return rank_id, rank_size


# -- section 2.3: the dataset, sharded by rank -----------------------------------------------
def create_dataset(rank_id, rank_size, num_samples=1000):
    data = np.random.randn(num_samples, 32).astype(np.float32)
    label = np.random.randint(0, 10, num_samples).astype(np.int32)
    dataset = ds.GeneratorDataset(
        source=list(zip(data, label, strict=True)),  # source=(data, label)
        column_names=["data", "label"],
        num_shards=rank_size,
        shard_id=rank_id,
    )
    dataset = dataset.batch(32)
    return dataset


# -- section 2.4: the network ----------------------------------------------------------------
class SimpleNet(nnx.Module):  # class SimpleNet(nn.Cell)
    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.fc1 = nnx.Linear(32, 64, rngs=rngs)  # nn.Dense(32, 64)
        self.relu = nnx.relu  # nn.ReLU()
        self.fc2 = nnx.Linear(64, 10, rngs=rngs)  # nn.Dense(64, 10)

    def __call__(self, x):  # def construct(self, x)
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        return x


def loss_fn(logits, labels):
    # nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction='mean')
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class LossMonitor(jaxpar.Callback):  # class LossMonitor(ms.Callback)
    def __init__(self):
        self.losses = []

    def step_end(self, run_context):
        cb_params = run_context.original_args()
        self.losses.append(cb_params.net_outputs)
        # 只在0号卡打印，避免日志刷屏
        if jaxpar.get_rank() == 0:
            print(f"Epoch: {cb_params.cur_epoch_num}, Step: {cb_params.cur_step_num}, "
                  f"Loss: {cb_params.net_outputs}")


def data_parallel(epochs: int, num_samples: int) -> dict:
    rank_id, rank_size = setup_distributed_env()
    # section 2.2, 场景 A：标准数据并行
    jaxpar.set_auto_parallel_context(
        parallel_mode=jaxpar.ParallelMode.DATA_PARALLEL,  # context.ParallelMode.DATA_PARALLEL
        gradients_mean=True,
        device_num=len(jax.devices()),  # device_num=rank_size (MindSpore: a process per device)
    )
    ds_train = create_dataset(rank_id, rank_size, num_samples)
    net = SimpleNet()
    # nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    optimizer = optax.sgd(learning_rate=0.01, momentum=0.9)
    model = jaxpar.Model(net, loss_fn=loss_fn, optimizer=optimizer)  # ms.Model(...)
    print("Start Training...")
    monitor = LossMonitor()
    model.train(epoch=epochs, train_dataset=ds_train, callbacks=[monitor],
                dataset_sink_mode=True)
    x, y = next(iter(ds_train))
    colls = jaxpar.inspect.collectives(model.lower(x, y).compile())
    print(f"data parallel: {colls.count('all-reduce')} gradient all-reduce over "
          f"{colls[0].group_size} devices per step")
    jaxpar.reset_auto_parallel_context()
    return {"losses": monitor.losses, "collectives": colls}


# -- 2. seeds/002, section 5: semi-automatic parallel ----------------------------------------
class DenseLayer(nnx.Module):
    """MindSpore's nn.Dense: a MatMul primitive (which ``shard`` configures) and a bias."""

    def __init__(self, din, dout, rngs):
        self.weight = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))
        self.bias = nnx.Param(jnp.zeros((dout,)))
        self.matmul = jnp.matmul  # self.matmul = ops.MatMul()

    def __call__(self, x):
        return self.matmul(x, self.weight[...]) + self.bias[...]


class YourNet(nnx.Module):  # the article's "net = YourNet()"
    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.dense_layer = DenseLayer(32, 64, rngs)
        self.head = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.dense_layer(x)))


def semi_auto(epochs: int, num_samples: int) -> dict:
    # device_num=8  # 假设我们有8张卡
    device_num = 8
    # context.set_auto_parallel_context(parallel_mode=mindspore.ParallelMode.SEMI_AUTO_PARALLEL,
    #                                   gradients_mean=True, device_num=device_num)
    jaxpar.set_auto_parallel_context(parallel_mode=jaxpar.ParallelMode.SEMI_AUTO_PARALLEL,
                                     gradients_mean=True,  # 数据并行时，梯度是否求均值
                                     device_num=device_num)
    net = YourNet()
    # net.dense_layer.matmul.shard(((2, 4), (4, 1)))
    net.dense_layer.matmul = jaxpar.shard(net.dense_layer.matmul, in_strategy=((2, 4), (4, 1)))
    # 这表示一个矩阵乘法，其输入的第一个维度按2切，第二个维度按4切；
    # 权重的第一个维度按4切，第二个维度不切
    model = jaxpar.Model(net, loss_fn=loss_fn, optimizer=optax.sgd(0.01, momentum=0.9))
    monitor = LossMonitor()
    model.train(epochs, create_dataset(0, 1, num_samples), callbacks=[monitor])
    # What ran: the mesh the strategy gave and who sums the matmul's partial results.
    x = np.zeros((32, 32), np.float32)
    y = np.zeros((32,), np.int32)
    compiled = model.lower(x, y).compile()
    mesh = jax.tree.leaves(compiled.input_shardings)[0].mesh
    forward = [c for c in jaxpar.inspect.collectives(compiled)
               if c.kind == "all-reduce" and c.group_size == 4]
    print(f"semi-automatic: mesh {dict(mesh.shape)} (MindSpore's device matrix [2, 4, 1]); "
          f"the matmul's partial sums are all-reduced within "
          f"{sorted({g for c in forward for g in c.replica_groups})}")
    jaxpar.reset_auto_parallel_context()
    return {"losses": monitor.losses, "mesh": dict(mesh.shape),
            "groups": sorted({g for c in forward for g in c.replica_groups})}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, for CI")
    args = parser.parse_args(argv)
    jaxpar.set_seed(1)  # ms.set_seed(1)
    epochs, samples = (2, 256) if args.smoke else (5, 1000)
    return {"data_parallel": data_parallel(epochs, samples),
            "semi_auto": semi_auto(epochs, samples)}


if __name__ == "__main__":
    main()
