"""Block identity (a hash chain over tokens) and block framing (codec + checksum).

Identity, as in vLLM's prefix caching: h_0 = H(format, model fingerprint, KV layout, B,
salt) and h_i = H(h_{i-1}, tokens of block i), H = BLAKE2b-256 over a length-prefixed
encoding. Equal keys mean equal tokens from the start under the same model, layout and
salt, hence equal KV; sessions that share a prompt prefix share its blocks.

Frame: b"KVB1", u8 codec, u32 payload length, u32 CRC-32 of the payload, then the payload
encoded by the codec. Every read checks all of it. A block is stored raw when the codec
saves less than 5%: f16 KV barely compresses with lz4 (ratio ~1.01), and decoding it would
only slow restores down. (Manifests carry an HMAC; a block's checksum guards against
corruption, and the structural check in state/cells.py against anything llama.cpp could trip on.)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import lz4.frame
import numpy as np
import zstandard
from isal.isal_zlib import crc32

from kvkeepd.errors import CorruptCheckpoint

FORMAT = 1
MAGIC = b"KVB1"
CODECS = {"none": 0, "lz4": 1, "zstd": 2}
_HEADER = struct.Struct("<4sBII")
FRAME_HEADER = _HEADER.size
_MIN_SAVING = 0.05
# zstd runs on byte-shuffled 16-bit elements (all low bytes, then all high bytes): f16 KV
# compresses ~18% that way, and not at all unshuffled.
_ZSTD_LEVEL = 1


def _h(*parts: bytes) -> bytes:
    d = hashlib.blake2b(digest_size=32)
    for p in parts:
        d.update(struct.pack("<Q", len(p)))
        d.update(p)
    return d.digest()


def chain(
    tokens: Sequence[int], *, fingerprint: str, layout: str, block_tokens: int, salt: bytes
) -> list[str]:
    """Keys of the blocks covering `tokens`: full blocks, then a partial tail if any."""
    h = _h(
        b"kvkeep-blocks",
        str(FORMAT).encode(),
        fingerprint.encode(),
        layout.encode(),
        str(block_tokens).encode(),
        salt,
    )
    keys = []
    arr = np.asarray(tokens, dtype="<i4")
    for start in range(0, len(arr), block_tokens):
        h = _h(h, arr[start : start + block_tokens].tobytes())
        keys.append(h.hex())
    return keys


def derived(key: str, tag: str, offset: int = 0) -> str:
    """The key of a piece that follows from a block's key: a sliding-window piece of the
    block's positions from `offset` on ("win"), or the recurrent state after the block's
    last token ("rec"). The block key fixes every token up to there, so the piece's bytes."""
    return _h(bytes.fromhex(key), tag.encode(), str(offset).encode()).hex()


def _shuffle(data: bytes, width: int) -> bytes:
    """Transpose bytes as a (-1, width) matrix; the inverse is the same with the other side."""
    if len(data) % width:
        return data
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width).T.tobytes()


def frame(payload: bytes, codec: str) -> bytes:
    """Encode and frame one block payload."""
    code = CODECS[codec]
    if code == 1:
        body = bytes(lz4.frame.compress(payload))
    elif code == 2:
        body = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(_shuffle(payload, 2))
    else:
        body = payload
    if code and len(body) > len(payload) * (1 - _MIN_SAVING):
        code, body = 0, payload
    return _HEADER.pack(MAGIC, code, len(payload), crc32(payload)) + body


def unframe(data: bytes, expect_len: int, *, checksum: bool = True) -> bytes | memoryview:
    """The payload of a framed block, checked (its checksum too, unless told otherwise);
    CorruptCheckpoint if anything is off."""
    if len(data) < _HEADER.size:
        raise CorruptCheckpoint("a KV block is truncated")
    magic, code, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or code not in CODECS.values():
        raise CorruptCheckpoint("a KV block has a bad header")
    if length != expect_len:
        raise CorruptCheckpoint(f"a KV block holds {length} bytes, expected {expect_len}")
    body = memoryview(data)[_HEADER.size :]
    payload: bytes | memoryview
    try:
        if code == 1:
            # Bounded: a forged frame must not make us allocate more than the block's size.
            payload = bytes(lz4.frame.LZ4FrameDecompressor().decompress(body, max_length=length + 1))
        elif code == 2:
            raw = _zstd_bounded(body, length)
            payload = _shuffle(raw, len(raw) // 2) if len(raw) % 2 == 0 and raw else raw
        else:
            payload = body
    except (RuntimeError, ValueError, zstandard.ZstdError) as e:
        raise CorruptCheckpoint(f"a KV block does not decode: {e}") from None
    if len(payload) != length or (checksum and crc32(payload) != crc):
        raise CorruptCheckpoint("a KV block fails its checksum")
    return payload


def raw_frame_holds(header: bytes | bytearray, parts: Sequence[memoryview], expect_len: int) -> bool:
    """Whether a block read as its header and then its payload in `parts` (a scattered
    read, see state/pieces.py's Scatter) is a whole uncompressed frame of `expect_len`
    bytes with a good checksum. False for anything else: the caller reads it again the
    ordinary way, which says what is wrong."""
    if len(header) != _HEADER.size or sum(len(p) for p in parts) != expect_len:
        return False
    magic, code, length, crc = _HEADER.unpack_from(header)
    if magic != MAGIC or code != CODECS["none"] or length != expect_len:
        return False
    value = 0
    for part in parts:
        value = crc32(part, value)
    return bool(value == crc)


def _zstd_bounded(body: memoryview, length: int) -> bytes:
    """At most length + 1 bytes of a zstd frame. `decompress(max_output_size=)` ignores its
    bound when the frame declares a content size and allocates that size first, so a
    32-byte frame could ask for exabytes; a frame declaring another size than the block's
    is refused unread, and the rest is read through a bounded stream."""
    size = zstandard.get_frame_parameters(body).content_size
    if size not in (zstandard.CONTENTSIZE_UNKNOWN, length):
        raise CorruptCheckpoint(f"a KV block declares {size} bytes, expected {length}")
    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=False) as reader:
        while len(out) <= length:
            chunk = reader.read(length + 1 - len(out))
            if not chunk:
                break
            out += chunk
    return bytes(out)
