"""Requests off the wire: the KvKeep service's handlers take the bytes of their requests,
and decode them only once the caller is authenticated, within bounds that a request's
method can need.

gRPC's own deserializers would run before any handler (so before authentication), answer
UNKNOWN with the decoder's exception and log its traceback for every undecodable request,
and parse a request whole whatever its size: a repeated field of a few MB becomes tens of
MB of parsed elements before any check of their number. Here each method's request is
held to

- a size in bytes, from the limits the daemon enforces on its fields anyway (the prompt
  limit, stop strings, grammars, labels), within `--max-message-bytes`;
- a number of fields at its top level, each element of a repeated field counting as one
  (at most as many as its limit: MAX_MESSAGES messages, MAX_STOP_STRINGS stop strings,
  the prompt limit's token ids), counted on the wire format without parsing it;

and beyond either, or if its bytes are not a message, it is refused with INVALID_ARGUMENT
before anything is parsed. A repeated field with more elements than its limit (token ids
packed in one field) is refused once parsed, before its elements become Python objects.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import (
    MAX_GRAMMAR_CHARS,
    MAX_LABEL,
    MAX_MESSAGES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
)
from kvkeepd.sessions.tenants import MAX_SALT

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["KvKeep"]

# A field's key and length prefix on the wire (field numbers below 2048, lengths below 2**35).
FIELD_BYTES = 8
# A scalar's value: a varint of at most 10 bytes, or a fixed 8.
SCALAR_BYTES = 10
# A token id, as an element of a packed field or a field of its own (a key and a varint of
# at most 5 bytes: ids are below 2**31).
TOKEN_ID_BYTES = 6
# The characters of a session or checkpoint id (26), of a context policy, with room for ids
# that are refused as malformed by the layers that read them.
ID_BYTES = 1024
# Every UTF-8 character of a text limited in characters takes at most 4 bytes.
UTF8_BYTES = 4
# Room for fields this daemon does not know (a newer client's), which protobuf keeps aside.
UNKNOWN_FIELDS = 64
UNKNOWN_FIELD_BYTES = 64 << 10
# Undecodable requests are logged once a minute at most, with how many there were.
UNDECODABLE_LOG_SECONDS = 60.0


@dataclass(frozen=True)
class Shape:
    """What one method's request may be on the wire."""

    method: str
    message: type[Message]
    max_bytes: int
    #: Fields at the top level, each element of a repeated field counting as one.
    max_fields: int
    #: The most elements of each repeated field (a packed one is a single field on the wire).
    max_elements: Mapping[str, int]


