"""The ground floor: what several services share, importable without torch or grpc.

* `services.core.types`: trajectories and groups, sampling parameters and completions,
  score requests and results;
* `services.core.contracts`: one `Protocol` per extension point (`InferenceEngine`,
  `RewardFn`, `RolloutWorkflow`, `GroupFilter`, `Surrogate`, ...);
* `services.core.plugins`: the dotted-path loader and `Registry`;
* `services.core.filters`: the group filters and their one resolution;
* `services.core.errors`: errors a caller acts on by type across a service boundary.

This package imports the standard library, numpy and nothing else of the project
(`make lint` checks it with the import contracts in `.importlinter`). User code imports the
same names from `services.api`.
"""
