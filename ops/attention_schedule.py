"""How attention's nest calls (one per chunk of heads) run on the cores: in order on the
thread team, or spread over a process-wide pool of Python worker threads, one nest per thread
(a nest call releases the GIL)."""
from __future__ import annotations

import concurrent.futures
import itertools

import tpp


def schedule(chunks, serial, run, scratch):
    """run(c, arrays, threads) for every chunk c, arrays a scratch() dict of the calling
    thread. Few chunks: in order, each nest on the team (tpp.get_num_threads()). As many
    chunks as threads or more: chunks spread over Python worker threads, each nest on one
    thread (a nest call releases the GIL): one fork and join per operator call instead of a
    parallel region per chunk, whose barriers cost a scheduler time slice each on a busy
    machine."""
    count = chunks
    team = 1 if serial else tpp.get_num_threads()
    if team == 1 or count < team or (count < 2 * team and count % team):
        arrays = scratch()
        for c in range(count):
            run(c, arrays, 1 if serial else None)
        return
    counter = itertools.count()

    def worker():
        arrays = scratch()
        for c in iter(counter.__next__, None):
            if c >= count:
                return
            run(c, arrays, 1)

    futures = [_pool(team - 1).submit(worker) for _ in range(team - 1)]
    worker()
    for f in futures:
        f.result()


_POOLS: dict = {}


def _pool(workers):
    """A process-wide pool of `workers` threads (the operator's calling thread is the last)."""
    pool = _POOLS.get(workers)
    if pool is None:
        _POOLS.clear()
        pool = _POOLS[workers] = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="tpp-attention")
    return pool
