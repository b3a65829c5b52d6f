"""A published weights folder checked from its safetensors headers alone.

SGLang reads the weight files itself, in its own container; the rollout only hands it the
folder. Reading the tensors here to check them would put a whole model (billions of float32
parameters) beside SGLang's; the headers say enough to refuse a torn, truncated or
mislabelled folder before SGLang is asked to load it.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.common.weights.disk import weights_files
from services.common.weights.manifest import WeightManifest, WeightsError

# Bytes per element of the safetensors dtype names (the format's `dtype` field).
_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def check_weights_headers(
    path: str | os.PathLike[str], expected: WeightManifest | None
) -> tuple[list[str], WeightManifest]:
    """Tensor names and manifest of a published weights folder, checked from the safetensors
    headers alone: no tensor is read into memory (SGLang reads the files itself, so a
    float32 model of many billion parameters never passes through the rollout).

    Checked: the manifest agrees with `expected` (version, checksum), every file it names
    exists and its header is whole and covers the file exactly (safetensors refuses a
    truncated file when it opens it), no name repeats, and the tensor count and byte total
    match the manifest. Not checked: the checksum of the data, which would mean reading
    every byte; the trainer writes each file whole and the manifest last."""
    from safetensors import SafetensorError, safe_open

    directory = Path(path)
    manifest, files = weights_files(directory, expected)
    names: list[str] = []
    total = 0
    for f in files:
        try:
            with safe_open(str(f), "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    sl = fh.get_slice(name)
                    size = _SAFETENSORS_ITEMSIZE.get(sl.get_dtype())
                    if size is None:
                        raise WeightsError(f"{f}: tensor {name!r} has dtype {sl.get_dtype()}")
                    numel = 1
                    for d in sl.get_shape():
                        numel *= int(d)
                    total += numel * size
                    names.append(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, WeightsError):
                raise
            raise WeightsError(f"{f} is unreadable (corrupt or truncated): {exc}") from exc
    if len(set(names)) != len(names):
        raise WeightsError(f"{directory}: a tensor name appears in two files")
    if len(names) != manifest.num_tensors:
        raise WeightsError(
            f"partial update: {directory} holds {len(names)} tensors, "
            f"the manifest says {manifest.num_tensors}"
        )
    if manifest.total_bytes and total != manifest.total_bytes:
        raise WeightsError(
            f"{directory} holds {total} bytes of tensors, the manifest says {manifest.total_bytes}"
        )
    return names, manifest
