"""The row groups' arrays of a tick: a micro-batch's rows ``[G, rows / G, ...]``, the gradient
accumulators ``[v, G, k, ...]`` and ``[G, ...]``, and the loss's parts ``[G]``.

Where the layers (``groups.py``), the prologue and epilogue (``ends.py``) and the loss's tail
(``tail.py``) run per data-parallel row group, a tick (``loop.py``) reshapes its values to put
the group dimension first, laid out on the row axes (group ``g`` the rows device ``g`` holds:
no data moves), accumulates each group's gradients on their own and sums them over the groups
once, after the loop: one all-reduce, or one reduce-scatter under ZeRO, over the row axes a step.
These are those reshapes, accumulators and sums, for the tick class to inherit: every method
reads only the attributes declared below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar._src.pipeline import arrays as ar
from jaxpar._src.pipeline.config import AXIS
from jaxpar._src.pipeline.ends import EndGroups
from jaxpar._src.pipeline.groups import RowGroups
from jaxpar._src.pipeline.pieces import Pieces, is_float
from jaxpar._src.spec import Spec


class GroupedArrays:
    """The row-group arrays of one stage's tick (``loop._Tick`` inherits them)."""

    pieces: Pieces
    program: Any
    rest: list
    w_local: list  # the stacked weights' gradient accumulators' specs [v, (G,) k, ...]
    groups: RowGroups | None
    ends: EndGroups | None
    w_cuts: dict[int, int]  # stacked weights stretched over the rows: their row dimension
    rest_g_specs: list[Spec]  # the rest's per-group accumulators' specs [G, ...]
    loss_dtype: Any  # the loss's accumulators' (PipelineProgram.loss_dtype)

    # -- rows and the stacked weights' gradients (groups.py) ---------------------------------
    def _group_w_specs(self) -> list[Spec]:
        # the accumulators' specs [v, G, k, ...] less v
        return [Spec(sp.dims[1:]) for sp in self.w_local]

    def _group(self, xs: Sequence[Any], specs: Sequence[Spec]) -> list:
        """``[rows, ...] -> [G, rows / G, ...]``: group ``g`` the rows device ``g`` of the row
        axes holds (the same bytes, no data moves)."""
        assert self.groups is not None
        axes, G = self.groups.axes, self.groups.size
        out: list[Any] = []
        for x, sp in zip(xs, specs, strict=True):
            if x is None:
                out.append(None)
                continue
            g = jnp.reshape(x, (G, x.shape[0] // G) + tuple(x.shape[1:]))
            out.append(ar.constrain(self.pieces, g, Spec((axes, ()) + sp.dims[1:])))
        return out

    def _regroup(self, x: Any, dim: int) -> Any:
        """A value stretched over the rows along ``dim``: ``[G, ..., rows / G, ...]``, each
        group its own rows (where they lie: no data moves)."""
        assert self.groups is not None
        G = self.groups.size
        shape = tuple(x.shape)
        x = jnp.reshape(x, shape[:dim] + (G, shape[dim] // G) + shape[dim + 1:])
        return jnp.moveaxis(x, dim, 0)

    def _unregroup(self, x: Any, dim: int) -> Any:
        x = jnp.moveaxis(x, 0, dim)
        shape = tuple(x.shape)
        return jnp.reshape(x, shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2:])

    def _ungroup(self, xs: Sequence[Any]) -> list:
        if self.groups is None:
            return list(xs)
        return [jnp.reshape(x, (x.shape[0] * x.shape[1],) + tuple(x.shape[2:])) for x in xs]

    def grad_zeros(self, j: int, w: Any) -> Any:
        """Stacked weight ``j``'s gradient accumulator (``w``: this stage's ``[v, k, ...]``)."""
        if self.groups is None or j in self.w_cuts:
            return jnp.zeros_like(w)
        return jnp.zeros((w.shape[0], self.groups.size) + tuple(w.shape[1:]), w.dtype)

    def grad_sums(self, gs: list) -> list:
        """The accumulated gradients, summed over the row groups: the one reduction over the
        row axes a step makes for them."""
        if self.groups is None:
            return gs
        scatters = {j: (dim, axes) for j, dim, axes in self.program.scatters}
        return [g if j in self.w_cuts else
                self._scatter(g, self.w_local[j], *scatters[j]) if j in scatters else
                jnp.sum(g, axis=1) for j, g in enumerate(gs)]

    def _scatter(self, g: Any, spec: Spec, dim: int, axes: tuple[str, ...]) -> Any:
        """``g`` (``[v, G, k, ...]``, laid out ``spec``) summed over the groups by one
        reduce-scatter (ZeRO: ``program.scatters``), dimension ``dim`` of ``[S, v, k, ...]``
        split further over ``axes``.  Written out (``psum_scatter`` manual over every axis but
        ``"pp"``, as :mod:`jaxpar._src.scatter` does): XLA:CPU keeps an all-reduce and a slice
        for a sum pinned split."""
        mesh = self.pieces.mesh()
        dims = list(spec.dims[:1] + spec.dims[2:])
        dims[dim - 1] = dims[dim - 1] + axes
        assert tuple(spec.dims[1]) == tuple(axes), (spec, axes)  # every row group summed

        def local(x: Any) -> Any:
            return jax.lax.psum_scatter(x[:, 0], axes, scatter_dimension=dim - 1, tiled=True)

        return jax.shard_map(local, mesh=mesh, in_specs=spec.to_partition_spec(),
                             out_specs=Spec(tuple(dims)).to_partition_spec(),
                             axis_names=set(mesh.axis_names) - {AXIS}, check_vma=False)(g)

    # -- the loss's parts per row group (tail.py) ---------------------------------------------
    def _affine(self) -> bool:
        return self.ends is not None and self.ends.affine is not None

    def _loss_spec(self) -> Spec:
        assert self.groups is not None
        return Spec((self.groups.axes,))

    def loss_group_zeros(self) -> list:
        """The accumulator ``[G]`` of the loss's parts summed per row group (``[]`` where the
        loss's tail runs on the whole micro-batch)."""
        if not self._affine():
            return []
        assert self.groups is not None
        return self._loss_groups([jnp.zeros((self.groups.size,), self.loss_dtype)])

    def _loss_groups(self, xs: list) -> list:
        """The loss's parts laid out as their accumulator (each group's on its own devices):
        alike in both branches of a tick's conditionals, as :meth:`_group_grads`."""
        return [ar.constrain(self.pieces, x, self._loss_spec()) for x in xs]

    # -- the rest's gradients per row group (ends.py) ----------------------------------------
    def _grouped(self) -> tuple[int, ...]:
        return self.ends.grouped if self.ends is not None else ()

    def rest_group_zeros(self) -> list:
        """The accumulators ``[G, ...]`` of the rest's gradients summed per group."""
        if self.groups is None:
            return []
        G = self.groups.size
        return [ar.constrain(self.pieces, jnp.zeros((G,) + tuple(self.rest[i].shape),
                                                  self.rest[i].dtype), sp)
                for i, sp in zip(self._grouped(), self.rest_g_specs, strict=True)]

    def _rest_groups(self) -> list:
        """The grouped rest weights broadcast to ``[G, ...]`` (laid out as their accumulators:
        the group dimension on the row axes, so each device holds its own group's copy)."""
        assert self.groups is not None
        G = self.groups.size
        return [ar.constrain(self.pieces, jnp.broadcast_to(self.rest[i][None],
                                                         (G,) + tuple(self.rest[i].shape)), sp)
                for i, sp in zip(self._grouped(), self.rest_g_specs, strict=True)]

    def _rest_of(self, rr: list, rg: list, cuts: list, own: list) -> list:
        """One group's rest: its own copies of the grouped weights and slices of the values
        stretched over the rows, the others whole."""
        out = list(rr)
        for i, v in zip(self._grouped(), rg, strict=True):
            out[i] = v
        for (i, _), v in zip(cuts, own, strict=True):
            out[i] = v
        return out

    def _group_grads(self, gs: list) -> list:
        """Per-group gradients laid out as their accumulators.  Made inside a ``lax.cond``
        whose other branch returns :meth:`rest_group_zeros`: XLA refuses branches whose results
        are laid out differently ("Inconsistent conditional sharding"), as an unconstrained
        gradient of a weight the group only reads (a zero broadcast) would be."""
        return [ar.constrain(self.pieces, g, sp)
                for g, sp in zip(gs, self.rest_g_specs, strict=True)]

    def _add_groups(self, acc: list, gs: list) -> list:
        return [ar.constrain(self.pieces, a + g.astype(a.dtype), sp)
                for a, g, sp in zip(acc, gs, self.rest_g_specs, strict=True)]

    def rest_zeros(self) -> list:
        """The accumulators of the rest's per-micro-batch gradients: a scalar placeholder for
        a weight only ever summed per group (no second copy of its gradient)."""
        only = set(self.ends.only) if self.ends is not None else set()
        return [jnp.zeros((), r.dtype) if i in only else jnp.zeros_like(r)
                for i, r in enumerate(self.rest)]

    def _add_rest(self, acc: list, gs: list) -> list:
        only = set(self.ends.only) if self.ends is not None else set()
        return [a if i in only or not is_float(a) else a + g
                for i, (a, g) in enumerate(zip(acc, gs, strict=True))]

    def rest_sums(self, g_rest: list, g_rest_g: list) -> list:
        """The rest's gradients: the per-micro-batch sums plus the per-group ones summed over
        the groups (the one reduction over the row axes a step makes for them)."""
        out = list(g_rest)
        only = set(self.ends.only) if self.ends is not None else set()
        scatters = {i: (dim, axes) for i, dim, axes in self.program.rest_scatters}
        for i, g, sp in zip(self._grouped(), g_rest_g, self.rest_g_specs, strict=True):
            if i in scatters:  # ZeRO: each device keeps its slice of one dimension
                dim, axes = scatters[i]  # [1, G, ...] is [S, v, ...]'s shape to _scatter
                total = self._scatter(g[None], Spec(((),) + sp.dims), dim + 2, axes)[0]
                split = self.program.rest_grad_spec(i)
                out[i] = total if i in only else ar.constrain(self.pieces, out[i] + total,
                                                              split)
            else:
                total = jnp.sum(g, axis=0)
                out[i] = total if i in only else out[i] + total
        return out
