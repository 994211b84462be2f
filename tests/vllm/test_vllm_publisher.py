"""vLLM 0.33.0's own KV event publisher against the real `kv-epp serve` binary.

`ZmqEventPublisher` (vLLM's class, its own thread, PUB and ROUTER sockets, framing and replay
buffer; see `vllm_kv_events.py` for the few stand-ins it imports) publishes `BlockStored` batches
the way vLLM's scheduler does: the request's cache salt in the first block's `extra_keys`, here
kv-epp's forwarded form `kvepp:<salt>`. kv-epp subscribes through a TCP relay the test can cut
(so its SUB misses batches, as a network blip or a restart of kv-epp would make it), replays
straight from the publisher's ROUTER, and what it believes is read through the admin `/query`
per tenant (`x-tenant-id`). Every wait polls a condition (100 ms, up to 30 s).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pyhelpers import require_modules  # noqa: E402

msgspec, zmq = require_modules(msgspec="msgspec", zmq="pyzmq")
import vllm_kv_events  # noqa: E402

try:
    kv_events = vllm_kv_events.load()
except FileNotFoundError as missing:  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"{missing}; vLLM's publisher tests skipped", allow_module_level=True)

BIN = Path(os.environ.get("KV_EPP_BIN", ROOT / "target" / "debug" / "kv-epp"))
if not BIN.is_file():  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise FileNotFoundError(f"{BIN} not found: build it first (`make vllm-test` does)")
    pytest.skip(f"{BIN} not found; run `make vllm-test`", allow_module_level=True)

BLOCK = 4
DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(cond: Callable[[], bool], what: str, tick: Callable[[], None] | None = None) -> None:
    """Polls `cond` every 100 ms up to 30 s; `tick`, when given, runs about once a second while
    waiting (an engine that keeps working publishes more batches)."""
    deadline = time.monotonic() + DEADLINE_S
    last_tick = time.monotonic()
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        if tick is not None and time.monotonic() - last_tick > 1.0:
            tick()
            last_tick = time.monotonic()
        time.sleep(0.1)


class Relay:
    """A loopback TCP relay in front of the publisher's PUB port that can cut its connections
    and refuse new ones: kv-epp's SUB then misses what is published meanwhile."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = True
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream), timeout=2)
                up.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, up]
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.open = False
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


class Engine:
    """vLLM's `ZmqEventPublisher` on fixed loopback ports (a restart is a new publisher on the
    same ports, its sequence back at 0), with helpers to publish `BlockStored` batches."""

    def __init__(self, pub_port: int, replay_port: int, buffer_steps: int = 10_000):
        self.pub_port, self.replay_port = pub_port, replay_port
        self.publisher = None

        def bound() -> bool:
            # A restarted engine's ports are free once libzmq has closed the old sockets.
            try:
                self.publisher = kv_events.ZmqEventPublisher(
                    data_parallel_rank=0,
                    endpoint=f"tcp://*:{pub_port}",
                    replay_endpoint=f"tcp://*:{replay_port}",
                    buffer_steps=buffer_steps,
                )
                return True
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE:
                    raise
                return False

        eventually(bound, "the publisher's ports")
        self.fillers = 0

    def store(self, hashes: list[int], parent: int | None, tokens: list[int],
              salt: str | None = None) -> None:
        """One batch with one `BlockStored`, as vLLM's scheduler emits it: the request's salt
        (kv-epp's forwarded form) in the first block's extra keys, none on a continuation."""
        assert len(tokens) == len(hashes) * BLOCK
        extra = None
        if salt is not None:
            extra = [(f"kvepp:{salt}",)] + [None] * (len(hashes) - 1)
        event = kv_events.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None, extra_keys=extra, group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        self.publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[event]))

    def filler(self) -> None:
        """Another batch (an unrelated unsalted block), as a busy engine keeps publishing: it
        reveals a gap if the batch before it was missed."""
        self.fillers += 1
        n = 900_000 + self.fillers
        self.store([n], None, [n] * BLOCK)

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
            self.publisher = None


