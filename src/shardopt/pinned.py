"""Page-locked host memory of exactly the size asked for.

torch's ``pin_memory=True`` rounds every block up to a power of two and caches it (a 4.9 GiB
tensor locks 8 GiB); for the few large, long-lived host tensors of loads, offload and
background saves this allocates ordinary host memory and ``cudaHostRegister``s its pages.
:meth:`PinnedBuffer.release` unregisters before the memory can go away (``__del__`` calls it
too); whoever issues asynchronous copies from or to a buffer waits for them before releasing.
"""

from __future__ import annotations

import mmap
import os
import sys
import warnings

import torch


class PinnedBuffer:
    """``numel`` elements of ``dtype`` in host memory, page-locked when CUDA is available.

    ``shared``: the memory is a memfd mapping (Linux) whose descriptor, :attr:`fd`, another
    process can map to read it (the writer process of asynchronous saves,
    :mod:`.checkpoint.writer_process`); closed by :meth:`release`. ``lock=False``: not
    page-locked (memory no GPU copies from)."""

    def __init__(self, numel: int, dtype: torch.dtype, shared: bool = False,
                 lock: bool = True) -> None:
        self.fd: int | None = None
        self._map: mmap.mmap | None = None
        if shared and numel:
            nbytes = numel * dtype.itemsize
            self.fd = os.memfd_create("shardopt-snapshot", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes)
            with warnings.catch_warnings():  # the mapping is writable; torch asks anyway
                warnings.simplefilter("ignore")
                self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel)
        else:
            self.tensor = torch.empty(numel, dtype=dtype)
        self._registered = 0  # the address registered, 0 when none
        if numel and lock and torch.cuda.is_available():
            ptr, nbytes = self.tensor.data_ptr(), numel * dtype.itemsize
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(ptr, nbytes, 0)
            if err != cudart.cudaError.success:
                raise RuntimeError(
                    f"cudaHostRegister of {nbytes} bytes of host memory failed "
                    f"({cudart.cudaGetErrorString(err)}); is the locked-memory limit "
                    "(ulimit -l) too low for this much page-locked host memory?"
                )
            self._registered = ptr

    @property
    def pinned(self) -> bool:
        return self._registered != 0

    def release(self) -> None:
        """Unlock the pages (the memory stays valid while referenced). Idempotent. A
        failed unlock is reported as a :class:`ResourceWarning` (the pages then stay
        locked until the process exits), except at interpreter shutdown."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # the mapping stays while the tensor references it
        ptr, self._registered = self._registered, 0
        if not ptr:
            return
        try:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostUnregister(ptr)
            failed = err != cudart.cudaError.success
            reason = cudart.cudaGetErrorString(err) if failed else ""
        except Exception:  # noqa: BLE001 - interpreter shutdown: the runtime is gone too
            return
        if failed and not sys.is_finalizing():
            nbytes = self.tensor.numel() * self.tensor.element_size()
            warnings.warn(f"cudaHostUnregister of {nbytes} bytes of host memory at {ptr:#x} "
                          f"failed ({reason}); the pages stay locked until the process exits",
                          ResourceWarning, stacklevel=2)

    def __del__(self) -> None:
        self.release()
