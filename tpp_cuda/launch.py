"""The launch geometry of a generated CUDA kernel.

Every generator module of `tpp_cuda` (eltwise, transform, brgemm) offers, for each spec it
supports: `kernel_name(spec)`, `source(spec)` and `launch(spec) -> Launch`. The runtime compiles
the source, looks the kernel up by name and launches it with this geometry; the emulator used by
the tests (no GPU needed) runs the same source with the same geometry.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class Launch:
    grid: tuple      # (x, y, z) blocks
    block: tuple     # (x, y, z) threads per block
    shared_bytes: int = 0   # dynamic shared memory

    def __post_init__(self):
        if len(self.grid) != 3 or len(self.block) != 3:
            raise ValueError("grid and block are (x, y, z) triples")
        gx, gy, gz = self.grid
        if not (1 <= gx <= MAX_GRID_X and 1 <= gy <= MAX_GRID_YZ and 1 <= gz <= MAX_GRID_YZ):
            raise ValueError(f"grid {self.grid} is outside CUDA's limits")
        threads = self.block[0] * self.block[1] * self.block[2]
        if not 1 <= threads <= 1024:
            raise ValueError(f"block {self.block} has {threads} threads (1..1024)")

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


def grid_stride_2d(rows: int, cols: int, threads: int = 256, max_blocks: int = 4096) -> Launch:
    """A geometry for a 2-D grid-stride loop: x over `cols` work items (a warp's consecutive
    threads take consecutive columns, so loads coalesce), y over `rows`. At most `max_blocks`
    blocks: the kernels loop over whatever the grid does not cover."""
    bx = min(threads, 32 * ((cols + 31) // 32))
    by = max(1, min(threads // bx, rows))
    gx = min((cols + bx - 1) // bx, max_blocks)
    gy = min((rows + by - 1) // by, MAX_GRID_YZ, max(1, max_blocks // gx))
    return Launch((gx, gy, 1), (bx, by, 1))
