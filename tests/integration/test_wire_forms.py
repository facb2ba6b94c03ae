"""The wire forms against the engines' own code: the structs `kvevents.py` transcribes for
vLLM 0.33 and SGLang 0.5.22+ encode byte for byte as vLLM 0.33.0's and SGLang 0.5.23's own
classes (loaded from their wheels, `engine_wheels.py`); and the mock engine publishes,
batch for batch and frame for frame, what vLLM 0.33's own `ZmqEventPublisher` publishes for
the same content, and each older release's form when asked."""
import time

import msgspec
import pytest
import zmq

import engine_wheels
from harness import MockEngine, free_port
from harness.kvevents import FORMS

ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def vllm():
    return engine_wheels.vllm_kv_events()


@pytest.fixture(scope="module")
def sglang():
    return engine_wheels.sglang_kv_events()


def test_vllm_0_33_transcription_is_vllms_own(vllm):
    ours = FORMS["vllm-0.33"]
    stored = dict(block_hashes=[2**64 - 1, 7, b"\x01" * 32], parent_block_hash=-5, token_ids=list(range(48)),
                  block_size=16, lora_id=3, medium="CPU", lora_name="sql",
                  extra_keys=[("sql", "salt"), ("sql", ("mm-hash", 0)), None], group_idx=2,
                  kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128, locality="LOCAL",
                  ownership="tier-2", session_id="s-1", lookahead_token_ids=[[1], [2], [3]])
    removed = dict(block_hashes=[7], medium="GPU", group_idx=2, locality="REMOTE", ownership="tier-2")
    sparse = dict(block_hashes=[9], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                  lora_id=None, medium="GPU", lora_name=None)
    theirs = vllm.KVEventBatch(1.25, [vllm.BlockStored(**stored), vllm.BlockStored(**sparse),
                                      vllm.BlockRemoved(**removed), vllm.AllBlocksCleared()], 1)
    mine = ours.Batch(1.25, [ours.Stored(**stored), ours.Stored(**sparse), ours.Removed(**removed),
                             ours.Cleared()], 1)
    assert ENC.encode(mine) == ENC.encode(theirs)
    # And each decodes the other's with strict types, to the same bytes.
    assert ENC.encode(msgspec.msgpack.Decoder(vllm.KVEventBatch).decode(ENC.encode(mine))) == ENC.encode(theirs)
    assert ENC.encode(msgspec.msgpack.Decoder(ours.TypedBatch).decode(ENC.encode(theirs))) == ENC.encode(theirs)


def test_sglang_0_5_22_transcription_is_sglangs_own(sglang):
    ours = FORMS["sglang-0.5.22"]
    stored = dict(block_hashes=[-(2**63), 12], parent_block_hash=99, token_ids=list(range(2)), block_size=1,
                  lora_id=None, medium="CPU_PINNED", cache_salt="tenant", session_id="s", lora_name="sql")
    theirs = sglang.KVEventBatch(2.5, [sglang.BlockStored(**stored), sglang.BlockRemoved(block_hashes=[12]),
                                       sglang.AllBlocksCleared()], 0)
    mine = ours.Batch(2.5, [ours.Stored(**stored), ours.Removed(block_hashes=[12]), ours.Cleared()], 0)
    assert ENC.encode(mine) == ENC.encode(theirs)
    assert msgspec.msgpack.Decoder(sglang.KVEventBatch).decode(ENC.encode(mine)) == theirs
    assert ENC.encode(msgspec.msgpack.Decoder(ours.TypedBatch).decode(ENC.encode(theirs))) == ENC.encode(theirs)


def recv(sock, what):
    assert sock.poll(5000), f"no {what}"
    return sock.recv_multipart()


