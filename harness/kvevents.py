"""KV-cache event publishers as vLLM and SGLang run them: each release's msgspec struct
definitions (re-declared here field for field from that release's `kv_events.py`, read from
its wheel) encoded by msgspec, sent with pyzmq as multipart [topic, seq (8 bytes
big-endian), payload] from a PUB socket, with the replay ROUTER socket and its buffer.
Faults can be injected (a batch not sent, a restart, raw garbage) to test the sidecar
against exactly what it will meet. `test_wire_forms.py` checks the newest forms against
the engines' own classes, byte for byte.

Wire forms (FORMS), each named by the first release that sent it:
  vllm-0.9.0   batch [ts, events]; events tagged arrays [tag, hashes, parent, tokens,
               block_size, lora_id]; BlockRemoved [tag, hashes]
  vllm-0.9.2   + the batch's data_parallel_rank
  vllm-0.10.2  + medium (hashes int or bytes from 0.11)
  vllm-0.14    + lora_name
  vllm-0.17    + extra_keys (defaulted: trailing Nones omitted)
  vllm-0.20    + group_idx
  vllm-0.22    + kv_cache_spec_kind, kv_cache_spec_sliding_window
  vllm-0.24    events are maps tagged `type`, defaults omitted (PR #42892)
  vllm-0.26    replay replies carry the topic frame (PR #45177); + locality
  vllm-0.29    + ownership
  vllm-0.30    + session_id
  vllm-0.33    + lookahead_token_ids
  sglang-0.4.6   batch [ts, events]; events tagged arrays; BlockRemoved [tag, hashes];
                 one BlockStored per page
  sglang-0.4.8   + the batch's attn_dp_rank
  sglang-0.5.10  + medium ("GPU", "CPU_PINNED", ...)
  sglang-0.5.18  no omit_defaults; a salted store is BlockStoredWithMetadata, its
                 {"cache_salt": ...} appended to the array
  sglang-0.5.20  events are maps tagged `type` with cache_salt, session_id (PR #37482)
  sglang-0.5.22  + lora_name; replay replies carry the topic frame
"""
import queue
import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)

Hash = Union[int, bytes]


class Form:
    """One release's structs: batch, BlockStored, BlockRemoved, AllBlocksCleared."""

    def __init__(self, name, engine, batch_fields, stored_fields, removed_fields, *,
                 map_events, omit_defaults=True, batch_omit_defaults=None, replay_topic=False,
                 salt_metadata=False):
        self.name, self.engine = name, engine
        self.replay_topic = replay_topic
        self.per_page = engine == "sglang"  # SGLang stores one BlockStored per page
        self.stored_names = [f[0] for f in stored_fields]
        self.removed_names = [f[0] for f in removed_fields]
        ev = dict(tag_field="type", omit_defaults=omit_defaults, array_like=not map_events, gc=False)
        self.Batch = msgspec.defstruct(
            f"EventBatch_{name}", batch_fields, array_like=True, gc=False,
            omit_defaults=omit_defaults if batch_omit_defaults is None else batch_omit_defaults)
        self.Stored = msgspec.defstruct(f"BlockStored_{name}", stored_fields, tag="BlockStored", **ev)
        self.Removed = msgspec.defstruct(f"BlockRemoved_{name}", removed_fields, tag="BlockRemoved", **ev)
        self.Cleared = msgspec.defstruct(f"AllBlocksCleared_{name}", [], tag="AllBlocksCleared", **ev)
        # The release's typed batch, to decode what a publisher sent (strict types).
        union = Union[self.Stored, self.Removed, self.Cleared]
        self.TypedBatch = msgspec.defstruct(
            f"KVEventBatch_{name}", [(f[0], list[union]) if f[0] == "events" else f for f in batch_fields],
            array_like=True, gc=False,
            omit_defaults=omit_defaults if batch_omit_defaults is None else batch_omit_defaults)
        self.StoredWithMetadata = None
        if salt_metadata:
            meta = msgspec.defstruct(f"BlockStoredMetadata_{name}", [("cache_salt", str)],
                                     omit_defaults=True, gc=False)
            self.StoredWithMetadata = msgspec.defstruct(
                f"BlockStoredWithMetadata_{name}", [("metadata", meta)], bases=(self.Stored,),
                tag="BlockStored", kw_only=True, **ev)
            self.Metadata = meta

    def stored(self, hashes, parent, tokens, block_size, medium=None, lora_name=None, extra_keys=None,
               group_idx=None, kind=None, cache_salt=None, lora_id=None, **more):
        """A BlockStored with the fields this form has; asking for one it lacks is an error
        (so a test cannot believe it sent what the release could not)."""
        given = dict(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                     block_size=block_size, lora_id=lora_id, medium=medium, lora_name=lora_name,
                     extra_keys=extra_keys, group_idx=group_idx, kv_cache_spec_kind=kind,
                     cache_salt=cache_salt, **more)
        if cache_salt is not None and self.StoredWithMetadata is not None:
            given.pop("cache_salt")
            kw = {k: v for k, v in given.items() if k in self.stored_names}
            return self.StoredWithMetadata(metadata=self.Metadata(cache_salt), **kw)
        missing = [k for k, v in given.items() if v is not None and k not in self.stored_names]
        if missing:
            raise ValueError(f"{self.name} has no {missing}")
        return self.Stored(**{k: given.get(k) for k in self.stored_names})

    def removed(self, hashes, medium=None, group_idx=None):
        given = dict(block_hashes=hashes, medium=medium, group_idx=group_idx)
        missing = [k for k, v in given.items() if v is not None and k not in self.removed_names]
        if missing:
            raise ValueError(f"{self.name} has no {missing}")
        return self.Removed(**{k: given.get(k) for k in self.removed_names})

    def cleared(self):
        return self.Cleared()

    def batch(self, events, dp_rank=None, ts=None):
        ts = time.time() if ts is None else ts
        if len(self.Batch.__struct_fields__) == 2:
            return self.Batch(ts, events)
        return self.Batch(ts, events, dp_rank)


