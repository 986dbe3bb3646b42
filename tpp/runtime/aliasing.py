"""Which tensors of a loop nest may be given the same memory: a tensor the nest writes must not
share memory with another tensor of the call (CompiledNest checks the addresses of every call),
except as the identical array where one call alone touches both, element-wise at the same
offsets, and visits each block once (each element is then read before it is written, by that
call, and never read again: a second call reading the other tensor, or a second visit of a
block, would see what the first wrote)."""
from __future__ import annotations

from ..core.loop_spec import LETTERS, Address, LoopNestSpec, raw_operands

_IN_PLACE_KINDS = ("map", "map_inv", "compare", "equation")


def aliasable_pairs(spec: LoopNestSpec, written) -> frozenset:
    """Pairs (w, j), w a written tensor, that may be given the identical array: w and j have
    the same shape and dtype, and exactly one call names either, naming both in an
    element-wise kernel as whole blocks of equal ld at the same offset, an offset in which
    every loop variable of the nest appears (so no two iterations visit one block)."""
    pairs = set()
    tensors = spec.tensors
    letters = set(LETTERS[:len(spec.loops)])
    for w in written:
        for j in range(len(tensors)):
            if j == w or tensors[j].shape != tensors[w].shape \
                    or tensors[j].dtype != tensors[w].dtype:
                continue
            touching = [call for call in spec.calls if _slots(call, w, j)]
            if len(touching) == 1 and _same_blocks(touching[0], w, j) \
                    and _visits_once(_slots(touching[0], w, j)[0][0].offset, letters):
                pairs.add((w, j))
    return frozenset(pairs)


def _slots(call, w: int, j: int) -> list:
    """The (Address, operand) pairs of call naming tensor w or j."""
    return [(arg, op) for arg, op in zip(call.args, raw_operands(call.spec))
            if isinstance(arg, Address) and arg.tensor in (w, j)]


def _same_blocks(call, w: int, j: int) -> bool:
    """Whether call touches w and j only in the in-place way."""
    slots = _slots(call, w, j)
    if call.spec.family == "brgemm" or call.spec.info.kind not in _IN_PLACE_KINDS:
        return False
    if {arg.tensor for arg, _ in slots} != {w, j}:
        return False
    return (len({arg.offset for arg, _ in slots}) == 1
            and all(op.layout == "block" for _, op in slots)
            and len({op.ld for _, op in slots}) == 1)


def _visits_once(offset, letters) -> bool:
    """Whether every loop letter is a term of its own in offset (none inside a floor
    division): distinct iterations then reach distinct blocks, for nests that tile."""
    own = {var for var, _ in offset.terms if isinstance(var, str)}
    floors = [var for var, _ in offset.terms if not isinstance(var, str)]
    return letters <= own and not any(
        isinstance(v, str) and v in letters for f in floors for v, _ in f.inner.terms)
