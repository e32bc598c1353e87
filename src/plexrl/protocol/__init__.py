"""The wire protocol: msgspec messages, calls and results, and zero-copy array framing."""

from plexrl.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, Codec, rid_of
from plexrl.protocol.messages import PROTOCOL_VERSION

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "Codec", "rid_of"]
