"""The folders an SGLang server reads weight updates from, and the names its model knows.

SGLang loads weights by path, inside its own container: the rollout hands a folder over on
a volume both mount at the same path (`handover_dir`). This module owns that side of an
update, apart from the engine's HTTP calls (`sglang_engine.py`): where handed-over folders
go, how a published folder without a model config is made loadable (links to its
safetensors beside copies of the served model's config), and which tensor names the served
checkpoint has, so misnamed updates are caught before SGLang silently skips them. It reads
safetensors headers and config files only, never the tensors.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.weights.manifest import WeightsError

log = logging.getLogger(__name__)

HF_SIDECAR_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    # A vision-language model's processor: SGLang builds its image processor from them.
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)
"""Files of the served model copied beside linked safetensors so SGLang can load the folder."""


class WeightHandover:
    """Prepares what SGLang reads for an update of the model it serves from `model_path`."""

    def __init__(self, model_path: str, scratch_dir: str | None) -> None:
        self.model_path = model_path
        self.scratch_dir = scratch_dir
        self._names: set[str] | None = None

    def served_names(self) -> set[str]:
        """Tensor names of the checkpoint the server was launched with
        (`model_path/*.safetensors`); empty when it is not readable from here."""
        if self._names is None:
            from safetensors import safe_open

            names: set[str] = set()
            root = Path(self.model_path)
            for f in sorted(root.glob("*.safetensors")) if root.is_dir() else []:
                with safe_open(str(f), "pt") as fh:
                    names.update(fh.keys())
            self._names = names
        return self._names

    def unknown_names(self, names: Sequence[str], *, refuse: bool) -> int:
        """How many of `names` the served model lacks (0 when its names are unreadable).

        SGLang loads the names its model knows and skips the others with only a log line,
        so misnamed weights (a wrapper's prefix, another architecture) would leave the old
        weights serving under the new version. Unknown names are logged; with `refuse`, an
        update none of whose names is known raises `WeightsError` before SGLang sees it."""
        known = self.served_names()
        if not known:
            return 0
        unknown = [n for n in names if n not in known]
        if not unknown:
            return 0
        if refuse and len(unknown) == len(names):
            raise WeightsError(
                f"none of the {len(names)} tensor names is a weight of {self.model_path} "
                f"(e.g. {unknown[0]!r}); SGLang would ignore them all"
            )
        log.warning(
            "SGLang will ignore tensor names its model does not have",
            extra={"count": len(unknown), "names": unknown[:5]},
        )
        return len(unknown)

    def root(self) -> Path:
        """Where prepared folders and streamed weights go: `scratch_dir`, a volume the
        SGLang server mounts at the same path (never this container's private /tmp)."""
        if self.scratch_dir is None:
            raise WeightsError(
                "no scratch_dir: SGLang reads the weights from its own container, so the "
                "rollout must write them where both mount (rollout.sglang.scratch_dir)"
            )
        root = Path(self.scratch_dir)
        root.mkdir(parents=True, exist_ok=True)
        return root

    def scratch(self, prefix: str) -> Path:
        """A new folder under `root()` that a server running as another user can read."""
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=self.root()))
        folder.chmod(0o755)  # mkdtemp's 0700 would hide it from the server
        return folder

    def loadable_dir(self, path: str, version: int) -> tuple[str, Path | None]:
        """The folder SGLang is sent, and what to remove once it has loaded it.

        SGLang loads a folder as a model (`*.safetensors` beside the model's `config.json`).
        A published folder that lacks the config is prepared in `scratch_dir`: relative
        links to its safetensors (they resolve wherever the shared volume is mounted, as
        long as both folders are on it) plus copies of the served model's config,
        tokenizer and processor files. Nothing is read or copied from the tensors."""
        src = Path(path)
        if (src / "config.json").is_file():
            return str(src), None
        dst = self.scratch(f"v{version:08d}-")
        for f in sorted(src.glob("*.safetensors")):
            os.symlink(os.path.relpath(f.resolve(), dst.resolve()), dst / f.name)
        for name in HF_SIDECAR_FILES:
            cand = Path(self.model_path) / name
            if cand.is_file():
                shutil.copy(cand, dst / name)
        return str(dst), dst


def handover_dir(cfg: Any) -> str:
    """`rollout.sglang.scratch_dir`, else `sglang_handover` in the run directory
    (`<cluster.fileroot>/<experiment_name>/<trial_name>`), the folder the rollout writes
    weights for SGLang into and names in `/update_weights_from_disk`."""
    explicit = cfg.rollout.sglang.scratch_dir
    if explicit:
        return str(explicit)
    return os.path.join(
        cfg.cluster.fileroot, cfg.experiment_name, cfg.trial_name, "sglang_handover"
    )


__all__ = ["HF_SIDECAR_FILES", "WeightHandover", "handover_dir"]
