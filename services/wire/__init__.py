"""The wire layer: how the services talk to each other, and nothing of how they work.

It holds each service's typed gRPC client (`buffer_client`, `reward_client`,
`rollout_client`, `trainer_client`), the plain types those clients return
(`rollout_types`) and the buffer's hand-written message envelopes (`buffer_envelopes`,
shared by its client and its servicer). With the generated stubs (`flywheel_proto`) and the
codec (`services.common.codec`) it is all one service may import of another: a service that
needs the buffer imports `services.wire.buffer_client`, never `services.buffer.*`. The
import contracts in `.importlinter` check this; docs/architecture.md draws the layers.

It imports `services.core` and `services.common` only.
"""