class KvEpp:
    """`kv-epp serve` with one worker whose events come from `events.zmq` (the relay's port for
    the PUB, the publisher's own replay port)."""

    def __init__(self, tmp: Path, events_port: int, replay_port: int):
        self.tmp = tmp
        self.events_port, self.replay_port = events_port, replay_port
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.admin = free_port()
        config = {
            "server": {"bind_address": "127.0.0.1", "grpc_port": free_port(),
                       "grpc_health_port": free_port(), "metrics_port": free_port(),
                       "admin_port": self.admin},
            "events": {"engine": "vllm",
                       "zmq": {"port": self.events_port, "replay_port": self.replay_port}},
            "engine_metrics": {"interval_ms": 0},
            "models": [{"name": "m", "block_size": BLOCK}],
            "workers": [{"endpoint": "127.0.0.1:18100", "model": "m"}],
        }
        path = self.tmp / "kv-epp.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        self.log = self.tmp / f"kv-epp-{self.admin}.log"
        self.proc = subprocess.Popen(
            [str(BIN), "serve", "--config-file", str(path)],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, "KV_EPP_LOG": "info"},
        )

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                return self.get("/workers") is not None
            except OSError:
                return False

        eventually(up, "kv-epp's admin port")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=5) as r:
            return json.load(r)

    def overlap(self, tenant: str | None, tokens: list[int]) -> int:
        """The worker's overlap in tokens as kv-epp computes it for `tenant`'s request."""
        headers = {"content-type": "application/json"}
        if tenant is not None:
            headers["x-tenant-id"] = tenant
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin}/query", method="POST", headers=headers,
            data=json.dumps({"model": "m", "token_ids": tokens}).encode(),
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            body = json.load(r)
        return max((i["overlap_tokens"] for i in body["instances"]), default=0)

    def feed(self) -> dict:
        (w,) = self.get("/workers")["workers"]
        return w["events"]


@pytest.fixture
def setup(tmp_path):
    """Ports, a relay in front of the PUB port, and cleanup of whatever the test started."""
    started: list[Any] = []
    pub_port, replay_port = free_port(), free_port()
    relay = Relay(pub_port)

    def engine(**kw: Any) -> Engine:
        e = Engine(pub_port, replay_port, **kw)
        started.append(e)
        return e

    def kv_epp() -> KvEpp:
        k = KvEpp(tmp_path, relay.port, replay_port)
        started.append(k)
        return k

    yield engine, kv_epp, relay
    for s in reversed(started):
        (s.stop if isinstance(s, KvEpp) else s.shutdown)()
    relay.close()


# Tokens of three requests: tenant-a's two-block prompt and its two-block continuation, and
# tenant-b's own prompt. Engine block hashes are opaque numbers here, as kv-epp treats them.
A = list(range(100, 108))
A2 = list(range(108, 116))
B = list(range(200, 208))


def credit_first_prompt(e, k):
    """Waits until kv-epp is subscribed and credits tenant-a's prompt, publishing it until one
    lands: the PUB drops what it sends before the subscription does."""
    eventually(lambda: k.feed()["connected"], "kv-epp subscribed")
    eventually(lambda: k.overlap("tenant-a", A) == 8, "tenant-a's prompt credited",
               tick=lambda: e.store([1, 2], None, A, salt="tenant-a"))


