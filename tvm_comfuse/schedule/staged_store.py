"""Output tiles that leave the Hopper kernels by TMA: registers -> swizzled shared memory -> ``cp.async.bulk.tensor``.

Why: a wgmma accumulator fragment stored straight to global memory goes out as 4- or 8-byte
pieces of eight rows per warp instruction (each row's two columns of an 8-column block), eight
L1 wavefronts an instruction, and the stores hold the warps until they issue. On the H200
(session 15) staging FFN1's output this way took its GEMM + GELU kernel from 73.3 to 48.1 us
(4096 x 768 -> 3072), and the rebuilt back-to-back GEMM, staged and persistent, from session 8's
151 to 80 us (65536 x 1024 -> 64 -> 1024); the post-norm kernel's epilogue with its residual
loaded and its output stored by TMA was 24-31% faster than with both in registers (session 9).
Here each thread writes its accumulators once into a staging buffer in
TMA's 128-byte swizzle (16-byte chunk ``c`` of row ``r`` at ``c ^ r % 8``: the eight rows of a
warp's store land in distinct banks), and one thread issues a TMA store per 64-row box of
128-byte rows (64 columns of 16-bit values, 32 of float32), which the TMA unit clips at the
tensor's edge (rows past M are not written) and completes while the warps go on.

A consumer warpgroup stages its own ``64 x cols`` slice: ``O[buf, wg, box, row, col]``, ``buf``
one of the buffers a kernel alternates (before rewriting one, the warpgroup's thread 0 waits
until the store before last has read it), and synchronises on a named barrier of its own.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .wgmma_mainloop import fragment
from .wgmma_postnorm import TMA_STORE

#: First named barrier of the staging warpgroups (one each: 0 is ``__syncthreads``, 1 the
#: consumer warpgroups' together, :data:`~.wgmma_mainloop.CONSUMER_BARRIER`).
STAGE_BARRIER = 2


def size(dtype: str) -> int:
    return tvm.DataType(dtype).bits // 8


def box_cols(dtype: str) -> int:
    """Columns of one staged box: a 128-byte swizzled row."""
    return 128 // size(dtype)


def staged_bytes(rows: int, cols: int, dtype: str, buffers: int = 1) -> int:
    """Shared memory of ``buffers`` staged ``rows x cols`` tiles."""
    return buffers * rows * cols * size(dtype)


def buffer_shape(buffers: int, warpgroups: int, cols: int, dtype: str) -> list:
    """The staging buffer's shape, ``[buffers, warpgroups, boxes, 64, box columns]``."""
    return [buffers, warpgroups, cols // box_cols(dtype), 64, box_cols(dtype)]


def staged_at(at, dtype: str) -> tuple:
    """``(box, row, col)`` of element ``at = (row, col)`` of a warpgroup's ``64 x cols`` tile in
    its staging buffer: 16-byte chunk ``c`` of a box's row ``r`` at ``c ^ r % 8``."""
    (lrow, lcol), box, chunk = at, box_cols(dtype), 16 // size(dtype)
    return lcol // box, lrow, (lcol % box // chunk ^ lrow % 8) * chunk + lcol % chunk


def staged_store(cols: int, dtype: str, value, buffers: int = 2, issue: bool = True):
    """The tirx macro ``store(out_map, O, P, acc, wg, tw, row0, col0, buf)``: thread ``tw`` of
    consumer warpgroup ``wg`` writes ``value(P, acc[i], row, col, here)`` (Python, at parse time: the
    epilogue's chain on accumulator ``i`` of its ``64 x cols`` fragment tile, in ``dtype``, at
    global ``(row, col)`` from ``(row0, col0)``; ``here`` is what the element's place in the
    buffer holds before, a tile staged there) into buffer ``buf`` of ``O`` (shaped by
    :func:`buffer_shape`), and the warpgroup's thread 0 stores it to the tensor of ``out_map``
    (encoded with 64-row boxes of :func:`box_cols` columns) by TMA, one bulk group a tile
    (:func:`tma_store`; not with ``issue`` False: the kernel rewrites the staged tile first and
    issues the store itself). ``cols`` is a multiple of the box columns; ``buffers`` the
    warpgroup alternates (1: it waits until its last store has read the buffer before rewriting it)."""
    send = tma_store(cols, dtype)

    # pylint: disable=invalid-name
    @T.macro
    def store(out_map, O, P, acc, wg, tw, row0, col0, buf):
        if tw == 0:
            T.ptx["cp.async.bulk.wait_group.read"](buffers - 1)  # the store that last used this buffer has read it
        T.ptx["bar.sync"](T.uint32(STAGE_BARRIER) + T.cast(wg, "uint32"), 128)
        for q in T.unroll(cols // 4):  # accumulators 2q, 2q + 1: one row's adjacent columns
            for v in T.vectorized(2):
                lrow, lcol = T.meta_var(fragment(tw, 2 * q + v))
                at = T.meta_var((buf, wg, *staged_at((lrow, lcol), dtype)))
                O[at] = value(P, acc[2 * q + v], row0 + lrow, col0 + lcol, O[at])
        if issue:
            send(out_map, O, wg, tw, row0, col0, buf)

    return store


def tma_store(cols: int, dtype: str):
    """The tirx macro ``send(out_map, O, wg, tw, row0, col0, buf)``: once every thread of
    consumer warpgroup ``wg`` has written its share of buffer ``buf`` of ``O``, its thread 0
    stores the ``64 x cols`` tile to ``(row0, col0)`` of the tensor of ``out_map`` by TMA, one
    bulk group."""
    box = box_cols(dtype)

    # pylint: disable=invalid-name
    @T.macro
    def send(out_map, O, wg, tw, row0, col0, buf):
        T.ptx["fence.proxy.async.shared::cta"]()  # the writes, visible to the TMA unit
        T.ptx["bar.sync"](T.uint32(STAGE_BARRIER) + T.cast(wg, "uint32"), 128)
        if tw == 0:
            for b in T.unroll(cols // box):
                T.ptx[TMA_STORE](T.address_of(out_map), col0 + b * box, row0, O.ptr_to([buf, wg, b, 0, 0]))
            T.ptx["cp.async.bulk.commit_group"]()

    return send


def drain():
    """The tirx macro ``drain(tw)``: a staging warpgroup's thread 0 waits until its stores have
    read their buffers (the CTA's shared memory must outlive them)."""

    @T.macro
    def wait(tw):
        if tw == 0:
            T.ptx["cp.async.bulk.wait_group.read"](0)

    return wait
