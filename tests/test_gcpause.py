"""``paused_gc``: the collector off inside, back on after; what a big pause made goes to the
oldest generation unscanned, and cyclic garbage from it is still collected."""

import gc
import weakref

import pytest

from jaxpar._src.gcpause import PROMOTE_ABOVE, paused_gc


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("made, promoted", [(10, False), (3 * PROMOTE_ABOVE, True)])
def test_pause_promotes_only_big_pauses(made: int, promoted: bool) -> None:
    gc.collect()
    with paused_gc():
        assert not gc.isenabled()
        kept = [[] for _ in range(made)]
        garbage = _Cycle()
        dead = weakref.ref(garbage)
        del garbage
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0  # nothing left frozen
    in_oldest = {id(x) for x in gc.get_objects(generation=2)}
    assert (id(kept[-1]) in in_oldest) is promoted
    if promoted:  # no young collection pending for them
        assert gc.get_count()[0] < PROMOTE_ABOVE
    assert dead() is not None  # the cycle waits for a collection ...
    gc.collect()
    assert dead() is None  # ... and a full one frees it


def test_nested_pause_restores_once() -> None:
    with paused_gc():
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()


def test_someone_elses_freeze_is_left_alone() -> None:
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            _ = [[] for _ in range(3 * PROMOTE_ABOVE)]
        # Not unfrozen by the pause (that would empty the permanent generation).  Frozen objects
        # that die meanwhile (another thread's, a pytest worker's) leave it, so not exactly equal.
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
