"""How attention's nest calls (one per chunk of heads) run on the cores: in order on the
thread team, or spread over a process-wide pool of Python worker threads, one nest per thread
(a nest call releases the GIL)."""
from __future__ import annotations

import concurrent.futures
import itertools

import tpp
from tpp.runtime import recording


TEAM_CHUNK_FLOPS = 64e6     # smaller chunks whose heads split evenly run on the team, in order


def schedule(chunks, serial, run, scratch, heads=1, chunk_flops=0.0):
    """run(c, arrays, threads) for every chunk c, arrays a scratch() dict of the calling
    thread. heads: the heads of a chunk its nest shares among the team (its parallel loop);
    chunk_flops: a chunk's work. In order, each nest on the team (tpp.get_num_threads()):
    few chunks, or small chunks (under TEAM_CHUNK_FLOPS) whose heads split evenly over the
    team: a parallel region per chunk costs less than the Python worker threads' hand-offs
    and their contention for the GIL between short nest calls (2 threads: B8 H12 S16 D32
    forward 340-369 -> 166-167 us, S64 507 -> 435-463, S128 D64 2553-2698 -> 2432-2538).
    Else the chunks spread over Python worker threads, each nest on one thread (a nest call
    releases the GIL): one fork and join per operator call, robust to a core taken away for a
    while, and the only way to use the team when a chunk has fewer heads than threads (long
    sequences: B1 H12 S2048 takes one head per chunk, 2x slower on the team)."""
    count = chunks
    team = 1 if serial else tpp.get_num_threads()
    if team == 1 or count < team or (count < 2 * team and count % team) or (
            heads % team == 0 and chunk_flops < TEAM_CHUNK_FLOPS):
        arrays = scratch()
        for c in range(count):
            run(c, arrays, 1 if serial else None)
        return
    recording.refuse("attention spread its chunks over Python threads")
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
