"""Loads vLLM 0.33.0's own `vllm/distributed/kv_events.py` without installing vLLM.

`scripts/setup-venv.sh` downloads the vLLM 0.33.0 wheel (no dependencies) into `.venv/vllm-wheel/`
and extracts only that file into `.venv/vllm-src/`; it is never committed. The file imports four
vLLM names that pull in the rest of vLLM (torch, CUDA, ...); this module puts tiny stand-ins for
exactly those names into `sys.modules` before loading the real file:

- `vllm.config.kv_events.KVEventsConfig`: a plain dataclass of the publisher's settings;
- `vllm.logger.init_logger`: the standard `logging.getLogger`;
- `vllm.utils.network_utils`: `get_ip`, `get_tcp_uri`, `is_valid_ipv6_address`, `split_zmq_path`
  (only used when an endpoint is `tcp://*:0`, which the tests do not use);
- `vllm.v1.core.kv_cache_utils.ExternalBlockHash`: the `bytes | int` alias.

Everything else -- `ZmqEventPublisher`, its thread, its PUB and ROUTER sockets, the framing, the
sequence numbers, the replay buffer and the msgspec event structs -- is vLLM's code, unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KV_EPP_VENV", ROOT / ".venv"))
SOURCE = VENV / "vllm-src" / "vllm" / "distributed" / "kv_events.py"


@dataclasses.dataclass
class KVEventsConfig:
    """Stand-in for `vllm.config.kv_events.KVEventsConfig`: the fields the publisher fills."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port


def _module(name: str, **attrs: object) -> ModuleType:
    m = ModuleType(name)
    m.__path__ = []  # a package, so submodules resolve
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def load() -> ModuleType:
    """Returns vLLM's `kv_events` module (loaded once). Raises FileNotFoundError when the file
    was not extracted (run `make tools`)."""
    if "vllm.distributed.kv_events" in sys.modules:
        return sys.modules["vllm.distributed.kv_events"]
    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} missing: run `make tools` (scripts/setup-venv.sh)")
    for pkg in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"):
        _module(pkg)
    _module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=_split_zmq_path,
    )
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