def _forms():
    req = lambda name, t: (name, t)  # noqa: E731
    opt = lambda name, t: (name, Optional[t], None)  # noqa: E731
    base = [req("block_hashes", list[Hash]), req("parent_block_hash", Optional[Hash]),
            req("token_ids", list[int]), req("block_size", int), req("lora_id", Optional[int])]
    v_stored = {
        "0.9.0": base,
        "0.10.2": base + [req("medium", Optional[str])],
        "0.14": base + [req("medium", Optional[str]), req("lora_name", Optional[str])],
    }
    v_stored["0.17"] = v_stored["0.14"] + [opt("extra_keys", list[Optional[tuple[Any, ...]]])]
    v_stored["0.20"] = v_stored["0.17"] + [opt("group_idx", int)]
    v_stored["0.22"] = v_stored["0.20"] + [opt("kv_cache_spec_kind", str), opt("kv_cache_spec_sliding_window", int)]
    v_stored["0.26"] = v_stored["0.22"] + [opt("locality", str)]
    v_stored["0.29"] = v_stored["0.26"] + [opt("ownership", str)]
    v_stored["0.30"] = v_stored["0.29"] + [opt("session_id", str)]
    v_stored["0.33"] = v_stored["0.30"] + [opt("lookahead_token_ids", list[list[int]])]
    v_removed = {"0.9.0": [req("block_hashes", list[Hash])]}
    v_removed["0.10.2"] = v_removed["0.9.0"] + [req("medium", Optional[str])]
    v_removed["0.20"] = v_removed["0.10.2"] + [opt("group_idx", int)]
    v_removed["0.26"] = v_removed["0.20"] + [opt("locality", str)]
    v_removed["0.29"] = v_removed["0.26"] + [opt("ownership", str)]
    batch2 = [req("ts", float), req("events", list[Any])]
    v_batch = batch2 + [opt("data_parallel_rank", int)]
    forms = {}

    def vllm(version, stored, removed, batch=v_batch, **kw):
        name = f"vllm-{version}"
        forms[name] = Form(name, "vllm", batch, v_stored[stored], v_removed[removed], **kw)

    vllm("0.9.0", "0.9.0", "0.9.0", batch=batch2, map_events=False)
    vllm("0.9.2", "0.9.0", "0.9.0", map_events=False)
    vllm("0.10.2", "0.10.2", "0.10.2", map_events=False)
    vllm("0.14", "0.14", "0.10.2", map_events=False)
    vllm("0.17", "0.17", "0.10.2", map_events=False)
    vllm("0.20", "0.20", "0.20", map_events=False)
    vllm("0.22", "0.22", "0.20", map_events=False)
    vllm("0.24", "0.22", "0.20", map_events=True)
    vllm("0.26", "0.26", "0.26", map_events=True, replay_topic=True)
    vllm("0.29", "0.29", "0.29", map_events=True, replay_topic=True)
    vllm("0.30", "0.30", "0.29", map_events=True, replay_topic=True)
    vllm("0.33", "0.33", "0.29", map_events=True, replay_topic=True)

    s_medium = base + [opt("medium", str)]
    s_map = s_medium + [opt("cache_salt", str), opt("session_id", str)]
    s_removed = [req("block_hashes", list[int])]
    s_batch = batch2 + [opt("attn_dp_rank", int)]

    def sglang(version, batch, stored, removed, **kw):
        name = f"sglang-{version}"
        forms[name] = Form(name, "sglang", batch, stored, removed, **kw)

    sglang("0.4.6", batch2, base, s_removed, map_events=False)
    sglang("0.4.8", s_batch, base, s_removed, map_events=False)
    sglang("0.5.10", s_batch, s_medium, s_removed + [opt("medium", str)], map_events=False)
    sglang("0.5.18", s_batch, s_medium, s_removed + [opt("medium", str)], map_events=False,
           omit_defaults=False, salt_metadata=True)
    sglang("0.5.20", s_batch, s_map, s_removed + [opt("medium", str)], map_events=True,
           batch_omit_defaults=False)
    sglang("0.5.22", s_batch, s_map + [opt("lora_name", str)], s_removed + [opt("medium", str)],
           map_events=True, batch_omit_defaults=False, replay_topic=True)
    return forms


