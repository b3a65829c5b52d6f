"""Read a config written for AReaL: translate each AReaL key to its Flywheel meaning.

A file is read as an AReaL config when it holds keys that only AReaL has (`saver`,
`cluster.n_gpus_per_node`, `actor.backend`, ...; see `areal_markers`) or when the user
says so (`flywheel run --from areal`). `translate` then works on the resolved tree
(interpolation done, so `${actor.backend}` has its value) and returns the Flywheel tree
plus one `Translation` row per AReaL key it touched:

- `mapped`: the value now sets a Flywheel key (`actor.backend: fsdp:d4` sets
  `trainer.n_ranks: 4`; `saver.freq_steps` sets `trainer.save_freq_steps`, ...);
- `ignored`: accepted and not used, with the reason (cluster-only and engine-internal keys).

Keys that Flywheel and AReaL share with one meaning pass through untouched. A key known to
neither stays in the tree, so validation reports it (a typo must still fail).

The field names of AReaL's config classes (`fields`) are those of `areal/api/cli_args.py`
(AReaL 2.0, commit cbff54d): which keys exist, not what they do here.

The package holds one job per module: `fields` (AReaL's names), `reasons` (why a key is not
used), `detect` (is this file AReaL's?), `allocation` (`fsdp:d4` strings), `tree` (the tree a
rule edits), `rules_*` (the translation rules by topic), `translate` (the rules in order) and
`report` (the rows and their table). A new rule is a function of a `TreeEditor` added to
`translate.RULES`.
"""

from .allocation import Allocation, parse_allocation
from .detect import areal_hint, areal_markers
from .fields import AREAL_FIELDS
from .reasons import COLLISIONS
from .report import IGNORED, MAPPED, Translation, format_table
from .translate import RULES, translate

__all__ = [
    "AREAL_FIELDS",
    "COLLISIONS",
    "IGNORED",
    "MAPPED",
    "RULES",
    "Allocation",
    "Translation",
    "areal_hint",
    "areal_markers",
    "format_table",
    "parse_allocation",
    "translate",
]
