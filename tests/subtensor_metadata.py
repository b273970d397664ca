"""A hand-built V14 runtime metadata blob holding subtensor's ``Commitments`` pallet.

No real subtensor metadata ships with bittensor 11 or its dependencies (it is
downloaded from the node at connect time and cached under ~/.bittensor/runtime-cache),
so tests cannot load the live runtime offline. This module writes the part dtrain
touches -- ``Commitments.set_commitment`` and the ``CommitmentOf`` storage value -- as
SCALE-encoded ``RuntimeMetadataPrefixed`` (V14), transcribed from subtensor's source:

- ``pallets/commitments/src/types.rs``: ``Data`` has a hand-written ``TypeInfo`` with
  variants ``None`` (0), ``Raw0``..``Raw128`` (1..129, each one unnamed ``[u8; N]``
  field), ``BlakeTwo256``/``Sha256``/``Keccak256``/``ShaThree256`` (130..133,
  ``[u8; 32]``), ``TimelockEncrypted { encrypted, reveal_round }`` (134),
  ``ResetBondsFlag`` (135) and ``BigRaw`` (136); ``CommitmentInfo { fields:
  BoundedVec<Data, MaxFields> }``; ``Registration { deposit, block, info }``.
- ``pallets/commitments/src/lib.rs``: ``set_commitment`` is call index 0, with
  ``netuid`` and ``info: Box<CommitmentInfo<..>>``; ``MaxFields`` is a pallet constant.
- ``runtime/src/lib.rs``: ``Commitments = 18`` in ``construct_runtime!``,
  ``MaxCommitFieldsInner = 3``; ``NetUid`` is ``subtensor_runtime_common::NetUid(u16)``.

The blob is then loaded by bittensor's own Rust codec (``bittensor_core.Runtime``
through ``RuntimeCodec``), so the bytes a test checks are produced by the SDK's real
SCALE encoder from these type definitions. What this cannot prove is that the live
runtime still has these definitions: a runtime upgrade that changes them would only
show against the real metadata (docs/protocol.md, "Known unverified point").
"""

from __future__ import annotations

COMMITMENTS_PALLET_INDEX = 18
SET_COMMITMENT_CALL_INDEX = 0
MAX_FIELDS = 3  # runtime MaxCommitFieldsInner
SPEC_VERSION = 1  # a made-up runtime version: only the codec's bookkeeping uses it
TRANSACTION_VERSION = 1


# -- SCALE primitives -------------------------------------------------------------------


