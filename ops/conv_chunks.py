"""Sums split in chunks for the caches: ops.conv's forward and data-gradient nests sum over
input blocks whose weights may not fit one core's L2 cache with the tiles; such a sum is run in
chunks of blocks, an outermost sequential loop of the nest, every tile's share of one chunk
done before the next chunk starts (the first chunk writes each tile, beta 0; the last applies
the epilogue)."""
from __future__ import annotations


# A nest whose weight slice per output block (all its input blocks and taps) is larger than
# WEIGHT_SLICE_BYTES (one 1 MB L2 cannot hold it with the tiles) sums over the input blocks in
# chunks of at most WEIGHT_CHUNK_BYTES, each chunk's pass over every tile done before the
# next, so a chunk stays in the L2 cache while the rows and images reuse it (the whole slice
# was cycled through L2 per row). 3x3 512 @7, batch 4, 2 Zen 5 cores: f32 forward 385 ->
# 500-519 GFLOP/s in 8 chunks (2 chunks: ~470), data gradient 2.26 -> 2.04 ms, the training
# step 8.8-9.7 -> 8.2-8.5 ms. Slices that fit gained nothing in a training step (f32 256 @14,
# 590 KB: level) or lost (bf16 512 @7, 590 KB, in 4 chunks: the data gradient 1.05 -> 1.17 ms).
WEIGHT_SLICE_BYTES = 768 * 1024
WEIGHT_CHUNK_BYTES = 160 * 1024


def weight_chunks(blocks: int, block_bytes: int) -> int:
    """The number of equal chunks of input blocks a nest sums over, one after the other: 1
    when all blocks' weights (block_bytes per block) fit in WEIGHT_SLICE_BYTES, else the fewest
    (a divisor of blocks) whose weights fit in WEIGHT_CHUNK_BYTES (blocks itself when one
    block is larger)."""
    if blocks * block_bytes <= WEIGHT_SLICE_BYTES:
        return 1
    for chunks in range(1, blocks + 1):
        if blocks % chunks == 0 and blocks // chunks * block_bytes <= WEIGHT_CHUNK_BYTES:
            return chunks
    return blocks


def chunk_cases(f, chunks: int) -> list:
    """[(when, first, last)] of a nest summing over `chunks` chunks of input blocks in its loop
    f: the conditions on f under which a call is in the first chunk (whose first BRGEMM
    writes, beta 0) and the last (whose last BRGEMM applies the epilogue)."""
    if chunks == 1:
        return [((), True, True)]
    cases = [((f == 0,), True, False)]
    if chunks > 2:
        cases.append(((f > 0, f < chunks - 1), False, False))
    return cases + [((f == chunks - 1,), False, True)]