def test_a_missed_batch_is_replayed_from_vllms_buffer(setup):
    engine, kv_epp, relay = setup
    e = engine()
    k = kv_epp()
    credit_first_prompt(e, k)
    e.store([1, 2], None, A, salt="tenant-a")
    eventually(lambda: k.overlap("tenant-a", A) == 8, "tenant-a's prompt credited")
    relay.cut()
    e.store([3, 4], 2, A2)  # tenant-a's continuation: kv-epp's SUB cannot see it
    e.store([5, 6], None, B, salt="tenant-b")
    relay.restore()
    # The next batches kv-epp sees reveal the gap; the replay brings the missed ones.
    eventually(lambda: k.overlap("tenant-a", A + A2) == 16, "the missed continuation replayed",
               tick=e.filler)
    eventually(lambda: k.overlap("tenant-b", B) == 8, "tenant-b's missed batch replayed")
    assert k.overlap("tenant-b", A + A2) == 0, "never credited to another tenant"
    assert k.overlap(None, A) == 0, "nor to unsalted requests"
    feed = k.feed()
    assert feed["gaps"] >= 1 and feed["replayed"] == feed["gaps"], feed
    assert feed["unfillable_gaps"] == 0 and feed["restarts"] == 0, feed
    assert not feed["cold"], feed


def test_kv_epp_started_against_an_idle_engine_recovers_its_history(setup):
    engine, kv_epp, relay = setup
    e = engine()
    # Published before kv-epp exists; the engine then stays idle.
    e.store([1, 2], None, A, salt="tenant-a")
    e.store([3, 4], 2, A2)
    e.store([5, 6], None, B, salt="tenant-b")
    k = kv_epp()
    eventually(lambda: k.overlap("tenant-a", A + A2) == 16, "tenant-a's history recovered")
    eventually(lambda: k.overlap("tenant-b", B) == 8, "tenant-b's history recovered")
    assert k.overlap("tenant-a", B) == 0 and k.overlap("tenant-b", A) == 0
    # kv-epp restarts: it joins the same idle engine again.
    k.stop()
    k.start()
    eventually(lambda: k.overlap("tenant-a", A + A2) == 16, "recovered again after a restart")
    feed = k.feed()
    assert (feed["gaps"], feed["restarts"], feed["batches"]) == (0, 0, 3), feed
    assert feed["last_sequence"] == 2, feed


def test_an_engine_restart_drops_the_old_state_and_credits_the_new(setup):
    engine, kv_epp, relay = setup
    e = engine()
    k = kv_epp()
    credit_first_prompt(e, k)
    for _ in range(20):  # a busy engine: the old sequence is well past where the new one starts
        e.filler()
    eventually(lambda: k.feed()["last_sequence"] >= 20, "the old engine's batches applied")
    e.shutdown()
    e = engine()  # the engine restarts on the same ports: sequence 0, empty buffer
    e.store([7, 8], None, B, salt="tenant-b")
    eventually(lambda: k.overlap("tenant-b", B) == 8, "the new engine's batch credited",
               tick=e.filler)
    assert k.overlap("tenant-a", A) == 0, "nothing from before the restart is credited"
    feed = k.feed()
    assert feed["restarts"] >= 1 and feed["unfillable_gaps"] == 0, feed


def test_an_unfillable_gap_leaves_the_worker_cold_until_fresh_events(setup):
    engine, kv_epp, relay = setup
    e = engine(buffer_steps=2)
    k = kv_epp()
    credit_first_prompt(e, k)
    relay.cut()
    e.store([5, 6], None, B, salt="tenant-b")  # missed, and soon gone from vLLM's buffer
    for _ in range(4):
        e.filler()
    relay.restore()
    eventually(lambda: k.feed()["unfillable_gaps"] >= 1, "the gap found unfillable",
               tick=e.filler)
    assert k.overlap("tenant-a", A) == 0, "the dropped state is never credited"
    assert k.overlap("tenant-b", B) == 0, "the batch that was lost is not credited either"
    # Fresh events: a new request of tenant-b after the gap.
    e.store([9, 10], None, B, salt="tenant-b")
    eventually(lambda: k.overlap("tenant-b", B) == 8, "fresh events credited")
    assert not k.feed()["cold"]
    assert k.overlap("tenant-a", A) == 0
