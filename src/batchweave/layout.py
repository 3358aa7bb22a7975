"""TGB layout: slices in, self-describing immutable objects out, and back. Pure, no I/O.

A TGB holds ``dp * cp`` slices; slice ``(d, c)`` has index ``d * cp + c``. Each slice is
encoded on its own, so a rank can fetch and verify exactly its slice with one range read:

    slice  = b"BWS1" | u32 header length | header JSON | zero pad to 64 | arrays, each 64-aligned
    object = slice | slice | ... | footer JSON | u64 footer length | b"BWTGB001"

The slice header names every array with dtype, shape, offset and size; the footer lists
every slice the object holds with offset, length and CRC32C, so an object explains
itself without the log. Slices are packed into objects of at most ``max_object_bytes``
and ``MAX_SLICES_PER_OBJECT`` slices (a slice is never split; one larger than the cap
gets an object to itself).

A *pack* (``encode_pack``) lays out several consecutive TGBs of one producer in shared
objects, slice-major: slice ``s`` of each TGB in turn, then slice ``s + 1``. A rank's slices
of the whole pack are then one range, read with one request instead of one per step; each
TGB's log entry points into the shared objects as it would into its own.
Nothing is pickled: a consumer can be pointed at a namespace it does not trust.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeAlias

import crc32c
import msgspec
import numpy as np

from batchweave.decoding import decoding
from batchweave.errors import CorruptDataError, LayoutError

__all__ = [
    "DEFAULT_MAX_OBJECT_BYTES",
    "MAX_SLICES_PER_OBJECT",
    "ArraysLayout",
    "EncodedPack",
    "EncodedTGB",
    "Footer",
    "FramedTGB",
    "SliceRef",
    "checksum",
    "decode_slice",
    "dtype_problem",
    "encode_pack",
    "encode_tgb",
    "frame_tgb",
    "read_footer",
    "slice_index",
]

Kind = Literal["arrays", "bytes"]
SliceData = dict[str, np.ndarray] | bytes
Piece: TypeAlias = bytes | memoryview  # part of an object, written as it is (no copy until the write)
# A slice's arrays as (name, dtype spelling, shape), by name: what a schema is checked against.
ArraysLayout: TypeAlias = tuple[tuple[str, str, tuple[int, ...]], ...]

DEFAULT_MAX_OBJECT_BYTES = 256 * 1024 * 1024
# The nodes of a synchronous job read their slices of a step within about one second, one
# read per slice and node: an object of at most 64 slices takes at most about 64 reads in
# that second (1,250 nodes reading 5 objects of 250 slices sent 250 a second to each).
MAX_SLICES_PER_OBJECT = 64
SLICE_MAGIC = b"BWS1"
OBJECT_MAGIC = b"BWTGB001"
FOOTER_FORMAT = "batchweave.tgb/1"
_ALIGN = 64
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ALLOWED_DTYPE_KINDS = set("biufcSU")  # no object or structured dtypes: they hide pickles
# The only dtype spellings a reader accepts: what ``ndarray.dtype.str`` writes for the kinds
# above (byte order, kind, itemsize). np.dtype() parses far more (comma lists, subarray
# shapes, type names) and fails in many ways; untrusted text never reaches it otherwise.
# Ten digits bound the itemsize; the size checks reject anything larger than the slice.
_DTYPE_STR = re.compile(r"[<>|][biufcSU][1-9][0-9]{0,9}")
_MAX_DIMS = 32
_MAX_UNICODE = 0x10FFFF  # numpy's "U" stores UCS-4 code points; larger ones crash on access


class SliceRef(NamedTuple):
    """Where slice ``index`` of a TGB lives: object number, byte offset, length, CRC32C
    (the log's ``TGBDescriptor.slices`` holds each as this tuple)."""

    object_index: int
    offset: int
    length: int
    crc32c: int


@dataclass(frozen=True)
class EncodedTGB:
    """A TGB ready to upload: each object as the pieces that make it up, back to back, and
    one SliceRef per slice.

    The pieces view the caller's arrays (no copy): write them (``Store.stage_if_absent``
    takes them as they are; a local directory writes them with one ``writev``) before
    the caller may change its arrays. ``objects`` joins them, once, for a store that
    needs one buffer.
    """

    kind: Kind
    parts: list[list[Piece]]
    slices: list[SliceRef]
    sizes: list[int]  # each object's size in bytes
    # Each different ``ArraysLayout`` among the slices, in slice order (empty for bytes):
    # one for most TGBs, so checking a schema costs the same for 1 slice or 1,250.
    array_layouts: tuple[ArraysLayout, ...] = ()

    @functools.cached_property
    def objects(self) -> list[bytes]:
        """Each object's bytes in one buffer (a copy of the pieces)."""
        return [b"".join(pieces) for pieces in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class FramedTGB:
    """A TGB's slices checked and framed (``frame_tgb``), not yet laid out in objects: per
    slice (in slice order) its pieces, written back to back, its size and its CRC32C."""

    kind: Kind
    dp: int
    cp: int
    pieces: list[list[Piece]]
    sizes: list[int]
    crcs: list[int]
    array_layouts: tuple[ArraysLayout, ...]  # as ``EncodedTGB.array_layouts``
    nbytes: int  # the slices' bytes (an object adds a footer)
    # Whether a piece views memory the caller may change (anything but ``bytes``): known
    # when framing, so that keeping a TGB does not look at each of its pieces again.
    borrowed: bool = True

    @property
    def largest_slice(self) -> int:
        return max(self.sizes)

    def owned(self) -> FramedTGB:
        """The TGB holding no memory its caller may change: a TGB kept past ``append`` (to
        be packed with the next ones) must not change when the caller reuses its arrays.
        Bytes objects cannot change and are kept; anything else is copied, all of it into
        one buffer that the slices then view."""
        if not self.borrowed:
            return self
        whole = memoryview(b"".join([piece for pieces in self.pieces for piece in pieces]))
        views: list[list[Piece]] = []
        start = 0
        for size in self.sizes:
            views.append([whole[start : start + size]])
            start += size
        return FramedTGB(
            self.kind, self.dp, self.cp, views, self.sizes, self.crcs, self.array_layouts, self.nbytes, borrowed=False
        )


@dataclass(frozen=True)
class EncodedPack:
    """Consecutive TGBs laid out in shared objects (``encode_pack``): each object as its
    pieces and its size, and each TGB's slice references into them, as the log's tuples
    (``refs``) and as SliceRefs (``slices``)."""

    kind: Kind
    parts: list[list[Piece]]
    refs: list[list[tuple[int, int, int, int]]]  # per TGB, in slice order: (object, offset, length, crc32c)
    sizes: list[int]  # each object's size in bytes
    shares: list[int]  # each TGB's share of the objects' bytes (``tgb_nbytes``)

    @functools.cached_property
    def slices(self) -> list[list[SliceRef]]:
        """Per TGB, in slice order, where each slice lives."""
        return [[SliceRef(*ref) for ref in refs] for refs in self.refs]

    def tgb_nbytes(self) -> list[int]:
        """Each TGB's share of the objects' bytes: its slices, and the last TGB the footers,
        so that the shares add up to the objects' sizes."""
        return list(self.shares)


# gc=False: numbers and strings only (see log.ProducerState); a pack makes one FooterSlice a slice.
class _ArrayHeader(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class _SliceHeader(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    kind: Kind
    arrays: list[_ArrayHeader] = []
    nbytes: int = 0


class FooterSlice(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    index: int
    offset: int
    length: int
    crc32c: int


class Footer(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True, omit_defaults=True):
    """The index at the end of every TGB object. ``tgbs``: how many consecutive TGBs the
    object packs (``encode_pack``); a slice's ``index`` is ``slice * tgbs + position``."""

    format: str
    part: int
    parts: int
    dp: int
    cp: int
    kind: Kind
    slices: list[FooterSlice]
    tgbs: int = 1


# Built once at import (see log._VERSION_DECODER: concurrent first use of a type can crash msgspec).
_SLICE_HEADER_DECODER = msgspec.json.Decoder(_SliceHeader)
_FOOTER_DECODER = msgspec.json.Decoder(Footer)


def slice_index(d: int, c: int, cp: int) -> int:
    """Index of slice ``(d, c)`` in a TGB with ``cp`` context-parallel ranks."""
    return d * cp + c


def checksum(data: bytes | memoryview) -> int:
    return crc32c.crc32c(data)


# -- encoding --------------------------------------------------------------------------
#
# The hot path of every producer: ``append`` frames each of a TGB's slices and lays them
# out in objects, in the caller's thread. Per slice it does what must be done per slice
# (check the payload, one CRC32C over its bytes, a footer entry and a log reference), and
# everything that is the same for slices of one shape (the header, its CRC, the padding)
# once per shape (``_bytes_plan``, ``_arrays_plan``). No slice's bytes are copied: the
# pieces are the header and the caller's own buffers (``tests/test_layout.py`` counts).


def encode_tgb(slices: Sequence[Any], dp: int, cp: int, max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> EncodedTGB:
    """Encode ``dp * cp`` slice payloads into objects of at most ``max_object_bytes`` and
    ``MAX_SLICES_PER_OBJECT`` slices."""
    framed = frame_tgb(slices, dp, cp)
    if max_object_bytes <= 0:
        raise LayoutError(f"max_object_bytes must be positive, got {max_object_bytes}")
    pack = encode_pack([framed], max_object_bytes)
    return EncodedTGB(framed.kind, pack.parts, pack.slices[0], pack.sizes, framed.array_layouts)


def frame_tgb(slices: Sequence[Any], dp: int, cp: int) -> FramedTGB:
    """Check and frame ``dp * cp`` slice payloads, not yet laid out in objects (the pieces
    view the caller's arrays: ``FramedTGB.owned`` copies them)."""
    if isinstance(slices, (bytes, bytearray, memoryview, Mapping)) or not isinstance(slices, Sequence):
        raise LayoutError(f"slices must be a list of dp*cp={dp * cp} payloads, got {type(slices).__name__}")
    if not all(isinstance(n, int) and n >= 1 for n in (dp, cp)):
        raise LayoutError(f"dp and cp must be positive integers, got dp={dp!r} cp={cp!r}")
    if len(slices) != dp * cp:
        raise LayoutError(f"a TGB needs dp*cp = {dp}*{cp} = {dp * cp} slices, got {len(slices)}")
    if isinstance(slices[0], _BYTES_LIKE):
        return _frame_bytes(slices, dp, cp)
    return _frame_arrays(slices, dp, cp)


_BYTES_LIKE = (bytes, bytearray, memoryview)


def _frame_bytes(slices: Sequence[Any], dp: int, cp: int) -> FramedTGB:
    # (Checked by builtins over the whole list: a generator would be a Python call a slice.)
    if set(map(type, slices)) == {bytes} and len(set(map(len, slices))) == 1:
        return _frame_even_bytes(slices, dp, cp)
    pieces: list[list[Piece]] = []
    sizes: list[int] = []
    crcs: list[int] = []
    crc = crc32c.crc32c
    borrowed = False
    for index, payload in enumerate(slices):
        data = payload if type(payload) is bytes else _byte_payload(payload, index, "bytes")
        borrowed = borrowed or type(data) is not bytes
        first, first_crc = _bytes_plan(len(data))
        pieces.append([first, data])
        sizes.append(len(first) + len(data))
        crcs.append(crc(data, first_crc))
    return FramedTGB("bytes", dp, cp, pieces, sizes, crcs, (), sum(sizes), borrowed)


def _frame_even_bytes(slices: Sequence[bytes], dp: int, cp: int) -> FramedTGB:
    """``_frame_bytes`` for the common TGB: ``bytes`` slices of one size, sharing one
    header, framed a column at a time (comprehensions, no Python call a slice)."""
    first, first_crc = _bytes_plan(len(slices[0]))
    crc = crc32c.crc32c
    size = len(first) + len(slices[0])
    crcs = [crc(data, first_crc) for data in slices]
    pieces: list[list[Piece]] = [[first, data] for data in slices]
    return FramedTGB("bytes", dp, cp, pieces, [size] * len(slices), crcs, (), size * len(slices), borrowed=False)


def _byte_payload(payload: Any, index: int, kind: Kind) -> Piece:
    """A bytes slice's bytes that are not a ``bytes`` object; LayoutError for anything
    else (``kind``: what slice 0 is)."""
    if isinstance(payload, _BYTES_LIKE):  # (a bytes subclass too)
        return _byte_view(payload)
    if isinstance(payload, Mapping):
        _encode_arrays(payload, index)  # its own errors first, as for any slice
        raise LayoutError(f"mixed layouts in one TGB: slice 0 is {kind}, slice {index} is arrays")
    raise _unsupported(payload, index)


def _frame_arrays(slices: Sequence[Any], dp: int, cp: int) -> FramedTGB:
    pieces: list[list[Piece]] = []
    sizes: list[int] = []
    crcs: list[int] = []
    distinct: dict[ArraysLayout, None] = {}  # each ArraysLayout once, in slice order
    first_plan: _ArraysPlan | None = None
    last_plan: _ArraysPlan | None = None
    for index, payload in enumerate(slices):
        if type(payload) is not dict and not isinstance(payload, Mapping):  # (an ABC's check costs a call)
            if isinstance(payload, _BYTES_LIKE):
                raise LayoutError(f"mixed layouts in one TGB: slice 0 is arrays, slice {index} is bytes")
            raise _unsupported(payload, index)
        framed, size, crc, plan = _encode_arrays(payload, index)
        if plan is not last_plan:  # slices of one shape share one plan: most TGBs pass here once
            if first_plan is None:
                first_plan = plan
            elif plan.signature != first_plan.signature:
                raise LayoutError(
                    f"mixed layouts in one TGB: slice 0 has arrays {first_plan.signature}, "
                    f"slice {index} has {plan.signature}"
                )
            distinct[plan.arrays] = None
            last_plan = plan
        pieces.append(framed)
        sizes.append(size)
        crcs.append(crc)
    return FramedTGB("arrays", dp, cp, pieces, sizes, crcs, tuple(distinct), sum(sizes))


def _unsupported(payload: Any, index: int) -> LayoutError:
    return LayoutError(
        f"slice {index}: unsupported payload type {type(payload).__name__}; "
        "use a dict of numpy arrays / torch tensors, or bytes"
    )


def encode_pack(tgbs: Sequence[FramedTGB], max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> EncodedPack:
    """Lay out consecutive TGBs in shared objects, slice-major: slice ``s`` of every TGB,
    in order, then slice ``s + 1``; so one rank's slices of all of them are one range.

    Slice indices are grouped into objects as ``encode_tgb`` groups a single TGB's (at most
    ``MAX_SLICES_PER_OBJECT`` slice indices, and ``max_object_bytes`` unless one index's run
    is larger): an object is read by as many ranks as one TGB's, each reading once for
    the whole pack. A footer entry's index is ``slice * len(tgbs) + position`` (the slice
    index for a single TGB, whose objects are byte for byte ``encode_tgb``'s).
    """
    if not tgbs:
        raise LayoutError("a pack needs at least one TGB")
    first = tgbs[0]
    for position, tgb in enumerate(tgbs):
        if (tgb.kind, tgb.dp, tgb.cp) != (first.kind, first.dp, first.cp):
            raise LayoutError(
                f"TGB {position} of a pack is {tgb.kind} with dp={tgb.dp} cp={tgb.cp}; "
                f"the first is {first.kind} with dp={first.dp} cp={first.cp}"
            )
    count = len(tgbs)
    runs = first.sizes if count == 1 else [sum(run) for run in zip(*(tgb.sizes for tgb in tgbs), strict=True)]
    bounds = _pack(runs, cap=max_object_bytes)
    parts: list[list[Piece]] = []
    sizes: list[int] = []
    refs: list[list[tuple[int, int, int, int]]] = [[] for _ in tgbs]
    for part, (start, stop) in enumerate(bounds):
        if count == 1:
            body, footer_slices, size = _one_tgbs_slices(first, part, start, stop, refs[0])
        else:
            body, footer_slices, size = _packed_slices(tgbs, part, start, stop, refs)
        footer = Footer(FOOTER_FORMAT, part, len(bounds), first.dp, first.cp, first.kind, footer_slices, count)
        tail = _footer_tail(footer)
        body.append(tail)
        parts.append(body)
        sizes.append(size + len(tail))
    shares = [tgb.nbytes for tgb in tgbs]
    shares[-1] += sum(sizes) - sum(shares)
    return EncodedPack(first.kind, parts, refs, sizes, shares)


def _one_tgbs_slices(
    tgb: FramedTGB, part: int, start: int, stop: int, refs: list[tuple[int, int, int, int]]
) -> tuple[list[Piece], list[FooterSlice], int]:
    """Object ``part``'s body (slices ``start`` to ``stop`` of one TGB, back to back) as
    pieces, its footer entries and its size; each slice's reference appended to ``refs``."""
    body: list[Piece] = []
    footer_slices: list[FooterSlice] = []
    offset = 0
    sizes, crcs, pieces = tgb.sizes, tgb.crcs, tgb.pieces
    for index in range(start, stop):
        size, crc = sizes[index], crcs[index]
        footer_slices.append(FooterSlice(index, offset, size, crc))
        refs.append((part, offset, size, crc))
        body += pieces[index]
        offset += size
    return body, footer_slices, offset


def _packed_slices(
    tgbs: Sequence[FramedTGB], part: int, start: int, stop: int, refs: list[list[tuple[int, int, int, int]]]
) -> tuple[list[Piece], list[FooterSlice], int]:
    """``_one_tgbs_slices`` for a pack: each slice index's run of the TGBs' slices, one
    TGB after another."""
    count = len(tgbs)
    # Slice-major columns (slice ``index`` of each TGB in turn), built by builtins over
    # zips: a loop that handled a slice at a time ran Python code for every slice.
    sizes = list(_slice_major([tgb.sizes[start:stop] for tgb in tgbs]))
    crcs = list(_slice_major([tgb.crcs[start:stop] for tgb in tgbs]))
    offsets = list(itertools.accumulate(sizes, initial=0))
    body_size = offsets.pop()
    footer_slices = list(map(FooterSlice, range(start * count, stop * count), offsets, sizes, crcs))
    for position, mine in enumerate(refs):
        at = slice(position, None, count)  # this TGB's slices among the columns
        mine += zip(itertools.repeat(part), offsets[at], sizes[at], crcs[at])
    body: list[Piece] = list(itertools.chain.from_iterable(_slice_major([tgb.pieces[start:stop] for tgb in tgbs])))
    return body, footer_slices, body_size


def _slice_major(columns: list[list[Any]]) -> Iterator[Any]:
    """One value per TGB (``columns[position]``, in slice order) laid out slice-major:
    slice 0 of each TGB in turn, then slice 1."""
    return itertools.chain.from_iterable(zip(*columns, strict=True))


def _pack(len_of: list[int], cap: int) -> list[tuple[int, int]]:
    """Consecutive slice indices grouped into objects, as (first, past the last)."""
    if len(len_of) <= MAX_SLICES_PER_OBJECT and sum(len_of) <= cap:
        return [(0, len(len_of))]
    bounds: list[tuple[int, int]] = []
    start, size = 0, 0
    for index, length in enumerate(len_of):
        if index > start and (size + length > cap or index - start >= MAX_SLICES_PER_OBJECT):
            bounds.append((start, index))
            start, size = index, 0
        size += length
    bounds.append((start, len(len_of)))
    return bounds


def _footer_tail(footer: Footer) -> bytes:
    """An object's last piece: its footer, the footer's length and the magic (the payload
    bytes are not copied here: the writer's one pass over them is its write)."""
    footer_bytes = msgspec.json.encode(footer)
    return footer_bytes + _U64.pack(len(footer_bytes)) + OBJECT_MAGIC


def _byte_view(payload: bytes | bytearray | memoryview) -> Piece:
    """The payload's bytes without a copy (written by the producer's ``append`` before it
    returns, so a caller's buffer is read once, while it is still theirs)."""
    view = memoryview(payload)
    return view.cast("B") if view.c_contiguous else view.tobytes()


@functools.lru_cache(maxsize=256)
def _bytes_plan(nbytes: int) -> tuple[bytes, int]:
    """A bytes slice's framed header for ``nbytes`` bytes, and its CRC32C: made once per
    size, since a producer frames thousands of slices of a few sizes."""
    first = _framed_header(msgspec.json.encode(_SliceHeader(kind="bytes", nbytes=nbytes)))
    return first, crc32c.crc32c(first)


def _encode_arrays(payload: Mapping[Any, Any], index: int) -> tuple[list[Piece], int, int, _ArraysPlan]:
    """One slice of arrays: its pieces (the header, then each array's own memory, padded to
    its aligned offset), its size, its CRC32C and its plan."""
    if not payload:
        raise LayoutError(f"slice {index}: empty dict; give at least one named array")
    layout: list[tuple[str, np.dtype[Any], tuple[int, ...], int]] = []
    arrays: list[np.ndarray[Any, Any]] = []
    for name in sorted(payload):
        if not isinstance(name, str) or not name:
            raise LayoutError(f"slice {index}: array names must be non-empty strings, got {name!r}")
        value = payload[name]
        # A C-contiguous numpy array, the usual case, goes as it is; its dtype is checked
        # once per shape, by its plan.
        array: np.ndarray[Any, Any] = (
            value if type(value) is np.ndarray and value.flags.c_contiguous else _as_array(value, index, name)
        )
        layout.append((name, array.dtype, array.shape, array.nbytes))
        arrays.append(array)
    plan = _arrays_plan(tuple(layout))
    if plan.refused:  # (before any buffer is asked for: numpy has none for some of them)
        name, dtype = plan.refused
        raise LayoutError(f"slice {index}, array {name!r}: dtype {dtype} is not supported (no object dtypes)")
    pieces: list[Piece] = [plan.first]
    crc = plan.first_crc
    for array, pad in zip(arrays, plan.pads, strict=True):
        if pad:
            pieces.append(pad)
            crc = crc32c.crc32c(pad, crc)
        if array.nbytes:
            buffer = array.data.cast("B")  # the array's own memory (C-contiguous)
            pieces.append(buffer)
            crc = crc32c.crc32c(buffer, crc)
        else:
            pieces.append(b"")
    return pieces, plan.size, crc, plan


@dataclass(frozen=True, slots=True)
class _ArraysPlan:
    """How a slice of these arrays is framed: the same for every slice of a run's shapes."""

    signature: tuple[tuple[str, str], ...]  # what every slice of a TGB must share: names and dtypes
    arrays: ArraysLayout
    first: bytes  # the framed header (``_framed_header``): a slice's first piece
    pads: list[bytes]  # the zeros before each array (b"" when it follows the last directly)
    size: int  # the framed slice's bytes
    first_crc: int
    refused: tuple[str, np.dtype] | None = None  # an array of a dtype no slice may hold: (name, dtype)


@functools.lru_cache(maxsize=256)
def _arrays_plan(layout: tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]) -> _ArraysPlan:
    """The header and array offsets for arrays of these (name, dtype, shape, nbytes):
    made once per shape, since a producer frames thousands of slices of the same shapes."""
    for name, dtype, _, _ in layout:
        if dtype.kind not in _ALLOWED_DTYPE_KINDS:
            return _ArraysPlan((), (), b"", [], 0, 0, (name, dtype))
    headers: list[_ArrayHeader] = []
    pads: list[bytes] = []
    offset = position = 0
    for name, dtype, shape, nbytes in layout:
        offset = _align(position)
        headers.append(_ArrayHeader(name, dtype.str, list(shape), offset, nbytes))
        pads.append(b"\0" * (offset - position))
        position = offset + nbytes
    header = msgspec.json.encode(_SliceHeader(kind="arrays", arrays=headers))
    signature = tuple((h.name, h.dtype) for h in headers)
    arrays = tuple((h.name, h.dtype, shape) for h, (_, _, shape, _) in zip(headers, layout, strict=True))
    first = _framed_header(header)
    return _ArraysPlan(signature, arrays, first, pads, len(first) + position, crc32c.crc32c(first))


def _as_array(value: Any, index: int, name: str) -> np.ndarray:
    module = type(value).__module__
    if module.startswith("torch"):
        value = _torch_to_numpy(value, index, name)
    if not isinstance(value, np.ndarray):
        raise LayoutError(
            f"slice {index}, array {name!r}: unsupported type {type(value).__name__}; use numpy arrays or torch tensors"
        )
    if value.dtype.kind not in _ALLOWED_DTYPE_KINDS:
        raise LayoutError(f"slice {index}, array {name!r}: dtype {value.dtype} is not supported (no object dtypes)")
    # ascontiguousarray would turn a 0-d array into 1-d; copy only when not contiguous.
    return value if value.flags.c_contiguous else value.copy(order="C")


def _torch_to_numpy(tensor: Any, index: int, name: str) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    try:
        return tensor.numpy()  # shares memory with the tensor: no copy
    except TypeError as exc:
        raise LayoutError(
            f"slice {index}, array {name!r}: torch dtype {tensor.dtype} has no numpy equivalent; "
            "view it as an integer type (e.g. tensor.view(torch.int16) for bfloat16)"
        ) from exc


def _align(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _framed_header(header: bytes) -> bytes:
    """A slice's first piece: magic, header length, header, zeros up to the aligned data."""
    prefix = SLICE_MAGIC + _U32.pack(len(header)) + header
    return prefix + b"\0" * (_align(len(prefix)) - len(prefix))


# -- decoding --------------------------------------------------------------------------


def decode_slice(buf: bytes | memoryview, key: str, expected_crc32c: int | None = None) -> SliceData:
    """Verify and decode one slice. Arrays are zero-copy, read-only views of ``buf``.

    Any damage, accidental or crafted, raises CorruptDataError naming ``key``; the work
    is linear in ``len(buf)`` and nothing is allocated beyond the header and the views
    (a ``bytes`` slice is copied once).
    """
    view = memoryview(buf).cast("B")
    if expected_crc32c is not None and checksum(view) != expected_crc32c:
        raise CorruptDataError(key, f"slice checksum mismatch (expected crc32c {expected_crc32c:#010x})")
    if len(view) < 8 or bytes(view[:4]) != SLICE_MAGIC:
        raise CorruptDataError(key, "not a BatchWeave slice (bad magic or truncated)")
    (header_len,) = _U32.unpack_from(view, 4)
    if 8 + header_len > len(view):
        raise CorruptDataError(key, f"slice header length {header_len} runs past the slice ({len(view)} bytes)")
    with decoding(key, "unreadable slice header"):
        header = _SLICE_HEADER_DECODER.decode(view[8 : 8 + header_len])
    data = view[_align(8 + header_len) :]
    if header.kind == "bytes":
        if header.arrays:
            raise CorruptDataError(key, f"bytes slice also lists {len(header.arrays)} arrays")
        if header.nbytes != len(data):
            raise CorruptDataError(key, f"bytes slice says {header.nbytes} bytes, holds {len(data)}")
        return bytes(data)
    # What encode_tgb writes: at least one array, distinct non-empty names, no byte count.
    if not header.arrays:
        raise CorruptDataError(key, "arrays slice lists no arrays")
    if header.nbytes != 0:
        raise CorruptDataError(key, f"arrays slice carries a bytes count ({header.nbytes})")
    arrays: dict[str, np.ndarray] = {}
    for h in header.arrays:
        if not h.name:
            raise CorruptDataError(key, "an array has an empty name")
        if h.name in arrays:
            raise CorruptDataError(key, f"array {h.name[:80]!r} is listed twice")
        arrays[h.name] = _array_from(data, h, key)
    return arrays


def dtype_problem(spelling: str) -> str:
    """Why ``spelling`` is not a dtype a slice may hold ("" when it is one): what
    ``ndarray.dtype.str`` writes for a numeric, bytes or text dtype (e.g. ``"<i4"``)."""
    dtype = _dtype_of(spelling)
    return dtype if isinstance(dtype, str) else ""


@functools.lru_cache(maxsize=256)  # a few spellings per namespace; parsing one costs more than the rest of a decode
def _dtype_of(spelling: str) -> np.dtype | str:
    """The dtype a header spells, or why it is refused."""
    if not _DTYPE_STR.fullmatch(spelling):
        return f"unsupported dtype {spelling[:40]!r}"
    try:
        dtype = np.dtype(spelling)
    except (TypeError, ValueError, OverflowError):  # e.g. "<i3", "<f16" where long double is 8 bytes
        return f"unknown dtype {spelling!r}"
    # "S0"/"U0"-like spellings are kept out by the pattern; the itemsize check is why the
    # element count can be derived without dividing by it.
    if dtype.kind not in _ALLOWED_DTYPE_KINDS or dtype.itemsize < 1:
        return f"unsupported dtype {spelling!r}"
    return dtype


def _array_from(data: memoryview, h: _ArrayHeader, key: str) -> np.ndarray:
    dtype = _dtype_of(h.dtype)
    if isinstance(dtype, str):
        raise CorruptDataError(key, f"{_where(h)}: {dtype}")
    # Extents beyond ssize_t are never representable; refusing them first also keeps the
    # products below small integers (a header may spell a 4000-digit extent).
    if len(h.shape) > _MAX_DIMS or any(not 0 <= n <= sys.maxsize for n in h.shape):
        raise CorruptDataError(
            key, f"{_where(h)}: bad shape {h.shape[: _MAX_DIMS + 1]} (at most {_MAX_DIMS} dims, each 0..2**63-1)"
        )
    count = math.prod(h.shape)
    # numpy refuses shapes whose non-zero extents times the itemsize overflow ssize_t, even
    # for zero-size arrays (the strides would overflow); check first instead of catching.
    extents = count or math.prod(n for n in h.shape if n)
    if extents * dtype.itemsize > sys.maxsize:
        raise CorruptDataError(key, f"{_where(h)}: shape {h.shape} of {h.dtype} is too large to represent")
    if count * dtype.itemsize != h.nbytes:
        raise CorruptDataError(key, f"{_where(h)}: shape {h.shape} of {h.dtype} is not {h.nbytes} bytes")
    if h.offset < 0 or h.offset % _ALIGN or h.offset + h.nbytes > len(data):
        raise CorruptDataError(
            key, f"{_where(h)}: offset {h.offset} is not {_ALIGN}-aligned or {h.nbytes} bytes from it leave the slice"
        )
    try:
        array = np.frombuffer(data, dtype=dtype, count=count, offset=h.offset).reshape(h.shape)
    except ValueError as exc:  # not expected after the checks above; kept so numpy's limits stay typed
        raise CorruptDataError(key, f"{_where(h)}: shape {h.shape} is not representable ({exc})") from exc
    if dtype.kind == "U" and count:
        # A code point past U+10FFFF makes numpy raise SystemError when the element is read,
        # far from here; one vectorised pass over text arrays (rare, small) keeps it typed.
        code_points = np.frombuffer(
            data, dtype=np.dtype("u4").newbyteorder(dtype.byteorder), count=h.nbytes // 4, offset=h.offset
        )
        if int(code_points.max()) > _MAX_UNICODE:
            raise CorruptDataError(key, f"{_where(h)}: holds a code point above U+10FFFF")
    array.flags.writeable = False  # a view of the read buffer: immutable like the object it came from
    return array


def _where(h: _ArrayHeader) -> str:
    return f"array {h.name[:80]!r}"  # names come from the header: keep the message bounded


def read_footer(obj: bytes | memoryview, key: str) -> Footer:
    """Parse the footer of a whole TGB object (for inspection and repair, not the hot path)."""
    view = memoryview(obj).cast("B")
    tail = len(OBJECT_MAGIC) + _U64.size
    if len(view) < tail or bytes(view[-len(OBJECT_MAGIC) :]) != OBJECT_MAGIC:
        raise CorruptDataError(key, "not a BatchWeave TGB object (bad magic or truncated)")
    (footer_len,) = _U64.unpack_from(view, len(view) - tail)
    if footer_len > len(view) - tail:
        raise CorruptDataError(key, f"footer length {footer_len} exceeds the object size {len(view)}")
    start = len(view) - tail - footer_len
    with decoding(key, "unreadable footer"):
        footer = _FOOTER_DECODER.decode(view[start : len(view) - tail])
    if footer.format != FOOTER_FORMAT:
        raise CorruptDataError(
            key, f"unsupported TGB format {footer.format[:80]!r} (this reader knows {FOOTER_FORMAT})"
        )
    if footer.dp < 1 or footer.cp < 1 or not 0 <= footer.part < footer.parts:
        raise CorruptDataError(
            key, f"footer says part {footer.part} of {footer.parts} of a dp={footer.dp} cp={footer.cp} TGB"
        )
    if not footer.slices:
        raise CorruptDataError(key, "footer lists no slices")  # encode_tgb never writes an empty object
    # What encode_tgb writes: slices in index order, laid end to end in the body. Checked in
    # one pass, so a reader may index the body by any listed slice without checking again.
    if footer.tgbs < 1:
        raise CorruptDataError(key, f"footer says the object packs {footer.tgbs} TGBs")
    previous_index, previous_end = -1, 0
    for fs in footer.slices:
        if not previous_index < fs.index < footer.dp * footer.cp * footer.tgbs:
            raise CorruptDataError(
                key,
                f"footer lists slice {fs.index} after slice {previous_index} "
                f"(dp={footer.dp} cp={footer.cp}, {footer.tgbs} TGB(s))",
            )
        if fs.offset < previous_end or fs.length < 0 or fs.offset + fs.length > start:
            raise CorruptDataError(key, f"footer places slice {fs.index} outside the object body or over another")
        if not 0 <= fs.crc32c < 1 << 32:
            raise CorruptDataError(key, f"footer gives slice {fs.index} crc32c {fs.crc32c}, not a 32-bit value")
        previous_index, previous_end = fs.index, fs.offset + fs.length
    return footer
