"""jaxpar.inspect.collectives: the HLO parser on printed formats and on real programs."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.hlo import parse_collectives

SYNTHETIC = """HloModule jit_step, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ar.loop = f32[8,16]{1,0} all-reduce(%x), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ar.loop)
}

%cond (p.1: (s32[], f32[8,16])) -> pred[] {
  %p.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x.1: f32[8,16]) -> f32[8,16] {
  %x.1 = f32[8,16]{1,0} parameter(0)
  %tuple.ar = (f32[], f32[256]{0}, /*index=2*/f32[16,16]{1,0}) all-reduce(%x.1, %x.1, %x.1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ag-start = (f32[8,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%x.1), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %ag-done = f32[16,16]{1,0} all-gather-done(%ag-start)
  %rs = f32[2,16]{1,0} reduce-scatter(%x.1), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %ar.mesh = f32[8,16]{1,0} all-reduce(%x.1), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %ar.sub = f32[8,16]{1,0} all-reduce(%x.1), channel_id=6, replica_groups=mesh['a'=8] {'a':(2)2}, use_global_device_ids=true, to_apply=%add
  %init = (s32[], f32[8,16]{1,0}) tuple(%x.1, %x.1)
  %w = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%w), index=1
}
"""


def test_parser_reads_every_printed_format():
    colls = parse_collectives(SYNTHETIC)
    by_name = {c.name: c for c in colls}
    assert set(by_name) == {"tuple.ar", "ag-start", "rs", "ar.mesh", "ar.sub", "ar.loop"}
    tup = by_name["tuple.ar"]
    assert tup.kind == "all-reduce" and tup.nbytes == 4 + 256 * 4 + 16 * 16 * 4
    assert tup.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    ag = by_name["ag-start"]  # async pair counted once, with the gathered result's bytes
    assert ag.kind == "all-gather" and ag.nbytes == 16 * 16 * 4
    assert ag.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    rs = by_name["rs"]  # reduce-scatter bytes are its input: result x group size
    assert rs.group_size == 4 and rs.nbytes == 2 * 16 * 4 * 4
    assert rs.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    mesh_ar = by_name["ar.mesh"]  # devices [2,4]T(1,0) = 0 4 1 5 2 6 3 7 over mesh (4, 1, 2)
    assert mesh_ar.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    sub = by_name["ar.sub"]  # sub-axis of size 2 with 2 before it: strides of 2
    assert sub.replica_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    loop = by_name["ar.loop"]
    assert loop.count == 12 and loop.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert colls.count("all-reduce") == 3 + 12 and colls.static_count("all-reduce") == 4


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((2, 4), ("dp", "mp"))


def test_collectives_of_a_real_program_with_axis_names(mesh):
    def f(x):
        a = jax.lax.all_gather(x, "mp", tiled=True)
        b = jax.lax.psum_scatter(a, "mp", tiled=True)
        c = jax.lax.all_to_all(b, "mp", 0, 1, tiled=True)
        d = jax.lax.ppermute(c, "dp", [(0, 1), (1, 0)])

        def body(h, _):
            return h + jax.lax.psum(h, "dp") * 0.5, None

        return jax.lax.scan(body, d, None, length=5)[0]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("dp", "mp"), out_specs=P("dp", "mp")))
    colls = jaxpar.inspect.collectives(g.lower(jnp.ones((16, 32))), mesh=mesh)
    kinds = {c.kind: c for c in colls}
    assert set(kinds) == {"all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                          "all-reduce"}
    assert kinds["all-gather"].axes == ("mp",) and kinds["all-gather"].group_size == 4
    assert kinds["reduce-scatter"].axes == ("mp",)
    assert kinds["all-reduce"].axes == ("dp",) and kinds["all-reduce"].count == 5
    assert colls.count() == 4 + 5
    assert "all-to-all" in colls.table()


def test_memory_and_flops_are_per_device(mesh):
    f = jaxpar.parallelize(lambda x, w: x @ w, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=(P("dp"), P(None, "mp")))
    lowered = f.lower(jnp.ones((64, 128)), jnp.ones((128, 256)))
    mem = jaxpar.inspect.memory(lowered)
    assert mem["argument"] == (64 * 128 // 2 + 128 * 256 // 4) * 4
    assert mem["output"] == 64 * 256 // 8 * 4
    assert jaxpar.inspect.flops(lowered) == pytest.approx(2 * 64 * 128 * 256 / 8, rel=0.01)
