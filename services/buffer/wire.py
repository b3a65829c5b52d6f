"""The buffer's hand-written envelopes moved to `services.wire.buffer_envelopes` (the wire
layer, which every service may import); this path re-exports it for the code and plugins
that import it from here."""

from services.wire.buffer_envelopes import (
    encode_claim_response,
    encode_put_many,
    encode_put_request,
    put_group_bytes,
    put_many_group_bytes,
    varint,
)

__all__ = [
    "encode_claim_response",
    "encode_put_many",
    "encode_put_request",
    "put_group_bytes",
    "put_many_group_bytes",
    "varint",
]