def replay(endpoint, start=0):
    """Every reply a replay DEALER gets, end marker included."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            msg = recv(dealer, "replay reply")
            out.append(msg)
            if (-1).to_bytes(8, "big", signed=True) in msg[1:3] and msg[-1] == b"":
                return out
    finally:
        dealer.close(linger=0)


def engine_run(wire, prompts, topic=""):
    """A mock engine publishing in `wire`: the messages it sends for `prompts`, and its
    replay replies from seq 0."""
    ev, rp = free_port(), free_port()
    # A wildcard endpoint: vLLM binds those and connects to any other.
    e = MockEngine(events=f"tcp://*:{ev}", replay=f"tcp://*:{rp}", topic=topic,
                   args=["--num-gpu-blocks", "12", "--speedup", "50", "--kv-events-wire", wire])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{ev}")
    time.sleep(0.3)  # the subscription reaches the publisher
    try:
        msgs = []
        for p in prompts:
            e.complete(p, max_tokens=2)
            msgs.append(recv(sub, "event batch"))
        return msgs, replay(f"tcp://127.0.0.1:{rp}")
    finally:
        sub.close(linger=0)
        e.stop()


PROMPTS = [list(range(1000, 1100)), list(range(5000, 5120))]  # the second evicts from the first


def test_the_mock_engine_publishes_what_vllm_0_33_publishes(vllm):
    msgs, replies = engine_run("vllm-0.33", PROMPTS, topic="kv@mock")
    decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)
    batches = []
    for seq, (topic, seq_bytes, payload) in enumerate(msgs):
        assert (topic, seq_bytes) == (b"kv@mock", seq.to_bytes(8, "big"))
        b = decoder.decode(payload)  # vLLM's own strict types
        assert ENC.encode(b) == payload, "not byte for byte what vLLM encodes for this content"
        batches.append(b)
    first = batches[0].events[0]
    assert isinstance(first, vllm.BlockStored) and batches[0].data_parallel_rank == 0
    assert (first.token_ids, first.block_size, first.medium, first.group_idx) == (PROMPTS[0][:96], 16, "GPU", 0)
    assert (first.extra_keys, first.kv_cache_spec_kind, first.lora_id, first.lora_name) == ([None] * 6,
                                                                                             "full_attention", None, None)
    assert [type(e) for e in batches[1].events] == [vllm.BlockRemoved, vllm.BlockStored]

    # vLLM's own publisher, given the same batches, sends the same frames and replies.
    ev, rp = free_port(), free_port()
    real = vllm.ZmqEventPublisher(0, endpoint=f"tcp://*:{ev}", replay_endpoint=f"tcp://*:{rp}", topic="kv@mock")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{ev}")
    time.sleep(0.3)
    try:
        for b in batches:
            real.publish(b)
        assert [recv(sub, "vLLM's batch") for _ in batches] == msgs
        assert replay(f"tcp://127.0.0.1:{rp}") == replies
        assert len(replies) == len(batches) + 1 and replies[-1] == [b"", b"", b"\xff" * 8, b""]
    finally:
        sub.close(linger=0)
        real.shutdown()


# Each of the mock's older forms, and the transcribed releases whose structs give exactly
# its bytes for the mock's content.
OLDER = {
    "vllm-0.26": ["vllm-0.26", "vllm-0.29", "vllm-0.30"],
    "vllm-0.24": ["vllm-0.24"],
    "vllm-0.22": ["vllm-0.22"],
    "vllm-0.20": ["vllm-0.20"],
    "vllm-0.14": ["vllm-0.14"],
    "vllm-0.10.2": ["vllm-0.10.2"],
    "vllm-0.9.2": ["vllm-0.9.2"],
    "vllm-0.9.0": ["vllm-0.9.0"],
}


@pytest.mark.parametrize("wire", sorted(OLDER))
def test_the_mock_engine_publishes_each_older_releases_form(wire):
    msgs, replies = engine_run(wire, PROMPTS)
    for release in OLDER[wire]:
        decoder = msgspec.msgpack.Decoder(FORMS[release].TypedBatch)
        for _, _, payload in msgs:
            assert ENC.encode(decoder.decode(payload)) == payload, release
    topic = FORMS[wire].replay_topic
    assert [len(r) for r in replies] == [4 if topic else 3] * len(replies)
    assert replies[-1] == ([b"", b""] if topic else [b""]) + [b"\xff" * 8, b""]
    assert [r[-1] for r in replies[:-1]] == [m[2] for m in msgs]
