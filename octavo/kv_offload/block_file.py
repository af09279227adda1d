"""One KV block on disk: a file per block, named and keyed by the block's
chained prefix hash and the fingerprint of what wrote it (torch-free).

Layout: a fixed header, then the payload (the block's bytes from every cache
tensor of the rank, in the rank's tensor order)::

    magic     8 bytes   b"OCTKVB01"
    fingerprint 32      model, dtypes, KV layout, block size, rank (fingerprint.py)
    block hash  32      the chained SHA-256 of core/prefix_hash.py
    size        8       payload bytes, little-endian
    crc32       4       of the payload, little-endian

Files are written to a temporary name and renamed over the final one, so a
reader never sees half a file under a block's name. There is no fsync: after
a power loss a file may be short or zeroed, which the size and checksum
catch at the next start, and the block is computed again.
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

MAGIC = b"OCTKVB01"
_HEADER = struct.Struct("<8s32s32sQI")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvblock"


class BadBlockFile(Exception):
    """A file that must not be loaded: why, in words."""


def file_name(fingerprint: bytes, block_hash: bytes) -> str:
    # The fingerprint's prefix in the name keeps the files of several models
    # (or of a tensor-parallel engine's ranks) apart in one folder; the
    # header holds all of it.
    return f"{block_hash.hex()}.{fingerprint.hex()[:16]}{SUFFIX}"


def write_block(folder: Path, fingerprint: bytes, block_hash: bytes, payload: memoryview | bytes) -> None:
    """Write the block's file atomically (temporary file, then rename); an
    ``OSError`` (a full disk, a folder gone read-only) leaves no file behind."""
    final = folder / file_name(fingerprint, block_hash)
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    header = _HEADER.pack(MAGIC, fingerprint, block_hash, len(payload), zlib.crc32(payload))
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)
    except OSError:
        # Half a file would hold disk space the tier's bound does not count; the
        # folder may refuse this too (permission lost), and then the next start's scan deletes it.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def read_block(path: Path, fingerprint: bytes, block_hash: bytes, out: memoryview) -> None:
    """Read the payload of a valid file into ``out`` (as many bytes as a
    payload has here); ``BadBlockFile`` saying what is wrong with any other
    file (``out`` then holds anything). Read straight into the caller's
    buffer: a block of a 135M-parameter model is ~360 KiB, and each copy of
    a prompt's blocks costs more than reading them from the page cache."""
    size = out.nbytes
    try:
        with path.open("rb") as f:
            header = f.read(HEADER_BYTES)
            if len(header) < HEADER_BYTES:
                raise BadBlockFile(f"truncated: {len(header)} bytes, shorter than the {HEADER_BYTES}-byte header")
            magic, file_fp, file_hash, file_size, crc = _HEADER.unpack(header)
            if magic != MAGIC:
                raise BadBlockFile(f"not a KV block file (magic {magic!r}, expected {MAGIC!r})")
            if file_fp != fingerprint:
                raise BadBlockFile("written for another model, dtype, KV layout, block size or rank "
                                   "(fingerprint differs)")
            if file_hash != block_hash:
                raise BadBlockFile("its header names another block than its file name")
            if file_size != size:
                raise BadBlockFile(f"its header says {file_size} payload bytes, a block here has {size}")
            got = f.readinto(out)
            if got != size or f.read(1):
                raise BadBlockFile(f"truncated: {got} of {size} payload bytes" if got != size
                                   else f"longer than its header's {size} payload bytes")
    except OSError as exc:
        raise BadBlockFile(f"unreadable: {exc.strerror}") from None
    if zlib.crc32(out) != crc:
        raise BadBlockFile("corrupted: the payload's checksum differs from the header's")


def scan_folder(folder: Path, fingerprints: Sequence[bytes], size: int) -> list[tuple[bytes, int]]:
    """The valid files in ``folder`` of the fingerprints given (one per KV
    cache group), as (block hash, index of the fingerprint), oldest first.
    Every byte is checked now, so that a bad file is never indexed (a load
    that fails later is a miss, but it delays its request by a read). Each
    bad file is reported in one warning and left where it is, never loaded;
    storing the same block again replaces it. Other fingerprints' files
    belong to other models or ranks and are not looked at. Temporary files
    of these fingerprints are writes a killed engine left unfinished:
    deleted."""
    tags = {f".{fingerprint.hex()[:16]}{SUFFIX}": i for i, fingerprint in enumerate(fingerprints)}
    found: list[tuple[float, tuple[bytes, int]]] = []
    scratch = memoryview(bytearray(size))
    for path in folder.iterdir():
        if path.name.startswith(".") and path.name.endswith(".tmp") and any(tag in path.name for tag in tags):
            path.unlink(missing_ok=True)  # a write of ours cut short (the engine was killed): never a block
            continue
        tag = next((tag for tag in tags if path.name.endswith(tag)), None)
        if tag is None:
            continue
        try:
            block_hash = bytes.fromhex(path.name[: -len(tag)])
            if len(block_hash) != 32:
                raise ValueError
        except ValueError:
            logger.warning("KV block file %s: skipped: its name is not a block hash", path)
            continue
        try:
            read_block(path, fingerprints[tags[tag]], block_hash, scratch)
            found.append((path.stat().st_mtime, (block_hash, tags[tag])))
        except (BadBlockFile, OSError) as exc:
            logger.warning("KV block file %s: skipped: %s", path, exc)
    return [key for _, key in sorted(found)]
