"""Black-box tests of `kv-epp-sim sim-worker` with an independent KV event decoder.

The real binary is started on free loopback ports; requests go over HTTP; KV events are read over
real ZeroMQ (pyzmq/libzmq) and decoded with msgspec structs written from the wire spec
(`shared/spec/kv-events.md`), not from the Rust code. The tests check every field in both event
layouts and both hash forms, that replay returns exactly the batches a subscriber missed (in vLLM
0.33's four-frame form), and that
the simulator's hit accounting (`usage.prompt_tokens_details.cached_tokens`, `/metrics`) agrees
with the cache contents reconstructed from the events alone.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Union

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from pyhelpers import require_modules  # noqa: E402

msgspec, zmq = require_modules(msgspec="msgspec", zmq="pyzmq")
BIN = Path(os.environ.get("KV_EPP_SIM_BIN", ROOT / "target" / "debug" / "kv-epp-sim"))
if not BIN.is_file():  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise FileNotFoundError(f"{BIN} not found: build it first (`make sim-test` does)")
    pytest.skip(f"{BIN} not found; run `make sim-test`", allow_module_level=True)

Hash = Union[int, bytes]

# ---------------------------------------------------------------------------------------------
# The wire, written from the spec.
# Legacy layout: tag-first arrays, fields in declaration order.


def stored_fields(*, lora_and_medium_required: bool) -> list[tuple]:
    """BlockStored's fields in wire order, the same in both layouts; only whether `lora_id`,
    `medium` and `lora_name` may be missing differs (trailing in the legacy arrays, required keys
    in the maps)."""
    default = () if lora_and_medium_required else (None,)
    return [
        ("block_hashes", list[Hash]),
        ("parent_block_hash", Union[Hash, None]),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", Union[int, None], *default),
        ("medium", Union[str, None], *default),
        ("lora_name", Union[str, None], *default),
        ("extra_keys", Union[list[Union[list[Any], None]], None], None),
        ("group_idx", Union[int, None], None),
        ("kv_cache_spec_kind", Union[str, None], None),
        ("kv_cache_spec_sliding_window", Union[int, None], None),
        ("locality", Union[str, None], None),
        ("ownership", Union[str, None], None),
        ("session_id", Union[str, None], None),
        ("lookahead_token_ids", Union[list[int], None], None),
    ]


ArrStored = msgspec.defstruct(
    "ArrStored", stored_fields(lora_and_medium_required=False), array_like=True, tag="BlockStored"
)


class ArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Union[str, None] = None
    group_idx: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None


class ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class ArrBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[ArrStored, ArrRemoved, ArrCleared]]
    data_parallel_rank: Union[int, None] = None


# Current layout: maps tagged by "type"; fields without a default must be present.


MapStored = msgspec.defstruct(
    "MapStored", stored_fields(lora_and_medium_required=True), tag_field="type", tag="BlockStored"
)


class MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Union[str, None]
    group_idx: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None


class MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[MapStored, MapRemoved, MapCleared]]
    data_parallel_rank: Union[int, None] = None


DECODERS = {
    "array": msgspec.msgpack.Decoder(ArrBatch),
    "map": msgspec.msgpack.Decoder(MapBatch),
}
STORED = (ArrStored, MapStored)
REMOVED = (ArrRemoved, MapRemoved)
CLEARED = (ArrCleared, MapCleared)

# Map layout: the keys a plain GPU engine writes (defaults omitted) and the array lengths.
MAP_KEYS = {
    "BlockStored": {
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    },
    "BlockRemoved": {"type", "block_hashes", "medium", "group_idx"},
    "AllBlocksCleared": {"type"},
}
ARRAY_LEN = {"BlockStored": 16, "BlockRemoved": 6, "AllBlocksCleared": 1}

# ---------------------------------------------------------------------------------------------
# Running the real binary.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One `kv-epp-sim sim-worker` process with a SUB socket on its events."""

    def __init__(
        self, tmp: Path, *flags: str, replay: bool = True, subscribe: bool = True,
        defaults: bool = True,
    ):
        self.http = free_port()
        self.events_port = free_port()
        self.replay_port = free_port()
        args = [
            str(BIN), "sim-worker", "--host", "127.0.0.1", "--http-port", str(self.http),
            "--events-endpoint", f"tcp://127.0.0.1:{self.events_port}",
        ]
        if defaults:  # small and instant unless a flag says otherwise
            base = {
                "--model": "sim", "--block-size": "4", "--num-blocks": "64", "--base-us": "0",
                "--prefill-us-per-token": "0", "--decode-us-per-token": "0",
            }
            for flag, value in base.items():
                if flag not in flags:
                    args += [flag, value]
        if replay:
            # The wildcard form vLLM uses by default.
            args += ["--replay-endpoint", f"tcp://*:{self.replay_port}"]
        args += list(flags)
        self.log = tmp / f"worker-{self.http}.log"
        self.proc = subprocess.Popen(
            args, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, "KV_EPP_LOG": "warn"},
        )
        deadline = time.monotonic() + 20
        while "kv-epp-sim sim-worker:" not in (text := self.log.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sim-worker did not start: {self.log.read_text()}")
            time.sleep(0.02)
        self.banner = text
        self.ctx = zmq.Context()
        self.sub = None
        if subscribe:
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.connect(f"tcp://127.0.0.1:{self.events_port}")
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            time.sleep(0.4)  # PUB/SUB slow joiner: let the subscription reach the publisher

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self.proc.kill()
        self.ctx.destroy(linger=0)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}{path}", data=data, method=method,
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def complete(self, tokens: list[int], **extra: Any) -> dict:
        status, body = self.request(
            "POST", "/v1/completions",
            {"model": "sim", "prompt": tokens, "max_tokens": 1, **extra},
        )
        assert status == 200, body
        return body

    def recv(self, timeout_ms: int = 3000) -> list[bytes] | None:
        assert self.sub is not None
        if not self.sub.poll(timeout_ms):
            return None
        return self.sub.recv_multipart()

    def metrics(self) -> dict[str, float]:
        status, text = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


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


