"""Checks of the paths a training job writes, made before anything starts."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def check_paths(cfg: Any) -> None:
    """Fail now, with a ``ValueError`` naming the path, if the log file or the checkpoint root
    cannot be written; creates them (and their parents) as training would."""
    if cfg.log_file is not None:
        log = Path(cfg.log_file)
        if log.is_dir():
            raise ValueError(f"--log-file {log} is a directory; give the path of a file")
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.open("a").close()
        except OSError as exc:
            raise ValueError(f"--log-file {log} cannot be written: {exc.strerror or exc}") from None
    if cfg.ckpt_dir is not None:
        root = Path(cfg.ckpt_dir)
        if root.exists() and not root.is_dir():
            raise ValueError(f"--ckpt-dir {root} is not a directory")
        try:
            root.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=root).close()
        except OSError as exc:
            raise ValueError(f"--ckpt-dir {root} cannot be written: {exc.strerror or exc}") from None
