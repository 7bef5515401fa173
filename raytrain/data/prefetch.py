"""Prefetching and wait accounting: a source's batches, some ahead in a thread, the consumer's wait counted."""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator


def timed_batches(source, batches: Iterator, prefetch: int) -> Iterator:
    """Yield from `batches`, `prefetch` ahead in a background thread; add the consumer's wait to wait_s."""
    if prefetch <= 0:
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(batches)
                except StopIteration:
                    return
                finally:
                    _waited(source, time.perf_counter() - t0)
                yield item
        finally:
            _close(batches)
    q: queue.Queue = queue.Queue(prefetch)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in batches:
                if not put(("batch", item)):
                    return
            put(("end", None))
        except BaseException as e:  # handed to the consumer, raised in its thread
            put(("error", e))
        finally:
            _close(batches)

    thread = threading.Thread(target=work, name="raytrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            t0 = time.perf_counter()
            kind, item = q.get()
            _waited(source, time.perf_counter() - t0)
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def _waited(source, seconds: float) -> None:
    """Add to the source's wait; the first batch's (start-up: files opened, Ray Data started) also apart."""
    source.wait_s += seconds
    if getattr(source, "first_wait_s", None) is None:
        source.first_wait_s = seconds


def _close(gen) -> None:
    close = getattr(gen, "close", None)
    if close is not None:
        close()