FORMS = _forms()
LATEST = {"vllm": "vllm-0.33", "sglang": "sglang-0.5.22"}


def form_of(name):
    """A form by name; `vllm` and `sglang` name each engine's newest."""
    return FORMS[LATEST.get(name, name)]


def stored(form, *args, **kw):
    return form_of(form).stored(*args, **kw)


def removed(form, *args, **kw):
    return form_of(form).removed(*args, **kw)


def cleared(form):
    return form_of(form).cleared()


def batch(form, events, dp_rank=None):
    return form_of(form).batch(events, dp_rank)


def chain_events(form, tokens, block_size=16, hash_of=None, parent=None, per_event=None, **fields):
    """BlockStored events for a token chain, as an engine would store it: engine hashes from
    hash_of(i) (default: a stand-in for the engine's own hash), per_event blocks per event
    (SGLang: 1, one per page)."""
    f = form_of(form)
    if per_event is None:
        per_event = 1 if f.per_page else 1 << 30
    hash_of = hash_of or (lambda i: (0x9E3779B97F4A7C15 * (i + 1) + hash(tuple(tokens[:16]))) % (1 << 64))
    n = len(tokens) // block_size
    events = []
    for start in range(0, n, per_event):
        end = min(n, start + per_event)
        hashes = [hash_of(i) for i in range(start, end)]
        events.append(f.stored(hashes, parent, tokens[start * block_size:end * block_size], block_size, **fields))
        parent = hashes[-1]
    return events


class Publisher:
    """ZmqEventPublisher's behaviour: a thread owns a PUB socket (and a replay ROUTER), takes
    batches from a queue, numbers them from 0, sends [topic, seq, payload] and keeps the last
    buffer_steps payloads for replay. replay_topic: answer replays in the live layout
    [b"", topic, seq, payload] and end with [b"", b"", END, b""] (vLLM >= 0.26, SGLang >=
    0.5.22), else [b"", seq, payload] and [b"", END, b""]."""

    def __init__(self, endpoint, replay_endpoint=None, topic="", buffer_steps=10_000, replay_topic=True):
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.pub.bind(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self.replay.bind(replay_endpoint)
        self.topic = topic.encode()
        self.replay_topic = replay_topic
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
        topic = (self.topic,) if self.replay_topic else ()
        for seq, buf in self.buffer:
            if seq >= start_seq:
                self.replay.send_multipart((client, b"", *topic, seq.to_bytes(8, "big"), buf))
        self.replay.send_multipart((client, b"", *((b"",) if self.replay_topic else ()), END_SEQ, b""))
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
    ap.add_argument("--form", choices=sorted(FORMS), default=LATEST["vllm"],
                    help="the wire form, named by the engine release that sends it")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", action="append", default=[], metavar="FIRST:COUNT",
                    help="a cached prompt: token ids FIRST, FIRST+1, ... (repeatable)")
    ap.add_argument("--token-ids", action="append", default=[], metavar="ID,ID,...",
                    help="a cached prompt given by its token ids (e.g. from the stage's /tokenize; repeatable)")
    args = ap.parse_args()
    pub = Publisher(args.bind, args.replay, replay_topic=FORMS[args.form].replay_topic)
    time.sleep(0.5)  # let subscribers connect
    prompts = [list(range(int(f), int(f) + int(n))) for f, n in (spec.split(":") for spec in args.tokens)]
    prompts += [[int(t) for t in spec.split(",") if t.strip()] for spec in args.token_ids]
    for toks in prompts:
        pub.publish(batch(args.form, chain_events(args.form, toks, args.block_size), dp_rank=0))
        print(f"published {len(toks) // args.block_size} blocks of a {len(toks)}-token prompt")
    pub.flush()
    print("serving replays; Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pub.close()


if __name__ == "__main__":
    main()
