"""Framing: a message is one msgpack frame plus one zero-copy frame per large numpy array in it.

An array field is encoded in the msgpack body as ``[dtype, shape, frame_index]`` and its bytes
travel as frame ``1 + frame_index`` (the pattern of vLLM's ``serial_utils``). Arrays under
``INLINE_BYTES`` travel inside the body as ``[dtype, shape, bytes]``: for a handful of token ids
an extra frame costs more than the copy it saves. Decoding checks the
size limit, then the protocol version, then decodes with one typed decoder: anything that does
not fit the schema becomes a :class:`MalformedMessageError`. Never pickle.

A ``Codec`` keeps per-call state, so each thread or task that decodes needs its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from plexrl.errors import MalformedMessageError, MessageTooLargeError, PlexError, ProtocolVersionError
from plexrl.protocol.messages import PROTOCOL_VERSION, Header

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
INLINE_BYTES = 1024
ALLOWED_DTYPES = frozenset(
    np.dtype(d).str for d in ("int8", "int32", "int64", "uint8", "float16", "float32", "float64", "bool")
)

Frame = bytes | memoryview


def _buffer(frame: Any) -> memoryview:
    """The bytes of a frame as received (``zmq.Frame`` with copy=False) or as sent."""
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


class Codec(Generic[T]):
    """Encodes any message; decodes messages of the union ``t``."""

    def __init__(self, t: Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, copy_arrays: bool = False) -> None:
        self.max_bytes = max_bytes
        self.copy_arrays = copy_arrays  # True where arrays must outlive the frames or be writable
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(t, dec_hook=self._dec_hook)
        self._header = msgspec.msgpack.Decoder(Header)
        self._out: list[Frame] = []
        self._in: Sequence[memoryview] = ()

    # -- encode --------------------------------------------------------------------------------

    def encode(self, msg: msgspec.Struct) -> list[Frame]:
        self._out = [b""]
        try:
            self._out[0] = self._encoder.encode(msg)
            frames, self._out = self._out, []
        finally:
            self._out = []
        size = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        if size > self.max_bytes:
            raise MessageTooLargeError(
                f"message is {size} bytes, over the {self.max_bytes}-byte limit: split the batch into "
                "smaller calls (or raise max_message_bytes on both sides)"
            )
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            if arr.dtype.str not in ALLOWED_DTYPES:
                raise TypeError(f"arrays of dtype {arr.dtype} cannot be sent; use int32/int64/float32")
            if arr.nbytes < INLINE_BYTES:
                return (arr.dtype.str, arr.shape, arr.tobytes())
            self._out.append(arr.reshape(-1).view(np.uint8).data)
            return (arr.dtype.str, arr.shape, len(self._out) - 2)
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot send objects of type {type(obj).__name__}")

    # -- decode --------------------------------------------------------------------------------

    def decode(self, frames: Sequence[Any]) -> T:
        """Decode one message; raises a ``PlexError`` whose ``rid`` attribute names the request."""
        if not frames:
            raise MalformedMessageError("empty message")
        bufs = [_buffer(f) for f in frames]
        size = sum(b.nbytes for b in bufs)
        header = self._read_header(bufs[0])
        if size > self.max_bytes:
            raise _with_rid(
                MessageTooLargeError(f"message is {size} bytes, over the {self.max_bytes}-byte limit"), header.rid
            )
        if header.v != PROTOCOL_VERSION:
            raise _with_rid(
                ProtocolVersionError(
                    f"peer speaks plexrl protocol v{header.v}, this side speaks v{PROTOCOL_VERSION}: "
                    "install the same plexrl version on clients, coordinator and workers"
                ),
                header.rid,
            )
        self._in = bufs[1:]
        try:
            return self._decoder.decode(bufs[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _with_rid(MalformedMessageError(f"malformed message: {e}"), header.rid) from None
        finally:
            self._in = ()

    def _read_header(self, body: memoryview) -> Header:
        try:
            return self._header.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MalformedMessageError(f"not a plexrl message (no version/request id): {e}") from None

    def _dec_hook(self, t: type, obj: Any) -> Any:
        if t is not np.ndarray:
            raise TypeError(f"unsupported type {t}")
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("array reference must be [dtype, shape, frame or bytes]")
        dtype, shape, index = obj
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
            raise ValueError(f"array dtype {dtype!r} is not allowed")
        if isinstance(index, bytes):
            buf = memoryview(index)
        elif isinstance(index, int) and 0 <= index < len(self._in):
            buf = self._in[index]
        else:
            raise ValueError(f"array frame {index!r} does not exist")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError("array shape must be a list of non-negative ints")
        dt = np.dtype(dtype)
        if math.prod(shape) * dt.itemsize != buf.nbytes:
            raise ValueError(f"array of shape {shape} and dtype {dtype} does not match its {buf.nbytes}-byte frame")
        arr = np.frombuffer(buf, dtype=dt).reshape(shape)
        return arr.copy() if self.copy_arrays else arr


def _with_rid(err: PlexError, rid: int) -> PlexError:
    err.rid = rid  # type: ignore[attr-defined]
    return err


def rid_of(err: BaseException) -> int:
    """The request id a decode error belongs to (0 when it could not be read)."""
    return int(getattr(err, "rid", 0))
