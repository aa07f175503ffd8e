"""Page-locked host memory of exactly the size asked for, locked at once or piece by piece.

``pin_memory=True`` goes through torch's caching host allocator, which rounds every block up
to a power of two and keeps it after the tensor is gone; the large, long-lived host tensors
of ``low_memory_resume``, ``offload()`` and asynchronous saves instead page-lock exactly their
pages with ``cudaHostRegister``: at construction, or (:meth:`PinnedBuffer.lock_to`) in
segments of :data:`SEGMENT_BYTES` just ahead of their first use. Rules: memory is unregistered
before it can go (:meth:`~PinnedBuffer.release`, also from ``__del__``); whoever issues
asynchronous copies from or to a buffer waits for them before releasing it; a copy into a
buffer locked in segments stays within one segment.
"""

from __future__ import annotations

import mmap
import os
import sys
import warnings

import torch

# What PinnedBuffer.lock_to registers at a time.
SEGMENT_BYTES = 256 << 20


class PinnedBuffer:
    """``numel`` elements of ``dtype`` in host memory, page-locked when CUDA is available.
    ``shared``: a memfd mapping (Linux) whose descriptor :attr:`fd` another process can map
    (the writer process of asynchronous saves); ``lock=False``: not locked at construction."""

    def __init__(self, numel: int, dtype: torch.dtype, shared: bool = False,
                 lock: bool = True) -> None:
        self.fd: int | None = None
        self._map: mmap.mmap | None = None
        self.nbytes = numel * dtype.itemsize
        if shared and numel:
            self.fd = os.memfd_create("shardopt-snapshot", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.nbytes)
            self._map = mmap.mmap(self.fd, self.nbytes)
            with warnings.catch_warnings():  # the mapping is writable; torch asks anyway
                warnings.simplefilter("ignore")
                self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel)
        else:
            self.tensor = torch.empty(numel, dtype=dtype)
        self._registered: dict[int, int] = {}  # address -> bytes of each locked range
        self.locked_bytes = 0  # the first bytes locked so far
        if lock:
            try:
                self._register(self.nbytes)
            except BaseException:  # nothing stays open or locked behind the error
                self.release()
                raise

    @property
    def pinned(self) -> bool:
        """Whether the whole buffer is page-locked."""
        return self.nbytes > 0 and self.locked_bytes == self.nbytes

    def lock_to(self, nbytes: int) -> None:
        """Page-lock the buffer's first ``nbytes`` (rounded up to a whole number of
        :data:`SEGMENT_BYTES` from its start, at most the buffer), one segment per
        ``cudaHostRegister``; a no-op without CUDA or where already locked."""
        end = min(self.nbytes, -(-nbytes // SEGMENT_BYTES) * SEGMENT_BYTES)
        while self.locked_bytes < end:
            self._register(min(SEGMENT_BYTES, end - self.locked_bytes))

    def _register(self, nbytes: int) -> None:
        if not nbytes or not torch.cuda.is_available():
            return
        ptr = self.tensor.data_ptr() + self.locked_bytes
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if err != cudart.cudaError.success:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes of host memory failed "
                f"({cudart.cudaGetErrorString(err)}); is the locked-memory limit "
                "(ulimit -l) too low for this much page-locked host memory?"
            )
        self._registered[ptr] = nbytes
        self.locked_bytes += nbytes

    def release(self) -> None:
        """Unlock the pages and close :attr:`fd` (the memory stays valid while referenced).
        Idempotent; a failed unlock is a :class:`ResourceWarning`, except at shutdown."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # the mapping stays while the tensor references it
        ranges, self._registered, self.locked_bytes = self._registered, {}, 0
        for ptr, nbytes in ranges.items():
            try:
                cudart = torch.cuda.cudart()
                err = cudart.cudaHostUnregister(ptr)
                failed = err != cudart.cudaError.success
                reason = cudart.cudaGetErrorString(err) if failed else ""
            except Exception:  # noqa: BLE001 - interpreter shutdown: the runtime is gone too
                return
            if failed and not sys.is_finalizing():
                warnings.warn(f"cudaHostUnregister of {nbytes} bytes of host memory at "
                              f"{ptr:#x} failed ({reason}); the pages stay locked until the "
                              "process exits", ResourceWarning, stacklevel=2)

    def __del__(self) -> None:
        self.release()
