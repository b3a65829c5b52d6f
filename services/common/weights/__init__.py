"""The weight-update format shared by the trainer (sender) and the rollout (receiver).

A weight update is a set of named tensors (the Hugging Face parameter names of the policy,
tied parameters once) plus a manifest: the version the weights become and a SHA-256 checksum.
The same checksum is computed on both sides whatever the transport, so a receiver can refuse
a torn, truncated or corrupted update and keep serving the weights it had. One module per job:

- `manifest`: the tensor specs, the checksum and the manifest every transport carries, and
  the size bound a receiver checks before it allocates.
- `disk`: `save_weights(dir, tensors, version)` writes safetensors files and a JSON manifest;
  `load_weights(dir)` reads and verifies them.
- `distributed`: tensors are flattened into byte buckets (`make_buckets`) and broadcast from
  the trainer's rank 0 over a group made by `WeightsGroup` (gloo on CPU, NCCL on GPU);
  `send_buckets` / `recv_buckets` run the two sides with the same bucket plan.
- `grpc_stream`: `iter_weight_chunks` cuts the tensors into `WeightChunk` messages (the first
  one carries the manifest); `WeightAssembler` puts them back together and verifies them.

Tensors always travel as raw little-endian bytes with dtype and shape, never pickled. Import
from the module that does the job (`services.common.weights.disk`, ...): the transports
depend on `manifest`, never on each other.
"""
