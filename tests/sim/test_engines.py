"""`kv-epp-sim sim-worker --engine sglang|trtllm`, decoded independently of the Rust code.

The structs below are written from the wire facts in `shared/spec/kv-events.md` (SGLang:
`python/sglang/srt/disaggregation/kv_events.py` after PRs #30827 and #37482; TensorRT-LLM's
ZeroMQ publisher, PR #17023), not from the simulator: a salted SGLang store carries its salt on
every store (a trailing positional `metadata` map `{cache_salt}` in the array encoding, optional
`cache_salt` / `session_id` fields in the tagged-map encoding), hashes are signed 64-bit integers,
and TensorRT-LLM writes vLLM-shaped tagged maps with no salt. The binary runs on free loopback
ports (see `test_events.py` for the shared harness) and the events are read over real ZeroMQ.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Union

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_events import Worker, check_frames, msgspec  # noqa: E402

# ---------------------------------------------------------------------------------------------
# SGLang, written from the spec.


class SglMetadata(msgspec.Struct):
    """`BlockStoredMetadata`: a plain (map) struct inside the positional event."""

    cache_salt: Union[str, None] = None
    session_id: Union[str, None] = None


class SglArrStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None] = None
    metadata: Union[SglMetadata, None] = None  # only on salted stores


class SglArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Union[str, None] = None


class SglArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class SglArrBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[SglArrStored, SglArrRemoved, SglArrCleared]]
    attn_dp_rank: Union[int, None] = None


class SglMapStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None] = None
    cache_salt: Union[str, None] = None
    session_id: Union[str, None] = None


class SglMapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Union[str, None] = None


class SglMapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class SglMapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[SglMapStored, SglMapRemoved, SglMapCleared]]
    attn_dp_rank: Union[int, None] = None


# TensorRT-LLM's ZeroMQ publisher: tagged maps, signed 64-bit hashes, defaults omitted.


class TrtStored(msgspec.Struct, tag_field="type", tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[list[Any], None]], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None
    locality: Union[str, None] = None


class TrtRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: Union[str, None]
    group_idx: Union[int, None] = None
    locality: Union[str, None] = None


class TrtCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class TrtBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[TrtStored, TrtRemoved, TrtCleared]]
    data_parallel_rank: Union[int, None] = None


INT64 = range(-(2**63), 2**63)


@pytest.fixture
def start(tmp_path):
    workers: list[Worker] = []

    def _start(*flags: str, **kw: Any) -> Worker:
        w = Worker(tmp_path, *flags, **kw)
        workers.append(w)
        return w

    yield _start
    for w in workers:
        w.close()


def batches(w: Worker, decoder, first_seq: int):
    """Yields (decoded batch, raw events) per published message, in sequence."""
    seq = first_seq
    while True:
        frames = w.recv()
        assert frames is not None, f"no batch {seq}"
        payload = check_frames(frames, b"", seq)
        seq += 1
        yield decoder.decode(payload), msgspec.msgpack.decode(payload)[1]


@pytest.mark.parametrize("layout", ["array", "map"])
def test_sglang_salted_stores_carry_the_salt_in_both_encodings(start, layout):
    w = start("--engine", "sglang", "--event-layout", layout, "--num-blocks", "16")
    dec = msgspec.msgpack.Decoder(SglArrBatch if layout == "array" else SglMapBatch)
    it = batches(w, dec, 0)

    def salt_of(ev) -> str | None:
        if layout == "array":
            return ev.metadata.cache_salt if ev.metadata else None
        return ev.cache_salt

    prompt = list(range(100, 110))  # 2 full blocks of 4
    w.complete(prompt)
    b, raw = next(it)
    (ev,) = b.events
    assert isinstance(ev, (SglArrStored, SglMapStored))
    assert salt_of(ev) is None and ev.parent_block_hash is None
    if layout == "array":
        assert len(raw[0]) == 7, "an unsalted store keeps SGLang's legacy 7-element shape"
    else:
        assert "cache_salt" not in raw[0] and "session_id" not in raw[0]
    assert (ev.token_ids, ev.block_size, ev.lora_id, ev.medium) == (prompt[:8], 4, None, "GPU")
    assert all(h in INT64 for h in ev.block_hashes)

    # Salted (as kv-epp forwards it): the salt is on the sequence start ...
    w.complete(prompt, cache_salt="kvepp:tenant-a")
    b, raw = next(it)
    (salted,) = b.events
    assert salt_of(salted) == "kvepp:tenant-a" and salted.parent_block_hash is None
    assert set(salted.block_hashes).isdisjoint(ev.block_hashes), "the salt changes the hashes"
    if layout == "array":
        assert len(raw[0]) == 8 and raw[0][7] == {"cache_salt": "kvepp:tenant-a"}
    # ... and on its continuation, which names its parent.
    w.complete(prompt[:8] + list(range(200, 206)), cache_salt="kvepp:tenant-a")
    (cont,) = next(it)[0].events
    assert salt_of(cont) == "kvepp:tenant-a"
    assert cont.parent_block_hash == salted.block_hashes[-1]
    assert all(h in INT64 for h in [*salted.block_hashes, *cont.block_hashes])

    # SGLang's request rule: an empty salt is no salt; any other string is taken as is; a
    # non-string is refused.
    w.complete(list(range(300, 304)), cache_salt="")
    (empty,) = next(it)[0].events
    assert salt_of(empty) is None
    w.complete(list(range(400, 404)), cache_salt="org/team@x")
    (odd,) = next(it)[0].events
    assert salt_of(odd) == "org/team@x"
    status, _ = w.request(
        "POST", "/v1/completions", {"model": "sim", "prompt": [1, 2, 3, 4], "cache_salt": 7},
    )
    assert status == 400


def test_sglang_server_info_advertises_the_publisher(start):
    w = start("--engine", "sglang", "--topic", "kv")
    status, info = w.request("GET", "/server_info")
    assert status == 200, info
    kv = info["kv_events"]
    assert kv["publisher"] == "zmq" and kv["endpoint_host"] in ("*", "0.0.0.0", "127.0.0.1")
    assert (kv["endpoint_port_base"], kv["topic"], kv["block_size"], kv["dp_size"]) == (
        w.events_port, "kv", 4, 1)
    # Other engines have no such route.
    plain = start("--engine", "vllm", subscribe=False)
    assert plain.request("GET", "/server_info")[0] == 404


def test_sglang_removals_and_resets(start):
    w = start("--engine", "sglang", "--event-layout", "array", "--num-blocks", "4")
    it = batches(w, msgspec.msgpack.Decoder(SglArrBatch), 0)
    w.complete(list(range(100, 116)))  # 4 blocks: the pool is full
    (first,) = next(it)[0].events
    w.complete(list(range(500, 504)), cache_salt="kvepp:t")
    removed, stored = next(it)[0].events
    assert isinstance(removed, SglArrRemoved) and removed.medium == "GPU"
    assert set(removed.block_hashes) <= set(first.block_hashes)
    assert stored.metadata is not None and stored.metadata.cache_salt == "kvepp:t"
    assert w.request("POST", "/reset_prefix_cache")[0] == 200
    (cleared,) = next(it)[0].events
    assert isinstance(cleared, SglArrCleared)


def test_trtllm_publisher_writes_vllm_shaped_maps_with_signed_hashes(start):
    # `--event-layout array` does not apply: TensorRT-LLM always writes maps.
    w = start(
        "--engine", "trtllm", "--event-layout", "array", "--num-blocks", "4",
        "--data-parallel-rank", "1", "--lora-modules", "ad",
    )
    it = batches(w, msgspec.msgpack.Decoder(TrtBatch), 0)
    w.complete(list(range(100, 116)))
    b, raw = next(it)
    assert b.data_parallel_rank == 1
    (ev,) = b.events
    assert set(raw[0]) == {
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name",
    }
    assert (ev.block_size, ev.medium, ev.lora_id, ev.lora_name) == (4, "GPU", None, None)
    assert ev.extra_keys is None, "no salt is published"
    assert all(h in INT64 for h in ev.block_hashes)
    # A salted request: still no salt on the wire (TensorRT-LLM's publisher has none).
    status, body = w.request(
        "POST", "/v1/completions",
        {"model": "ad", "prompt": list(range(600, 604)), "max_tokens": 1, "cache_salt": "kvepp:t"},
    )
    assert status == 200, body
    removed, stored = next(it)[0].events
    assert isinstance(removed, TrtRemoved) and removed.medium == "GPU"
    assert stored.lora_name == "ad" and stored.lora_id == 1 and stored.extra_keys is None