class Requests:
    """The bounds of every KvKeep method's requests, and their decoding."""

    def __init__(self, *, prompt_limit: int, max_token_bytes: int, max_message_bytes: int) -> None:
        bytes_of = _field_bytes(prompt_limit * max_token_bytes, prompt_limit, max_message_bytes)
        counts = _repeated_counts(prompt_limit)
        self.shapes: Mapping[str, Shape] = {
            m.name: Shape(
                method=m.name,
                message=GetMessageClass(m.input_type),
                max_bytes=min(
                    _message_bytes(m.input_type, bytes_of) + UNKNOWN_FIELD_BYTES, max_message_bytes
                ),
                max_fields=sum(counts[f.name] if f.is_repeated else 1 for f in m.input_type.fields)
                + UNKNOWN_FIELDS,
                max_elements={f.name: counts[f.name] for f in m.input_type.fields if f.is_repeated},
            )
            for m in SERVICE.methods
        }
        self._undecodable = 0
        self._logged_at = -math.inf

    def decode(self, method: str, data: bytes) -> Any:
        """The request of `method` in `data`; InvalidRequest if it is beyond the method's
        bounds or not a message of its type (nothing is parsed then)."""
        shape = self.shapes[method]
        if len(data) > shape.max_bytes:
            raise InvalidRequest(
                f"the {method} request has {len(data)} bytes; its fields can need at most {shape.max_bytes}"
            )
        fields = top_level_fields(data, shape.max_fields)
        if fields > shape.max_fields:
            raise InvalidRequest(
                f"the {method} request has more than {shape.max_fields} fields: more elements than "
                "its repeated fields may hold"
            )
        try:
            if fields < 0:
                raise DecodeError("not wire format")
            request = shape.message.FromString(data)
        except DecodeError:
            self._note_undecodable(method)
            raise InvalidRequest(
                f"the request is not a valid {shape.message.DESCRIPTOR.full_name} message"
            ) from None
        # Before any of them becomes a Python object (a list of ints takes ten times its bytes).
        for name, most in shape.max_elements.items():
            if len(getattr(request, name)) > most:
                raise InvalidRequest(
                    f"{name} has {len(getattr(request, name))} elements; the limit is {most}"
                )
        return request

    async def stream(self, method: str, chunks: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        """A client stream's requests, each decoded as it is read."""
        async for data in chunks:
            yield self.decode(method, data)

    def _note_undecodable(self, method: str) -> None:
        # Anyone with a token could otherwise write a line per request to the log.
        self._undecodable += 1
        now = time.monotonic()
        if now - self._logged_at >= UNDECODABLE_LOG_SECONDS:
            log.warning(
                "refused %d request(s) whose bytes are not a request message, the latest to %s "
                "(reported once a minute at most)",
                self._undecodable,
                method,
            )
            self._undecodable, self._logged_at = 0, now


def top_level_fields(data: bytes, most: int) -> int:
    """How many fields the top level of a serialized message holds, counted up to `most + 1`
    (beyond, the rest is not read); -1 if the bytes read are not protobuf's wire format."""
    n, i, end = 0, 0, len(data)
    while i < end and n <= most:
        key, i = _varint(data, i)
        wire = key & 7
        if i < 0 or key >> 3 == 0:
            return -1
        if wire == 0:
            _, i = _varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, i = _varint(data, i)
            i = -1 if i < 0 else i + length
        elif wire == 5:
            i += 4
        else:  # groups: no message of this service has them
            return -1
        if i < 0 or i > end:
            return -1
        n += 1
    return n


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at `i` and the index after it; index -1 if it is cut short or too long."""
    if i < len(data) and data[i] < 0x80:  # most keys and lengths: one byte
        return data[i], i + 1
    value = shift = 0
    for j in range(i, min(i + 10, len(data))):
        value |= (data[j] & 0x7F) << shift
        if data[j] < 0x80:
            return value, j + 1
        shift += 7
    return 0, -1


def _repeated_counts(prompt_limit: int) -> dict[str, int]:
    """The most elements each repeated field of a request may have (a repeated field added
    to a request must be given its limit here: the daemon does not start without)."""
    return {
        "prompt_token_ids": prompt_limit,
        "stop": MAX_STOP_STRINGS,
        "messages": MAX_MESSAGES,
        "tools": MAX_TOOLS,
    }


def _field_bytes(text: int, prompt_limit: int, unbounded: int) -> dict[str, int]:
    """The most bytes each string, bytes or repeated field of a request may need, by its name
    (one added to a request must be given its bound here: the daemon does not start
    without). `text`: the longest prompt text, in bytes (Tokenizer.check_bytes)."""
    return {
        "session_id": ID_BYTES,
        "checkpoint_id": ID_BYTES,
        "context_policy": ID_BYTES,
        "prompt": text,
        "system_prompt": text,
        "message": text,
        "prompt_token_ids": prompt_limit * TOKEN_ID_BYTES,
        "grammar": MAX_GRAMMAR_CHARS * UTF8_BYTES,
        "json_schema": MAX_GRAMMAR_CHARS * UTF8_BYTES,
        "stop": MAX_STOP_STRINGS * (FIELD_BYTES + MAX_STOP_LENGTH * UTF8_BYTES),
        "label": MAX_LABEL * UTF8_BYTES,
        "cache_salt": MAX_SALT,
        # Tools: their descriptions and parameters are bounded together by the grammar limit,
        # each of their names (and a tool choice's) by an id's bytes.
        "tools": MAX_GRAMMAR_CHARS * UTF8_BYTES + MAX_TOOLS * (4 * FIELD_BYTES + ID_BYTES),
        "mode": ID_BYTES,
        "function": ID_BYTES,
        "response_id": ID_BYTES,
        "after": ID_BYTES,
        "order": ID_BYTES,
        # A whole conversation may be longer than the context (its earlier turns dropped), and
        # an import's chunks are as large as its client makes them: only the message limit
        # bounds them.
        "messages": unbounded,
        "data": unbounded,
    }


def _message_bytes(message: Descriptor, bytes_of: Mapping[str, int]) -> int:
    total = 0
    for f in message.fields:
        if f.name in bytes_of:
            total += FIELD_BYTES + bytes_of[f.name]
        elif f.is_repeated or f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            raise KeyError(f"{message.name}.{f.name} has no bound on its size")
        elif f.message_type is not None:
            total += FIELD_BYTES + _message_bytes(f.message_type, bytes_of)
        else:
            total += FIELD_BYTES + SCALAR_BYTES
    return total
