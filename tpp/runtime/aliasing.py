"""Which tensors of a loop nest may be given the same memory: a tensor the nest writes must not
share memory with another tensor of the call (CompiledNest checks the addresses of every call),
except as the identical array where every call that touches both is element-wise at the same
offsets (each element is then read before it is written, by the same kernel)."""
from __future__ import annotations

from ..core.loop_spec import Address, LoopNestSpec, raw_operands

_IN_PLACE_KINDS = ("map", "map_inv", "compare", "equation")


def aliasable_pairs(spec: LoopNestSpec, written) -> frozenset:
    """Pairs (w, j), w a written tensor, that may be given the identical array: w and j have
    the same shape and dtype, and every call that names either names both, in an element-wise
    kernel, as whole blocks of equal ld at the same offset; each element is then read before it
    is written, by the same call, as a primitive's own in-place rule allows."""
    pairs = set()
    tensors = spec.tensors
    for w in written:
        for j in range(len(tensors)):
            if j != w and tensors[j].shape == tensors[w].shape \
                    and tensors[j].dtype == tensors[w].dtype \
                    and all(_same_blocks(call, w, j) for call in spec.calls):
                pairs.add((w, j))
    return frozenset(pairs)


def _same_blocks(call, w: int, j: int) -> bool:
    """Whether call leaves tensors w and j alone, or touches both only in the in-place way."""
    slots = [(arg, op) for arg, op in zip(call.args, raw_operands(call.spec))
             if isinstance(arg, Address) and arg.tensor in (w, j)]
    if not slots:
        return True
    if call.spec.family == "brgemm" or call.spec.info.kind not in _IN_PLACE_KINDS:
        return False
    if {arg.tensor for arg, _ in slots} != {w, j}:
        return False
    return (len({arg.offset for arg, _ in slots}) == 1
            and all(op.layout == "block" for _, op in slots)
            and len({op.ld for _, op in slots}) == 1)
