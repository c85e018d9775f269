"""Pausing Python's cyclic GC while training waits on a save (core/gc_pause.py)."""

from __future__ import annotations

import gc
import threading

from ml_flashpoint_nemo.core.gc_pause import gc_paused, without_gc


def test_pauses_nest_and_restore_the_state_found_first():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause is still on
    assert gc.isenabled()
    gc.disable()  # a trainer that manages GC itself (NeMo's GarbageCollectionCallback) keeps it off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_exception_still_restores_the_collector():
    try:
        with gc_paused():
            raise ValueError("save failed")
    except ValueError:
        pass
    assert gc.isenabled()


def test_overlapping_pauses_of_two_threads_keep_it_off_until_the_last_ends():
    inside, release = threading.Event(), threading.Event()

    @without_gc
    def background_write() -> None:
        inside.set()
        release.wait(10)

    thread = threading.Thread(target=background_write)
    thread.start()
    inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause is still running
    release.set()
    thread.join(10)
    assert gc.isenabled()
