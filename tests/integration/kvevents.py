"""KV-cache event publishers as vLLM and SGLang run them: the engines' own msgspec struct
definitions (re-declared here, field for field) encoded by msgspec, sent with pyzmq as
multipart [topic, seq (8 bytes big-endian), payload] from a PUB socket, with the replay
ROUTER socket and its buffer. Faults can be injected (a batch not sent, a restart, raw
garbage) to test the sidecar against exactly what it will meet.

Wire forms (FORMS):
  vllm        vLLM >= 0.11: batch and events are msgspec maps (tag field `type`),
              omit_defaults; hashes int or bytes; lora_name, extra_keys, group_idx, ...
  vllm-array  vLLM 0.9/0.10: array_like batch [ts, events, data_parallel_rank] and
              tagged-array events [tag, hashes, parent, tokens, block_size, lora_id, medium]
  sglang      SGLang: array_like, batch [ts, events], BlockRemoved [tag, hashes];
              one BlockStored per page
"""
import queue
import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- vLLM (vllm/distributed/kv_events.py, map form) ----------------------------------
class VEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    """vLLM's typed batch, for decoding what an engine sent."""
    events: list[Union[VBlockStored, VBlockRemoved, VAllBlocksCleared]]


# --- vLLM 0.10 (array_like) --------------------------------------------------------------
class AEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class AKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ABlockStored(AKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class ABlockRemoved(AKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class AAllBlocksCleared(AKVCacheEvent, tag="AllBlocksCleared"):
    pass


# --- SGLang (python/sglang/srt/disaggregation/kv_events.py) ------------------------------
class SEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None  # newer SGLang: the DP-attention rank


class SKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class SBlockStored(SKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]


class SBlockRemoved(SKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class SAllBlocksCleared(SKVCacheEvent, tag="AllBlocksCleared"):
    pass


FORMS = ("vllm", "vllm-array", "sglang")


def stored(form, hashes, parent, tokens, block_size, medium=None, lora_name=None, extra_keys=None,
           group_idx=None):
    if form == "vllm":
        return VBlockStored(hashes, parent, tokens, block_size, None, medium, lora_name,
                            extra_keys=extra_keys, group_idx=group_idx)
    if form == "vllm-array":
        return ABlockStored(hashes, parent, tokens, block_size, None, medium)
    return SBlockStored(hashes, parent, tokens, block_size, None)


def removed(form, hashes, medium=None, group_idx=None):
    if form == "vllm":
        return VBlockRemoved(hashes, medium, group_idx=group_idx)
    if form == "vllm-array":
        return ABlockRemoved(hashes, medium)
    return SBlockRemoved(hashes)


def cleared(form):
    return {"vllm": VAllBlocksCleared, "vllm-array": AAllBlocksCleared, "sglang": SAllBlocksCleared}[form]()


def batch(form, events, dp_rank=None):
    if form == "vllm":
        return VEventBatch(time.time(), events, dp_rank)
    if form == "vllm-array":
        return AEventBatch(time.time(), events, dp_rank)
    return SEventBatch(time.time(), events, dp_rank)


def chain_events(form, tokens, block_size=16, hash_of=None, parent=None, per_event=None):
    """BlockStored events for a token chain, as an engine would store it: engine hashes from
    hash_of(i) (default: a stand-in for the engine's own hash), per_event blocks per event
    (SGLang: 1, one per page)."""
    if per_event is None:
        per_event = 1 if form == "sglang" else 1 << 30
    hash_of = hash_of or (lambda i: (0x9E3779B97F4A7C15 * (i + 1) + hash(tuple(tokens[:16]))) % (1 << 64))
    n = len(tokens) // block_size
    events = []
    for start in range(0, n, per_event):
        end = min(n, start + per_event)
        hashes = [hash_of(i) for i in range(start, end)]
        events.append(stored(form, hashes, parent, tokens[start * block_size:end * block_size], block_size))
        parent = hashes[-1]
    return events


class Publisher:
    """ZmqEventPublisher's behaviour: a thread owns a PUB socket (and a replay ROUTER), takes
    batches from a queue, numbers them from 0, sends [topic, seq, payload] and keeps the last
    buffer_steps payloads for replay."""

    def __init__(self, endpoint, replay_endpoint=None, topic="", buffer_steps=10_000):
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.pub.bind(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(replay_endpoint)
        self.topic = topic.encode()
        self.buffer = []
        self.buffer_steps = buffer_steps
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.queue = queue.Queue()
        self.running = True
        self.replays_served = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def publish(self, batch, drop=False):
        """Queue a batch; drop=True numbers and buffers it but does not send it (a lost
        message, as when a subscriber's queue overflows)."""
        self.queue.put(("batch", batch, drop))

    def send_raw(self, frames):
        """Send arbitrary frames on the PUB socket (garbage tests); no seq consumed."""
        self.queue.put(("raw", frames, False))

    def send_payload(self, payload, drop=False):
        """Send raw payload bytes as the next numbered batch."""
        self.queue.put(("payload", payload, drop))

    def flush(self, timeout=5):
        done = threading.Event()
        self.queue.put(("flush", done, False))
        if not done.wait(timeout):
            raise TimeoutError("publisher did not flush")

    def _run(self):
        while self.running:
            if self.replay is not None and self.replay.poll(0):
                self._service_replay()
            try:
                kind, item, drop = self.queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if kind == "flush":
                item.set()
            elif kind == "raw":
                self.pub.send_multipart(item)
            else:
                payload = self.encoder.encode(item) if kind == "batch" else item
                seq = self.seq
                self.seq += 1
                if not drop:
                    self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self.buffer.append((seq, payload))
                del self.buffer[:-self.buffer_steps]

    def _service_replay(self):
        frame = self.replay.recv_multipart()
        if len(frame) != 3:
            return
        client, _, start = frame
        start_seq = int.from_bytes(start, "big")
        for seq, buf in self.buffer:
            if seq >= start_seq:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), buf))
        self.replay.send_multipart((client, b"", END_SEQ, b""))
        self.replays_served += 1

    def close(self):
        self.running = False
        self.thread.join(timeout=2)
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def main():
    """Stand in for one engine's KV-event publisher, by hand:
    publish that the engine caches a token range, then keep serving replays."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--bind", default="tcp://127.0.0.1:5557", help="PUB endpoint (vLLM's `endpoint`)")
    ap.add_argument("--replay", default="tcp://127.0.0.1:5558", help="ROUTER endpoint (`replay_endpoint`)")
    ap.add_argument("--form", choices=FORMS, default="vllm")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", action="append", default=[], metavar="FIRST:COUNT",
                    help="a cached prompt: token ids FIRST, FIRST+1, ... (repeatable)")
    args = ap.parse_args()
    pub = Publisher(args.bind, args.replay)
    time.sleep(0.5)  # let subscribers connect
    for spec in args.tokens:
        first, count = map(int, spec.split(":"))
        toks = list(range(first, first + count))
        pub.publish(batch(args.form, chain_events(args.form, toks, args.block_size)))
        print(f"published {count // args.block_size} blocks of tokens {first}..{first + count - 1}")
    pub.flush()
    print("serving replays; Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pub.close()


if __name__ == "__main__":
    main()