def decode(layout: str, payload: bytes):
    return DECODERS[layout].decode(payload)


def check_frames(frames: list[bytes], topic: bytes, seq: int) -> bytes:
    assert len(frames) == 3
    assert frames[0] == topic
    assert len(frames[1]) == 8 and int.from_bytes(frames[1], "big") == seq
    payload = frames[2]
    # [ts float64, events, rank]: fixarray of 3, then a float64 marker.
    assert payload[0] == 0x93 and payload[1] == 0xCB
    return payload


def check_hash(h: Any, form: str, payload: bytes) -> None:
    if form == "int":
        assert isinstance(h, int) and 0 <= h < 2**64
        # Encoded as an unsigned msgpack integer (msgspec writes the same smallest uint form).
        assert msgspec.msgpack.encode(h) in payload
    else:
        assert isinstance(h, bytes) and len(h) == 32


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["array", "map"])
@pytest.mark.parametrize("form", ["int", "bytes"])
def test_every_field_in_both_layouts_and_hash_forms(start, layout, form):
    rank = ["--data-parallel-rank", "2"] if form == "bytes" else []
    w = start(
        "--event-layout", layout, "--hash-form", form, "--topic", "kv@sim",
        "--lora-modules", "ad-x,ad", "--num-blocks", "8", *rank,
    )
    want_rank = 2 if rank else None
    seq = 0
    batches = []

    def next_batch():
        nonlocal seq
        frames = w.recv()
        assert frames is not None, f"no batch {seq}"
        payload = check_frames(frames, b"kv@sim", seq)
        seq += 1
        raw = msgspec.msgpack.decode(payload)
        assert len(raw) == 3 and raw[2] == want_rank
        for ev in raw[1]:
            if layout == "map":
                assert set(ev) == MAP_KEYS[ev["type"]], ev
            else:
                assert len(ev) == ARRAY_LEN[ev[0]], ev
        batch = decode(layout, payload)
        assert abs(batch.ts - time.time()) < 30
        assert batch.data_parallel_rank == want_rank
        batches.append(batch)
        return batch, payload

    prompt = list(range(100, 110))  # 2 full blocks of 4 + 2 tail tokens
    assert w.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    b, payload = next_batch()
    (ev,) = b.events
    assert isinstance(ev, STORED)
    assert len(ev.block_hashes) == 2 and ev.parent_block_hash is None
    for h in ev.block_hashes:
        check_hash(h, form, payload)
    assert ev.token_ids == prompt[:8]
    assert (ev.block_size, ev.lora_id, ev.medium, ev.lora_name) == (4, None, "GPU", None)
    assert ev.extra_keys == [None, None]
    assert (ev.group_idx, ev.kv_cache_spec_kind) == (0, "full_attention")
    assert ev.kv_cache_spec_sliding_window is None and ev.locality is None
    assert ev.ownership is None and ev.session_id is None and ev.lookahead_token_ids is None
    unsalted = ev.block_hashes

    # The same tokens under a salt share nothing; the salt is on the first block only.
    usage = w.complete(prompt, cache_salt="tenant-a", nvext={"cache_salt": "ignored"})["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    (ev,) = next_batch()[0].events
    assert ev.extra_keys == [["tenant-a"], None]
    assert not set(ev.block_hashes) & set(unsalted)

    # A continuation reuses the prefix and names its parent.
    usage = w.complete(prompt + [1, 2])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 8
    assert usage["prompt_tokens"] == 12 and usage["total_tokens"] == 13
    (ev,) = next_batch()[0].events
    assert ev.parent_block_hash == unsalted[-1]
    assert ev.token_ids == (prompt + [1, 2])[8:12] and ev.extra_keys == [None]

    # A LoRA request: the adapter name on every block, then the salt on the first.
    status, body = w.request(
        "POST", "/v1/completions",
        {"model": "ad", "prompt": prompt[:8], "cache_salt": "s", "max_tokens": 1},
    )
    assert status == 200 and body["model"] == "ad"
    (ev,) = next_batch()[0].events
    assert (ev.lora_name, ev.lora_id) == ("ad", 2)
    assert ev.extra_keys == [["ad", "s"], ["ad"]]

    assert w.request("POST", "/reset_prefix_cache")[0] == 200
    (ev,) = next_batch()[0].events
    assert isinstance(ev, CLEARED)
    assert w.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    (ev,) = next_batch()[0].events
    assert isinstance(ev, STORED) and ev.block_hashes == unsalted, "same digests after a reset"

    # 7 new blocks with 6 free: the least recently used block (the tail of the last prompt,
    # freed first) is evicted, announced before the blocks that replace it.
    long_prompt = list(range(500, 528))
    w.complete(long_prompt)
    b, payload = next_batch()
    removed, stored = b.events
    assert isinstance(removed, REMOVED) and isinstance(stored, STORED)
    assert removed.block_hashes == [unsalted[1]]
    check_hash(removed.block_hashes[0], form, payload)
    assert (removed.medium, removed.group_idx, removed.locality, removed.ownership) == (
        "GPU", 0, None, None)
    assert stored.token_ids == long_prompt and len(stored.block_hashes) == 7


class CacheModel:
    """What a consumer knows from the events alone: block identity is (parent, tokens) plus, for
    the first block of a sequence, its extra keys (LoRA name and salt)."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.by_key: dict[tuple, Hash] = {}
        self.key_of: dict[Hash, tuple] = {}

    def apply(self, batch) -> None:
        for ev in batch.events:
            if isinstance(ev, STORED):
                parent = ev.parent_block_hash
                keys = ev.extra_keys or [None] * len(ev.block_hashes)
                for i, h in enumerate(ev.block_hashes):
                    toks = tuple(ev.token_ids[i * self.bs:(i + 1) * self.bs])
                    first = tuple(keys[i] or ()) if parent is None else None
                    key = (parent, toks, first)
                    assert key not in self.by_key, "a block is stored once"
                    self.by_key[key] = h
                    self.key_of[h] = key
                    parent = h
            elif isinstance(ev, REMOVED):
                for h in ev.block_hashes:
                    key = self.key_of.pop(h)
                    del self.by_key[key]
            else:
                self.by_key.clear()
                self.key_of.clear()

    def predict_hit_blocks(self, tokens: list[int], salt: str | None) -> int:
        parent, n = None, 0
        for i in range(len(tokens) // self.bs):
            toks = tuple(tokens[i * self.bs:(i + 1) * self.bs])
            first = tuple([salt] if salt else []) if parent is None else None
            h = self.by_key.get((parent, toks, first))
            if h is None:
                break
            parent, n = h, n + 1
        return n


def test_hit_accounting_agrees_with_the_events(start):
    num_blocks = 12
    w = start("--num-blocks", str(num_blocks), "--event-layout", "map", "--hash-form", "bytes")
    model = CacheModel(4)
    rng = random.Random(5)
    families = [[rng.randrange(1000) for _ in range(24)] for _ in range(4)]
    seq, queried, hits, removed = 0, 0, 0, 0
    for _ in range(60):
        base = rng.choice(families)
        tokens = base[: rng.randrange(4, 25)] + [rng.randrange(1000) for _ in range(rng.randrange(3))]
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        predicted = model.predict_hit_blocks(tokens, salt)
        extra = {"cache_salt": salt} if salt else {}
        usage = w.complete(tokens, **extra)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * predicted, (tokens, salt)
        queried += len(tokens)
        hits += 4 * predicted
        if len(tokens) // 4 > predicted:  # new full blocks: exactly one batch
            frames = w.recv()
            assert frames is not None
            assert int.from_bytes(frames[1], "big") == seq
            seq += 1
            batch = decode("map", frames[2])
            removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, REMOVED))
            model.apply(batch)
        assert len(model.key_of) <= num_blocks
    assert removed > 0, "the pool is small enough to evict"
    assert w.recv(200) is None, "no batch without new blocks"
    m = w.metrics()
    labels = '{model_name="sim",engine="0"}'
    assert m[f"vllm:prefix_cache_queries_total{labels}"] == queried
    assert m[f"vllm:prefix_cache_hits_total{labels}"] == hits
    assert m[f"vllm:num_requests_running{labels}"] == 0
    assert m[f"vllm:kv_cache_usage_perc{labels}"] == 0.0


def replay(w: Worker, start_seq: int, topic: bytes = b"") -> list[tuple[int, bytes]]:
    """Asks the worker's replay ROUTER from `start_seq` as vLLM's subscribers do and reads the
    answer in vLLM 0.33's form: `[b"", topic, seq, payload]` per batch, then the end marker
    `[b"", b"", 0xFFFFFFFFFFFFFFFF, b""]` (four frames each, as a DEALER receives them)."""
    dealer = w.ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{w.replay_port}")
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(5000), "replay answer timed out"
        frames = dealer.recv_multipart()
        assert len(frames) == 4 and frames[0] == b"", frames
        seq = int.from_bytes(frames[2], "big")
        assert len(frames[2]) == 8
        if seq == 0xFFFFFFFFFFFFFFFF:
            assert frames[1] == b"" and frames[3] == b"", "the end marker carries no topic"
            dealer.close(linger=0)
            return out
        assert frames[1] == topic, "every replayed batch carries the publisher's topic"
        out.append((seq, frames[3]))


def test_replay_returns_exactly_the_missed_batches(start):
    w = start("--drop-fraction", "0.5", "--fault-seed", "7", "--event-layout", "array",
              "--topic", "kv")
    n = 24
    for i in range(n):
        w.complete([1000 + i] * 4)  # a new block each: one batch each, seqs 0..n-1
    got: dict[int, bytes] = {}
    while (frames := w.recv(500)) is not None:
        got[int.from_bytes(frames[1], "big")] = frames[2]
    missing = sorted(set(range(n)) - set(got))
    assert missing and got, f"a 0.5 drop fraction should both drop and deliver: {sorted(got)}"
    assert set(got) <= set(range(n))
    replayed = replay(w, missing[0], b"kv")
    assert [s for s, _ in replayed] == list(range(missing[0], n))
    for s, payload in replayed:
        if s in got:
            assert payload == got[s], "replay sends the very bytes that were published"
        (ev,) = decode("array", payload).events
        assert ev.token_ids == [1000 + s] * 4
    assert [s for s, _ in replay(w, n, b"kv")] == []


def test_replay_buffer_keeps_the_last_steps_and_can_be_disabled(start):
    w = start("--buffer-steps", "5")
    for i in range(8):
        w.complete([2000 + i] * 4)
    time.sleep(0.2)
    # Asked from 0, the answer starts past what was asked: the gap cannot be filled.
    assert [s for s, _ in replay(w, 0)] == [3, 4, 5, 6, 7]
    off = start("--disable-replay", "--replay-endpoint", f"tcp://127.0.0.1:{free_port()}",
                replay=False, subscribe=False)
    dealer = off.ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{off.replay_port}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    assert not dealer.poll(500)
    dealer.close(linger=0)


def test_restart_starts_the_sequence_over_and_empties_the_cache(start):
    w = start()
    prompt = [7] * 8
    w.complete(prompt)
    w.complete([8] * 8)
    assert [int.from_bytes(w.recv()[1], "big") for _ in range(2)] == [0, 1]
    assert w.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert w.request("POST", "/admin/restart")[0] == 200
    assert w.recv(300) is None, "a restart publishes nothing about the lost state"
    assert w.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    frames = w.recv()
    assert int.from_bytes(frames[1], "big") == 0, "the sequence goes down: the engine restarted"
    m = w.metrics()
    assert m['vllm:prefix_cache_queries_total{model_name="sim",engine="0"}'] == 8
    assert [s for s, _ in replay(w, 0)] == [0]


@pytest.fixture(scope="module")
def plain_worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("plain"), subscribe=False)
    yield w
    w.close()


@pytest.mark.parametrize(
    "salt",
    ["", "x" * 129, "org/team", "a@b", "back\\slash", "nul\x00", 42, ["a"]],
    ids=["empty", "129-chars", "slash", "at", "backslash", "nul", "number", "list"],
)
def test_invalid_salts_are_refused_like_vllm(plain_worker, salt):
    status, body = plain_worker.request(
        "POST", "/v1/completions", {"model": "sim", "prompt": [1, 2, 3], "cache_salt": salt}
    )
    assert status == 400 and "cache_salt" in body["error"]["message"], body
    assert body["error"]["code"] == 400
    # The longest valid salt is accepted (characters, not bytes).
    assert plain_worker.complete([1, 2, 3], cache_salt="é" * 128)["usage"]["prompt_tokens"] == 3


def test_http_api(start):
    w = start("--lora-modules", "ad", subscribe=False)
    for path, body in [
        ("/v1/completions", {"model": "sim", "prompt": "hello"}),
        ("/v1/completions", {"model": "sim", "prompt": ["hello", "there"]}),
        ("/v1/chat/completions", {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}),
    ]:
        status, err = w.request("POST", path, body)
        assert status == 400
        assert err["error"]["message"] == "text prompts need a tokenizer; send token IDs"
    status, err = w.request("POST", "/v1/completions", {"model": "nope", "prompt": [1]})
    assert status == 404 and "nope" in err["error"]["message"]
    status, models = w.request("GET", "/v1/models")
    assert [m["id"] for m in models["data"]] == ["sim", "ad"]
    assert models["data"][1]["parent"] == "sim"
    assert w.request("GET", "/health")[0] == 200
    # A batch of token-ID prompts runs the first.
    body = w.complete([[5, 6, 7, 8, 9], [1]], max_tokens=3)
    assert body["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"

    # Streaming, with the usage chunk requested.
    conn = http.client.HTTPConnection("127.0.0.1", w.http, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "sim", "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type") == "text/event-stream"
    events = [line[6:] for line in resp.read().decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:3]] == ["sim", " sim", " sim"]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 4}
    # Streaming without include_usage: no usage chunk (as in vLLM).
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "sim", "prompt": [1, 2], "max_tokens": 2, "stream": True}),
        {"content-type": "application/json"})
    text = conn.getresponse().read().decode()
    assert "usage" not in text and text.endswith("data: [DONE]\n\n")

    status, text = w.request("GET", "/metrics")
    for line in [
        "# TYPE vllm:prefix_cache_queries_total counter",
        "# TYPE vllm:prefix_cache_hits_total counter",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:cache_config_info{block_size="4",enable_prefix_caching="True",engine="0",'
        'num_gpu_blocks="64"} 1.0',
    ]:
        assert line in text.splitlines(), text


def test_ttft_follows_the_latency_model(start):
    w = start("--prefill-us-per-token", "3000", "--base-us", "1000", subscribe=False)
    prompt = list(range(64))

    def ttft() -> float:
        conn = http.client.HTTPConnection("127.0.0.1", w.http, timeout=30)
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "sim", "prompt": prompt, "max_tokens": 2, "stream": True}),
            {"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read(5)  # the first chunk
        elapsed = time.monotonic() - t0
        resp.read()
        conn.close()
        return elapsed

    cold = ttft()  # 1 ms + 64 x 3 ms
    warm = ttft()  # 60 tokens cached: 1 ms + 4 x 3 ms
    assert cold >= 0.19, cold
    assert warm < cold / 2, (cold, warm)


def test_prefills_queue_fifo_and_running_is_limited(start):
    import threading

    # Each prefill takes 40 x 2.5 ms = 100 ms; decoding holds the single running slot 150 ms more.
    w = start("--prefill-us-per-token", "2500", "--decode-us-per-token", "50000",
              "--max-num-seqs", "1", subscribe=False)
    done: dict[int, float] = {}
    t0 = time.monotonic()

    def run(i: int) -> None:
        w.complete([i] * 40, max_tokens=4)
        done[i] = time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # arrival order 0, 1, 2
    time.sleep(0.1)
    m = w.metrics()
    labels = '{model_name="sim",engine="0"}'
    assert m[f"vllm:num_requests_running{labels}"] == 1
    assert m[f"vllm:num_requests_waiting{labels}"] == 2
    assert m[f"vllm:kv_cache_usage_perc{labels}"] == 10 / 64
    for t in threads:
        t.join(30)
    # One at a time, in arrival order: each takes at least 100 ms prefill + 150 ms decode.
    assert sorted(done, key=done.get) == [0, 1, 2]
    assert done[2] >= 3 * 0.25, done


def test_block_size_and_adapters_from_the_config_file(start, tmp_path):
    cfg = tmp_path / "kv-epp.yaml"
    cfg.write_text("models:\n  - {name: cfg-model, block_size: 8, lora_adapters: [cfg-ad]}\n")
    w = start("--model", "cfg-model", "--config-file", str(cfg), defaults=False, subscribe=False)
    assert "block_size 8" in w.banner
    status, models = w.request("GET", "/v1/models")
    assert [m["id"] for m in models["data"]] == ["cfg-model", "cfg-ad"]
    assert 'block_size="8"' in w.request("GET", "/metrics")[1]