def compact(n: int) -> bytes:
    if n < 1 << 6:
        return bytes([n << 2])
    if n < 1 << 14:
        return ((n << 2) | 1).to_bytes(2, "little")
    if n < 1 << 30:
        return ((n << 2) | 2).to_bytes(4, "little")
    raw = n.to_bytes((n.bit_length() + 7) // 8, "little")
    return bytes([((len(raw) - 4) << 2) | 3]) + raw


def text(s: str) -> bytes:
    data = s.encode()
    return compact(len(data)) + data


def vec(items: list[bytes]) -> bytes:
    return compact(len(items)) + b"".join(items)


def option(value: bytes | None) -> bytes:
    return b"\x00" if value is None else b"\x01" + value


# -- scale-info portable registry ----------------------------------------------------------


class Registry:
    """Types in id order, each encoded as ``PortableType { id, ty }``."""

    def __init__(self) -> None:
        self.types: list[bytes] = []

    def add(self, path: list[str], type_def: bytes, params: list[tuple[str, int | None]] = ()) -> int:
        type_id = len(self.types)
        params_enc = vec([text(name) + option(None if ty is None else compact(ty)) for name, ty in params])
        body = vec([text(p) for p in path]) + params_enc + type_def + vec([])  # docs
        self.types.append(compact(type_id) + body)
        return type_id

    def encode(self) -> bytes:
        return vec(self.types)


def field(ty: int, name: str | None = None, type_name: str | None = None) -> bytes:
    return option(None if name is None else text(name)) + compact(ty) + option(
        None if type_name is None else text(type_name)) + vec([])


def composite(fields: list[bytes]) -> bytes:
    return b"\x00" + vec(fields)


def variant_def(variants: list[bytes]) -> bytes:
    return b"\x01" + vec(variants)


def variant(name: str, index: int, fields: list[bytes] = ()) -> bytes:
    return text(name) + vec(list(fields)) + bytes([index]) + vec([])


def sequence(ty: int) -> bytes:
    return b"\x02" + compact(ty)


def array(length: int, ty: int) -> bytes:
    return b"\x03" + length.to_bytes(4, "little") + compact(ty)


def tuple_def(types: list[int]) -> bytes:
    return b"\x04" + vec([compact(t) for t in types])


PRIM = {"bool": 0, "u8": 3, "u16": 4, "u32": 5, "u64": 6, "u128": 7}


def primitive(name: str) -> bytes:
    return b"\x05" + bytes([PRIM[name]])


# -- the runtime ------------------------------------------------------------------------------


def build() -> bytes:
    """``RuntimeMetadataPrefixed`` (magic ``meta``, version 14) as bytes."""
    r = Registry()
    u8 = r.add([], primitive("u8"))
    u16 = r.add([], primitive("u16"))
    u32 = r.add([], primitive("u32"))
    u64 = r.add([], primitive("u64"))
    bytes32 = r.add([], array(32, u8))
    account = r.add(["sp_core", "crypto", "AccountId32"], composite([field(bytes32, type_name="[u8; 32]")]))
    netuid = r.add(["subtensor_runtime_common", "NetUid"], composite([field(u16, type_name="u16")]))
    byte_vec = r.add([], sequence(u8))
    bounded_bytes = r.add(["bounded_collections", "bounded_vec", "BoundedVec"],
                          composite([field(byte_vec, type_name="Vec<T>")]), [("T", u8), ("S", None)])

    raw_arrays = {size: (bytes32 if size == 32 else r.add([], array(size, u8))) for size in range(129)}
    data_variants = [variant("None", 0)]
    data_variants += [variant(f"Raw{size}", size + 1, [field(raw_arrays[size], type_name=f"[u8; {size}]")])
                      for size in range(129)]
    for index, name in enumerate(("BlakeTwo256", "Sha256", "Keccak256", "ShaThree256"), start=130):
        data_variants.append(variant(name, index, [field(bytes32, type_name="[u8; 32]")]))
    data_variants.append(variant("TimelockEncrypted", 134, [
        field(bounded_bytes, name="encrypted", type_name="BoundedVec<u8, ConstU32<1024>>"),
        field(u64, name="reveal_round", type_name="u64"),
    ]))
    data_variants.append(variant("ResetBondsFlag", 135))
    data_variants.append(variant("BigRaw", 136, [field(bounded_bytes, type_name="BoundedVec<u8, ConstU32<512>>")]))
    data = r.add(["pallet_commitments", "types", "Data"], variant_def(data_variants))

    data_vec = r.add([], sequence(data))
    bounded_data = r.add(["bounded_collections", "bounded_vec", "BoundedVec"],
                         composite([field(data_vec, type_name="Vec<T>")]), [("T", data), ("S", None)])
    info = r.add(["pallet_commitments", "types", "CommitmentInfo"],
                 composite([field(bounded_data, name="fields", type_name="BoundedVec<Data, FieldLimit>")]),
                 [("FieldLimit", None)])
    registration = r.add(["pallet_commitments", "types", "Registration"], composite([
        field(u64, name="deposit", type_name="Balance"),
        field(u32, name="block", type_name="BlockNumber"),
        field(info, name="info", type_name="CommitmentInfo<MaxFields>"),
    ]), [("Balance", u64), ("MaxFields", None), ("BlockNumber", u32)])
    key_tuple = r.add([], tuple_def([netuid, account]))

    call = r.add(["pallet_commitments", "pallet", "Call"], variant_def([
        variant("set_commitment", SET_COMMITMENT_CALL_INDEX, [
            field(netuid, name="netuid", type_name="NetUid"),
            field(info, name="info", type_name="Box<CommitmentInfo<T::MaxFields>>"),
        ]),
        variant("set_max_space", 2, [field(u32, name="new_limit", type_name="u32")]),
    ]), [("T", None)])
    # RuntimeCall: how a composed call is nested (its first byte is the pallet index).
    r.add(["node_subtensor_runtime", "RuntimeCall"], variant_def([
        variant("Commitments", COMMITMENTS_PALLET_INDEX, [field(call, type_name="CallableCallFor<Commitments, Runtime>")]),
    ]))
    extrinsic = r.add(["sp_runtime", "generic", "unchecked_extrinsic", "UncheckedExtrinsic"],
                      sequence(u8))
    runtime = r.add(["node_subtensor_runtime", "Runtime"], composite([]))
    unit = r.add([], tuple_def([]))

    storage_entries = [
        # CommitmentOf: double map netuid (Identity) x account (Twox64Concat) -> Registration
        text("CommitmentOf") + b"\x00"  # modifier: Optional
        + b"\x01" + vec([b"\x06", b"\x05"]) + compact(key_tuple) + compact(registration)
        + vec([]) + vec([]),  # default (empty for Optional), docs
    ]
    commitments = (
        text("Commitments")
        + option(text("Commitments") + vec(storage_entries))
        + option(compact(call))  # calls
        + option(None)  # event
        + vec([text("MaxFields") + compact(u32) + compact(4) + MAX_FIELDS.to_bytes(4, "little") + vec([])])
        + option(None)  # error
        + bytes([COMMITMENTS_PALLET_INDEX])
    )
    signed_extensions = vec([
        text("CheckNonZeroSender") + compact(unit) + compact(unit),
    ])
    extrinsic_md = compact(extrinsic) + bytes([4]) + signed_extensions
    body = r.encode() + vec([commitments]) + extrinsic_md + compact(runtime)
    return b"meta" + bytes([14]) + body
