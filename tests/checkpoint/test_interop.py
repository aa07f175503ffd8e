"""What other readers see in a checkpoint, exactly as docs/format.md ("Interop") claims.

* ``safetensors``: every tensor is a flat 1-D chunk; a param split over ranks is in pieces
  that only the ``saved_offsets`` metadata puts back together, and no file has its shape.
* DCP's ``HuggingFaceStorageReader``: every key is a flat tensor of the full numel, so it loads
  into flat destinations only (a destination of the param's shape is refused), and its
  metadata also lists the RNG files' keys, one overlapping chunk per saving rank.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors import safe_open

from helpers.checks import exported



def _chunks(saved, infos: dict[str, list[dict]] | None = None
            ) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Every key's (offset, tensor) pieces, read with safetensors alone (and into ``infos``
    each piece's sharding metadata)."""
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for f in sorted(saved.path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            info = json.loads(st.metadata()["DCP_SHARDING_INFO"])
            for key in st.keys():
                out.setdefault(key, []).append((info[key]["saved_offsets"][0], st.get_tensor(key)))
                if infos is not None:
                    infos.setdefault(key, []).append(info[key])
    return out


def test_safetensors_sees_flat_chunks_only(saved3, tmp_path):  # noqa: F811
    whole = exported(saved3.path, tmp_path)
    infos: dict[str, list[dict]] = {}
    chunks = _chunks(saved3, infos)
    split = 0
    for key, full in whole.items():
        pieces = sorted(chunks[key], key=lambda c: c[0])
        assert all(t.dim() == 1 for _, t in pieces), key
        if full.dim() > 1:  # no file says what the shape is: not the tensors, not the metadata
            shape = list(full.shape)
            assert all(shape not in info.values() for info in infos[key]), (key, infos[key])
        split += len(pieces) > 1
        assert torch.equal(torch.cat([t for _, t in pieces]), full.reshape(-1)), key
    assert split > 0  # some tensors really are in pieces from several ranks


def _dcp_load(saved, sd: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(saved.path)), no_dist=True)


def test_dcp_reader_loads_into_flat_destinations_only(saved3, tmp_path):  # noqa: F811
    whole = exported(saved3.path, tmp_path)
    key = "up.weight.exp_avg"
    assert whole[key].dim() == 2
    flat = {key: torch.empty(whole[key].numel())}
    _dcp_load(saved3, flat)
    assert torch.equal(flat[key], whole[key].reshape(-1))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as refused:
        _dcp_load(saved3, {key: torch.empty_like(whole[key])})
    (why,) = refused.value.failures.values()
    why = why[0] if isinstance(why, tuple) else why  # (exception, traceback) in torch 2.13
    assert isinstance(why, ValueError) and "Size mismatch" in str(why)


def test_dcp_reader_metadata_includes_the_rng_files(saved3):  # noqa: F811
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    md = HuggingFaceStorageReader(str(saved3.path)).read_metadata().state_dict_metadata
    manifest = json.loads((saved3.path / "manifest.json").read_text())
    rng = md["torch_cpu"]
    assert rng.properties.dtype == torch.uint8
    # every saving rank's RNG state, all at offset 0: chunks that overlap
    assert [tuple(c.offsets) for c in rng.chunks] == [(0,)] * manifest["dp_size"]
    params = {k for k in md if k not in ("torch_cpu", "torch_cuda")}
    for fqn, info in manifest["params"].items():
        assert md[fqn].size == torch.Size([math.prod(info["shape"])]), fqn
        params.discard(fqn)
        params -= {f"{fqn}.{n}" for n in ("master_param", "exp_avg", "exp_avg_sq")}
    assert params == set()
