"""Strategy forms and the documented slice-count -> mesh-axis rule."""

import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.spec import MeshShape, Spec
from jaxpar._src.strategy import assign_axes, mesh_for_slice_counts, normalize


@pytest.mark.parametrize(
    ("mesh", "counts", "axes"),
    [
        (((2, 4), ("dp", "mp")), (2, 1), (("dp",), ())),
        (((2, 4), ("dp", "mp")), (1, 4), ((), ("mp",))),
        (((2, 4), ("dp", "mp")), (4, 2), (("mp",), ("dp",))),
        (((2, 4), ("dp", "mp")), (8, 1), (("dp", "mp"), ())),
        (((2, 4), ("dp", "mp")), (2, 4), (("dp",), ("mp",))),
        # MindSpore appends the copies as the last (innermost) device-matrix axis
        # (ops_info/operator_info.cc, SetRepeatedCalcDevMatrix): the slices take the outer axes
        (((2, 2, 2), ("a", "b", "c")), (2, 2), (("a",), ("b",))),
        (((2, 2, 2), ("a", "b", "c")), (2, 1), (("a",), ())),
        (((2, 2, 2), ("a", "b", "c")), (2, 4), (("a",), ("b", "c"))),
        (((2, 2, 2), ("a", "b", "c")), (4, 2), (("a", "b"), ("c",))),
        (((2, 2, 2), ("a", "b", "c")), (1, 1, 2), ((), (), ("a",))),
        (((2, 2, 4), ("a", "b", "c")), (4, 1), (("a", "b"), ())),  # a run before a lone axis
        (((3, 4), ("x", "y")), (3, 4), (("x",), ("y",))),  # not only powers of two
        (((2, 4), ("dp", "mp")), (2, 2), None),
    ],
)
def test_slice_count_rule(mesh, counts, axes):
    shape, names = mesh
    assert assign_axes(counts, MeshShape(names, shape)) == axes


def test_forms_normalise_to_the_same_spec():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    layout = jaxpar.Layout((2, 4), ("dp", "mp"))
    want = Spec((("dp",), ("mp",)))
    for form in [(2, 4), P("dp", "mp"), layout("dp", "mp"), NamedSharding(mesh, P("dp", "mp"))]:
        assert normalize(form, (8, 8), mesh, where="t") == want
    assert normalize(None, (8, 8), mesh, where="t") is None


def test_mesh_built_from_slice_counts_matches_mindspore_device_matrix():
    mesh = mesh_for_slice_counts([(2, 1), (1, 4)], 8, where="t")
    assert dict(mesh.shape) == {"a0": 2, "a1": 4}
    mesh = mesh_for_slice_counts([(2, 1)], 8, where="t")
    assert dict(mesh.shape) == {"a0": 2, "rep": 4}  # copies innermost, as MindSpore 2.x
    # ((2, 4), (4, 1)): the device matrix [2, 4] of the first; the second fits on it
    mesh = mesh_for_slice_counts([(2, 4), (4, 1)], 8, where="t")
    assert dict(mesh.shape) == {"a0": 2, "a1": 4}
    # (1, 4) then (2, 1): the second fits on the first's device matrix [4, 2(copies)]
    mesh = mesh_for_slice_counts([(1, 4), (2, 1)], 8, where="t")
    assert dict(mesh.shape) == {"a0": 4, "a1": 2}
    # (1, 4) then (2, 2): the second needs a cut of its own; both land where their device
    # matrices [4, 2(copies)] and [2, 2, 2(copies)] put them
    mesh = mesh_for_slice_counts([(1, 4), (2, 2)], 8, where="t")
    assert dict(mesh.shape) == {"a0": 2, "a1": 2, "rep": 2}
    with pytest.raises(jaxpar.MeshError, match="does not divide"):
        mesh_for_slice_counts([(3, 1)], 8, where="t")


def test_layout_to_dict_matches_mindspore():
    layout = jaxpar.Layout((2, 2, 2), ("dp", "sp", "mp"))
    d = layout("dp", "mp").to_dict()
    assert d["device_matrix"] == (2, 2, 2) and d["tensor_map"] == (2, 0)
    assert layout(("dp", "sp"), "None").to_dict()["tensor_map"] == ((2, 1), -1)
    with pytest.raises(jaxpar.StrategyError, match="used twice"):
        layout("dp", "dp")
    with pytest.raises(jaxpar.StrategyError, match="not one of"):
        layout("tp")


def test_layout_mesh_honours_rank_list():
    layout = jaxpar.Layout((2, 4), ("dp", "mp"), rank_list=[0, 4, 1, 5, 2, 6, 3, 7])
    mesh = layout.mesh()
    assert [d.id for d in mesh.devices.flat] == [0, 4, 1, 5, 2, 6, 3, 7]
