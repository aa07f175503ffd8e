"""Entry point of the writer process of asynchronous saves (:mod:`.writer_process`).

Run as a script, it loads :mod:`.transfer` from its file (the package would import torch),
maps the shared buffers the parent sends, writes the files each request lists through the
block writer and answers their records or the error (the messages:
docs/async_save.md). It exits when the socket closes, and within ``PARENT_POLL_S`` of its
parent's death, even mid-write.
"""

import importlib.util
import mmap
import os
import socket
import sys
import threading
import time


def _load_transfer():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transfer.py")
    spec = importlib.util.spec_from_file_location("_shardopt_transfer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


transfer = _load_transfer()
PARENT_POLL_S = 0.05  # how often the process checks that its parent lives


def write_all(request: dict, maps: dict, blobs: list) -> dict:
    """Every file of a ``write`` request at once, one thread each; their records. The
    earliest file that fails is raised, named."""
    records = {}

    def data(src):  # a part's bytes as the request names them: zeros, a blob, a mapping
        if src is None:
            return None
        if isinstance(src, dict):
            return memoryview(blobs[src["blob"]])
        buf, at = src
        return maps[buf][at:]

    def one(file: list, _slot: int) -> None:
        name, parts, size = file
        layout = transfer.Parts([transfer.Part(s, n, data(src)) for s, n, src in parts])
        try:
            records[name] = transfer.write_file(
                os.path.join(request["dir"], name), size, request["block_bytes"],
                request["block_bytes"],
                lambda lo, hi: [v for cut in layout.cuts(lo, hi) for v in transfer.cut_views(cut)])
        except BaseException as e:  # noqa: BLE001 - answered to the parent
            raise OSError(f"{name}: {type(e).__name__}: {e}") from None

    transfer.run_parallel(request["files"], one, len(request["files"]))
    return records


def _watch(parent: int) -> None:
    """Exit at once when the parent is gone (reparented), even in the middle of a write:
    its save can never commit. (``PR_SET_PDEATHSIG`` would fire when the parent's thread
    that started this process ends.)"""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main(fd: int, parent: int) -> None:
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    sock = socket.socket(fileno=fd)
    maps: dict = {}
    failed: dict = {}  # buffers whose mapping failed: the reason
    while True:
        try:
            msg, blobs = transfer.recv(sock)
        except EOFError:
            return
        kind = msg[0]
        if kind == "map":
            _, buf, nbytes = msg
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            try:
                maps[buf] = memoryview(mmap.mmap(fds[0], nbytes, prot=mmap.PROT_READ)) \
                    if nbytes else memoryview(b"")
            except OSError as e:  # answered at the write that needs it
                failed[buf] = f"mapping {nbytes} bytes of the snapshot failed: {e}"
            finally:
                os.close(fds[0])
        elif kind == "unmap":
            maps.pop(msg[1], None)
            failed.pop(msg[1], None)
        elif kind == "write":
            try:
                bad = [failed[b] for b in msg[1]["buffers"] if b in failed]
                if bad:
                    raise OSError(bad[0])
                transfer.send(sock, ["ok", write_all(msg[1], maps, blobs)])
            except BaseException as e:  # noqa: BLE001
                transfer.send(sock, ["error", f"{type(e).__name__}: {e}"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
