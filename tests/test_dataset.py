"""jaxpar.dataset: shards, pipeline stages, global arrays and dataset_strategy layouts."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar import dataset as ds
from tests.util import assert_tree_close, shard_shape


def rows_of(data):
    return [int(x) for (x,) in data]


@pytest.mark.parametrize("n", [16, 17, 23])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover_the_data(n, num_shards, shuffle):
    per = -(-n // num_shards)
    for epoch in range(2):
        shards = []
        for i in range(num_shards):
            data = ds.NumpySlicesDataset(np.arange(n), num_shards=num_shards, shard_id=i,
                                         shuffle=shuffle, seed=5)
            for _ in range(epoch):  # earlier epochs of this shard
                list(data)
            shards.append(rows_of(data))
        assert all(len(s) == per == len(ds.NumpySlicesDataset(np.arange(n), num_shards=num_shards,
                                                              shard_id=0)) for s in shards)
        every = sum(shards, [])
        assert set(every) == set(range(n))  # complete
        counts = collections.Counter(every)
        # disjoint but for the rows a short shard wraps around to
        assert sum(c - 1 for c in counts.values()) == per * num_shards - n


def test_shuffle_draws_a_new_order_each_epoch():
    data = ds.NumpySlicesDataset(np.arange(32), shuffle=True, seed=1)
    first, second = rows_of(data), rows_of(data)
    assert sorted(first) == sorted(second) == list(range(32))
    assert first != second
    again = ds.NumpySlicesDataset(np.arange(32), shuffle=True, seed=1)
    assert rows_of(again) == first  # reproducible from the seed


def test_map_batch_shuffle_repeat():
    x = np.arange(10, dtype=np.float32)
    data = ds.NumpySlicesDataset({"x": x, "y": x * 2})
    assert data.column_names == ("x", "y")
    mapped = data.map(lambda a, b: a + b, input_columns=["x", "y"], output_columns="s")
    assert mapped.column_names == ("s",)
    assert [float(s) for (s,) in mapped] == list(x * 3)
    batched = data.batch(4, drop_remainder=True)
    assert len(batched) == 2
    assert [b[0].shape for b in batched] == [(4,), (4,)]
    assert len(data.batch(4)) == 3
    shuffled = data.shuffle(4, seed=0)
    assert sorted(float(a) for a, _ in shuffled) == list(x)
    assert [float(a) for a, _ in shuffled] != list(x)
    assert len(data.repeat(3)) == 30
    assert sum(1 for _ in data.create_tuple_iterator(num_epochs=2)) == 20
    two = data.map([lambda a: a + 1, lambda a: a * 10], input_columns="x")
    assert float(next(iter(two))[0]) == 10.0


def test_generator_sources():
    class Squares:
        def __len__(self):
            return 9

        def __getitem__(self, i):
            return np.float32(i * i), np.int32(i)

    data = ds.GeneratorDataset(Squares(), ["sq", "i"], num_shards=3, shard_id=2)
    assert [int(i) for _, i in data] == [2, 5, 8]
    stream = ds.GeneratorDataset(lambda: iter(range(7)), "v", num_shards=2, shard_id=1)
    assert rows_of(stream) == [1, 3, 5] and len(stream) == 3
    with pytest.raises(jaxpar.DatasetError, match="random-access"):
        ds.GeneratorDataset(lambda: iter(range(7)), "v", shuffle=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_shards=4), "together"),
    (dict(num_shards=4, shard_id=4), r"shard_id must be an int in \[0, num_shards=4\)"),
    (dict(num_shards=0, shard_id=0), "positive"),
])
def test_bad_shard_arguments(kwargs, match):
    with pytest.raises(jaxpar.DatasetError, match=match):
        ds.NumpySlicesDataset(np.arange(8), **kwargs)


def test_bad_columns():
    with pytest.raises(jaxpar.DatasetError, match="same number of rows"):
        ds.NumpySlicesDataset((np.arange(8), np.arange(9)))
    with pytest.raises(jaxpar.DatasetError, match="not columns"):
        ds.NumpySlicesDataset(np.arange(8)).map(lambda v: v, input_columns="nope")


def test_data_parallel_and_full_batch_placement():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    (g,) = ds.to_global((x,), mesh)
    assert shard_shape(g) == (2, 3)
    for shard in g.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
    np.testing.assert_array_equal(np.asarray(g), x)
    with jaxpar.auto_parallel_context(dataset_strategy="full_batch"):
        (f,) = ds.to_global((x,), mesh)
    assert f.sharding.is_fully_replicated
    with pytest.raises(jaxpar.StrategyError, match="not divisible by 8"):
        ds.to_global((x[:12],), mesh)


def test_spatial_strategy_puts_the_expected_tile_on_each_device():
    """A tuple dataset_strategy splits height and width of a large image across devices."""
    mesh = jaxpar.make_mesh((2, 4), ("h", "w"))
    images = np.arange(2 * 32 * 64 * 3, dtype=np.float32).reshape(2, 32, 64, 3)
    labels = np.arange(2, dtype=np.int32)
    data = ds.NumpySlicesDataset((images, labels), ["image", "label"]).batch(2)
    with jaxpar.auto_parallel_context(dataset_strategy=((1, 2, 4, 1), (1,)), mesh=mesh):
        image, label = next(data.global_batches())
    assert shard_shape(image) == (2, 16, 16, 3)
    assert label.sharding.is_fully_replicated
    for shard in image.addressable_shards:
        row, col = np.argwhere(mesh.devices == shard.device)[0]
        want = images[:, 16 * row:16 * (row + 1), 16 * col:16 * (col + 1), :]
        np.testing.assert_array_equal(np.asarray(shard.data), want)


def conv_loss(params, images, labels):
    h = jax.lax.conv_general_dilated(images, params["k"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    logits = jnp.mean(jax.nn.relu(h), axis=(1, 2)) @ params["w"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def test_parallelize_takes_the_spatial_layout_of_the_batch():
    mesh = jaxpar.make_mesh((2, 4), ("h", "w"))
    rng = np.random.default_rng(0)
    params = {"k": jnp.asarray(rng.normal(size=(3, 3, 3, 8)), jnp.float32),
              "w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}
    images = jnp.asarray(rng.normal(size=(4, 32, 64, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 4, 4), jnp.int32)

    def step(params, images, labels):
        loss, grads = jax.value_and_grad(conv_loss)(params, images, labels)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    with jaxpar.auto_parallel_context(dataset_strategy=((1, 2, 4, 1), (1,)), mesh=mesh):
        f = jaxpar.parallelize(step, parallel_mode="semi_auto_parallel")
        got = f(params, images, labels)
        plan = f.plan(params, images, labels)
        compiled = f.lower(params, images, labels).compile()
    assert plan.input_specs[2].to_partition_spec() == jax.sharding.PartitionSpec(None, "h", "w")
    assert shard_shape(jax.ShapeDtypeStruct((4, 32, 64, 3), jnp.float32,
                                            sharding=compiled.input_shardings[0][1])) == \
        (4, 16, 16, 3)
    assert_tree_close(got, jax.jit(step)(params, images, labels), rtol=1e-4, atol=1e-5)


def mlp_loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def test_full_batch_arrives_whole_and_is_sliced_locally():
    rng = np.random.default_rng(1)
    params = {"w1": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 2)), jnp.float32)

    def step(params, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    mesh = jaxpar.make_mesh((8,), ("dp",))
    with jaxpar.auto_parallel_context(full_batch=True, mesh=mesh):
        f = jaxpar.parallelize(step, parallel_mode="data_parallel")
        got = f(params, x, y)
        compiled = f.lower(params, x, y).compile()
        plan = f.plan(params, x, y)
    assert compiled.input_shardings[0][1].is_fully_replicated  # x arrives whole
    assert plan.input_specs[2].to_partition_spec() == jax.sharding.PartitionSpec("dp")
    colls = jaxpar.inspect.collectives(compiled)
    assert colls.count("all-gather") == 0 and colls.count("all-reduce") >= 1
    assert_tree_close(got, jax.jit(step)(params, x, y), rtol=1e-4, atol=1e-5)


def test_dataset_strategy_must_match_the_batch():
    mesh = jaxpar.make_mesh((8,), ("dp",))
    params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 2))}

    def step(params, x, y):
        return jax.tree.map(lambda p, g: p - g, params, jax.grad(mlp_loss)(params, x, y))

    with jaxpar.auto_parallel_context(dataset_strategy=((8, 1),), mesh=mesh):
        f = jaxpar.parallelize(step, parallel_mode="data_parallel")
        with pytest.raises(jaxpar.StrategyError, match="batch has 2 arrays"):
            f(params, jnp.ones((32, 8)), jnp.ones((32, 2)))


def test_grain_sources_and_loaders():
    """grain's datasets plug in: a MapDataset as a random-access source, grain batches placed
    with to_global."""
    import grain

    source = grain.MapDataset.source(np.arange(24, dtype=np.float32)).map(lambda v: v * 2)
    shards = [rows_of(ds.GeneratorDataset(source, "v", num_shards=3, shard_id=i, shuffle=True,
                                          seed=2)) for i in range(3)]
    assert sorted(sum(shards, [])) == list(range(0, 48, 2))
    mesh = jaxpar.make_mesh((8,), ("dp",))
    batch = next(iter(grain.MapDataset.source(np.arange(32.0).reshape(16, 2)).batch(16)))
    g = ds.to_global(batch, mesh)
    assert shard_shape(g) == (2, 2)
    np.testing.assert_array_equal(np.asarray(g), np.arange(32.0).reshape(16, 2))
    assert ds.process_shard(mesh) == {"num_shards": None, "shard_id": None}
