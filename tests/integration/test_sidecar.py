"""kvroute-sidecar against publishers that speak exactly as vLLM and SGLang do (their msgspec
structs, pyzmq PUB + replay ROUTER, and the engines' own ZmqEventPublisher): every wire form
of every release (sidecar/README.md, "Compatibility"), faults, the admin API, the feed."""
import atexit
import os
import random
import subprocess
import time

import msgspec
import pytest

import engine_wheels
from harness import SIDECAR, Sidecar, free_port, wait_for
from harness.kvevents import FORMS, Publisher, batch, chain_events, cleared, removed, stored
from harness.kvfeed import OP_STORE, OP_STORE_OFFLOADED, SNAPSHOT_START, decode_frame, feed_blocks, namespace


def tokens(prefix, n):
    return [prefix * 100_000 + i for i in range(n)]


class Fleet:
    """Publishers on loopback ports and a sidecar subscribed to them."""

    def __init__(self, n=2, replay=True, start_sidecar=True, ids=None, sidecar_extra=None, replay_topic=True,
                 address_space=None, buffer_steps=10_000):
        self.pubs, self.ids, self.specs = [], [], []
        self.address_space = address_space
        for i in range(n):
            ev, rp = free_port(), free_port()
            wid = ids[i] if ids else f"127.0.0.1:{free_port()}"
            self.ids.append(wid)
            self.specs.append((wid, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}" if replay else None,
                               "both"))
            self.pubs.append(Publisher(f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}" if replay else None,
                                       replay_topic=replay_topic, buffer_steps=buffer_steps))
        self.extra = sidecar_extra
        self.sidecar = None
        if start_sidecar:
            self.start_sidecar()

    def start_sidecar(self, port=None):
        self.sidecar = Sidecar(self.specs, port=port, extra=self.extra, address_space=self.address_space)
        time.sleep(0.3)  # ZMQ subscriptions propagate asynchronously (the "slow joiner")
        return self.sidecar

    def close(self):
        if self.sidecar:
            self.sidecar.stop()
        for p in self.pubs:
            p.close()


@pytest.fixture
def fleet():
    made = []

    def make(**kw):
        f = Fleet(**kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def snapshot(sc, tiers=False):
    """Every worker's blocks from the feed (all pages): {worker_id: {(hash, anchor)}}; with
    tiers, {worker_id: ({GPU blocks}, {offloaded-only blocks})}."""
    t = "&tiers=1" if tiers else ""
    status, body = sc.get(f"/v1/kv/feed?epoch=0&since=0&cursor=0&timeout_ms=0{t}")
    assert status == 200
    frame = decode_frame(body)
    assert frame["kind"] == SNAPSHOT_START
    frames = [frame]
    while frames[-1]["next_cursor"]:
        _, body = sc.get(f"/v1/kv/feed?epoch={frame['epoch']}&since={frame['to']}"
                         f"&cursor={frames[-1]['next_cursor']}&timeout_ms=0{t}")
        frames.append(decode_frame(body))
    held = {w[0]: (set(), set()) for w in frame["workers"]}
    for f in frames:
        for code, worker, blocks in f["ops"]:
            assert code == OP_STORE or (tiers and code == OP_STORE_OFFLOADED)
            held[frame["workers"][worker][0]][code == OP_STORE_OFFLOADED].update(blocks)
    return held if tiers else {w: gpu for w, (gpu, _) in held.items()}


def metric(sc, name, **labels):
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return sc.metric(key)


HASH_KINDS = {
    "u64": lambda i: (0xC0FFEE00_00000000 + i) % (1 << 64),
    "i64": lambda i: -(i + 1) * 7919,                       # negative: sent as msgpack int64
    "bytes": lambda i: os.urandom(24) + (i + 1).to_bytes(8, "big"),  # sha256-style, vLLM
}


# Every release's form (one row each of the README's table), and each hash encoding.
@pytest.mark.parametrize("form,hash_kind", [(f, "u64") for f in sorted(FORMS)] + [
    ("vllm-0.33", "i64"), ("vllm-0.33", "bytes"), ("vllm-0.10.2", "bytes"), ("vllm-0.20", "i64"),
    ("sglang-0.5.22", "i64"), ("sglang-0.5.10", "i64"),
])
def test_every_payload_form_mirrors_the_routers_chain(fleet, form, hash_kind):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(1, 40 * 16 + 5)  # 40 whole blocks: two and a bit segments
    hashes = [HASH_KINDS[hash_kind](i) for i in range(40)]
    pub.publish(batch(form, chain_events(form, prompt, hash_of=lambda i: hashes[i]), dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 40, what="40 blocks")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt))

    # The same blocks stored again: flat.
    pub.publish(batch(form, chain_events(form, prompt, hash_of=lambda i: hashes[i]), dp_rank=0))
    pub.flush()
    time.sleep(0.2)
    assert sc.block_count(wid) == 40

    # BlockRemoved of the last 8 engine blocks removes exactly those.
    pub.publish(batch(form, [removed(form, hashes[32:])], dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 32, what="32 blocks")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt[:32 * 16]))

    pub.publish(batch(form, [cleared(form)], dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 0, what="cleared")
    assert metric(sc, "kvroute_sidecar_events_total", type="AllBlocksCleared", outcome="applied") == 1
    assert metric(sc, "kvroute_sidecar_batches_bad_total") == 0


def test_engine_blocks_twice_the_router_block_are_split(fleet):
    f = fleet(n=1, sidecar_extra=None)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(2, 8 * 32)
    pub.publish(batch("vllm", chain_events("vllm", prompt, block_size=32)))
    wait_for(lambda: sc.block_count(wid) == 16, what="16 router blocks from 8 engine blocks")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt))
    # 24 is not a multiple of 16: refused and counted, nothing indexed.
    pub.publish(batch("vllm", [stored("vllm", [1], None, tokens(3, 24), 24)]))
    wait_for(lambda: metric(sc, "kvroute_sidecar_events_total", type="BlockStored",
                            outcome="block_size_mismatch") == 1, what="mismatch counted")
    assert sc.block_count(wid) == 16


def test_lora_and_salted_blocks_live_in_their_own_namespace(fleet):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(4, 64)
    # As vLLM stores them: the adapter name in every block's extra keys, the salt in the
    # first block's.
    pub.publish(batch("vllm", [
        stored("vllm", [11, 12, 13, 14], None, prompt, 16, lora_name="sql-adapter",
               extra_keys=[("sql-adapter",)] * 4),
        stored("vllm", [21, 22, 23, 24], None, prompt, 16,
               extra_keys=[("salt-123",), None, None, None]),
        stored("vllm", [31, 32, 33, 34], None, prompt, 16),
        # multimodal identifiers: nothing a request's tokens can name
        stored("vllm", [41, 42, 43, 44], None, prompt, 16,
               extra_keys=[None, ("image-5f1c",), None, None]),
    ]))
    wait_for(lambda: sc.block_count(wid) == 12, what="three chains of 4")
    assert snapshot(sc)[wid] == (set(feed_blocks(prompt, ns=namespace("sql-adapter")))
                                 | set(feed_blocks(prompt, ns=namespace(salt="salt-123")))
                                 | set(feed_blocks(prompt)))
    assert metric(sc, "kvroute_sidecar_events_total", type="BlockStored", outcome="unroutable") == 1


def consecutive_free_ports(n):
    """A port p such that p .. p+n-1 are all free (for DP ranks' offset ports)."""
    import socket
    for _ in range(100):
        p = free_port()
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p + k))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def test_dp_ranks_publish_on_offset_ports_and_clear_alone():
    base = consecutive_free_ports(2)
    wid = f"127.0.0.1:{free_port()}"
    # SGLang with DP attention: rank r publishes on base + r and says so in attn_dp_rank.
    pubs = [Publisher(f"tcp://127.0.0.1:{base + r}") for r in range(2)]
    sc = Sidecar([(wid, f"tcp://127.0.0.1:{base}", None, "both", 2)])
    try:
        time.sleep(0.3)
        a, b = tokens(22, 3 * 16), tokens(23, 2 * 16)
        pubs[0].publish(batch("sglang", chain_events("sglang", a), dp_rank=0))
        pubs[1].publish(batch("sglang", chain_events("sglang", b), dp_rank=1))
        wait_for(lambda: sc.block_count(wid) == 5, what="both ranks' blocks on the one worker")
        ranks = sc.json("/v1/admin/workers")[1]["workers"][0]["dp_ranks"]
        assert [r["last_seq"] for r in ranks] == [0, 0]
        pubs[1].publish(batch("sglang", [cleared("sglang")], dp_rank=1))
        wait_for(lambda: sc.block_count(wid) == 3, what="rank 1 cleared, rank 0 kept")
        assert snapshot(sc)[wid] == set(feed_blocks(a))
    finally:
        sc.stop()
        for p in pubs:
            p.close()


def test_without_kinds_a_block_held_by_two_groups_goes_with_the_last(fleet):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(24, 2 * 16)
    hashes = [61, 62]
    # vLLM 0.20-0.21 name a block's KV-cache group but not its kind: every group counts as
    # full attention (two full-attention groups, say).
    form = "vllm-0.20"
    pub.publish(batch(form, [
        stored(form, hashes, None, prompt, 16, group_idx=0),
        stored(form, hashes, None, prompt, 16, group_idx=1),
    ]))
    wait_for(lambda: sc.block_count(wid) == 2, what="two blocks, stored twice: flat")
    pub.publish(batch(form, [removed(form, hashes, group_idx=1)]))
    pub.flush()
    time.sleep(0.2)
    assert sc.block_count(wid) == 2
    pub.publish(batch(form, [removed(form, hashes, group_idx=0)]))
    wait_for(lambda: sc.block_count(wid) == 0, what="gone with the last group")


@pytest.mark.parametrize("form", ["vllm-0.22", "vllm-0.33"])
def test_only_full_attention_groups_make_hits(fleet, form):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(25, 6 * 16)
    hashes = [71, 72, 73, 74, 75, 76]
    # A hybrid model as vLLM >= 0.22 reports it: group 0 full attention; group 1 a
    # 32-token sliding window, whose store names only the blocks still in the window but
    # carries every token; group 2 Mamba, its state at the end.
    pub.publish(batch(form, [
        stored(form, hashes, None, prompt, 16, medium="GPU", group_idx=0, kind="full_attention"),
        stored(form, hashes[4:], None, prompt, 16, medium="GPU", group_idx=1, kind="sliding_window",
               kv_cache_spec_sliding_window=32),
        stored(form, hashes[5:], hashes[4], prompt[80:], 16, medium="GPU", group_idx=2, kind="mamba"),
    ], dp_rank=0))
    wait_for(lambda: metric(sc, "kvroute_sidecar_events_total", type="BlockStored",
                            outcome="not_full_attention") == 2, what="two groups skipped")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt))
    # The window slides and the full-attention group evicts the tail: the sliding-window
    # removal changes nothing, the full-attention one removes.
    pub.publish(batch(form, [removed(form, hashes[4:], medium="GPU", group_idx=1),
                             removed(form, hashes[3:], medium="GPU", group_idx=0)], dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 3, what="the full-attention prefix left")
    assert metric(sc, "kvroute_sidecar_events_total", type="BlockRemoved", outcome="not_full_attention") == 1
    assert snapshot(sc)[wid] == set(feed_blocks(prompt[:48]))


@pytest.mark.parametrize("replay_topic", [True, False], ids=["topic-frame", "no-topic"])
def test_a_dropped_batch_is_replayed(fleet, replay_topic):
    f = fleet(n=1, replay_topic=replay_topic)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(5, 3 * 16)
    ev = chain_events("vllm", prompt, per_event=1)
    pub.publish(batch("vllm", [ev[0]]))
    pub.publish(batch("vllm", [ev[1]]), drop=True)  # numbered and buffered, never sent
    pub.publish(batch("vllm", [ev[2]]))
    wait_for(lambda: sc.block_count(wid) == 3, what="all three blocks, the lost one replayed")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt))
    m = sc.metrics()
    assert m["kvroute_sidecar_sequence_gaps_total"] == 1
    assert m["kvroute_sidecar_replays_ok_total"] == 1
    assert sum(v for k, v in m.items() if k.startswith("kvroute_sidecar_resets_total")) == 0
    assert pub.replays_served == 1


def test_a_gap_that_cannot_be_replayed_clears_and_rebuilds(fleet):
    f = fleet(n=1, replay=False)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    a, b = tokens(6, 4 * 16), tokens(7, 2 * 16)
    pub.publish(batch("vllm", chain_events("vllm", a)))
    wait_for(lambda: sc.block_count(wid) == 4, what="first chain")
    pub.publish(batch("vllm", [removed("vllm", [123])]), drop=True)  # what did it remove? unknown
    pub.publish(batch("vllm", chain_events("vllm", b)))
    wait_for(lambda: metric(sc, "kvroute_sidecar_resets_total", reason="gap_not_replayed") == 1,
             what="reset counted")
    # Cleared, then rebuilt from what followed the gap.
    wait_for(lambda: snapshot(sc)[wid] == set(feed_blocks(b)), what="only the chain after the gap")


@pytest.mark.parametrize("replay_topic", [True, False], ids=["topic-frame", "no-topic"])
def test_a_publisher_restart_rebuilds_the_worker(fleet, replay_topic):
    f = fleet(n=1, replay_topic=replay_topic)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    a, b = tokens(8, 5 * 16), tokens(9, 3 * 16)
    for _ in range(3):
        pub.publish(batch("vllm", chain_events("vllm", a)))
    wait_for(lambda: sc.metrics().get(f'kvroute_sidecar_worker_last_seq{{worker="{wid}",rank="0"}}') == 2,
             what="seq 2 seen")
    endpoint, replay = f.specs[0][1], f.specs[0][2]
    pub.close()
    time.sleep(0.2)
    # The engine restarted: an empty cache, a new publisher counting from 0.
    f.pubs[0] = pub = Publisher(endpoint, replay, replay_topic=replay_topic)
    time.sleep(0.5)  # the SUB reconnects
    pub.publish(batch("vllm", chain_events("vllm", b)))
    wait_for(lambda: metric(sc, "kvroute_sidecar_resets_total", reason="publisher_restart") == 1,
             what="restart detected")
    wait_for(lambda: snapshot(sc)[wid] == set(feed_blocks(b)), what="only the new chain")


@pytest.mark.parametrize("replay_topic", [True, False], ids=["topic-frame", "no-topic"])
def test_history_from_before_the_sidecar_started_is_replayed(fleet, replay_topic):
    f = fleet(n=1, start_sidecar=False, replay_topic=replay_topic)
    pub, wid = f.pubs[0], f.ids[0]
    a, b = tokens(10, 6 * 16), tokens(11, 2 * 16)
    pub.publish(batch("sglang", chain_events("sglang", a)))  # seq 0, nobody listening
    pub.flush()
    sc = f.start_sidecar()
    pub.publish(batch("sglang", chain_events("sglang", b)))  # seq 1: the sidecar catches up
    wait_for(lambda: sc.block_count(wid) == 8, what="both chains")
    assert snapshot(sc)[wid] == set(feed_blocks(a)) | set(feed_blocks(b))


def checkpointed(sc):
    """Waits until a checkpoint begun after this call is on disk."""
    n = sc.metrics()["kvroute_sidecar_checkpoints_written_total"]
    wait_for(lambda: sc.metrics()["kvroute_sidecar_checkpoints_written_total"] >= n + 2, what="a checkpoint")


@pytest.mark.parametrize("state", [True, False], ids=["checkpoint", "none"])
def test_a_restarted_sidecar_keeps_what_the_replay_buffer_no_longer_holds(fleet, tmp_path, state):
    """The engine has published more batches than its replay buffer keeps (4 here, vLLM's
    10,000) when the sidecar is killed. Restarted without a checkpoint, it can relearn only
    the buffer's batches; with one, it resumes where it stopped and loses nothing."""
    extra = {"state_file": str(tmp_path / "sidecar.state"), "checkpoint_interval_ms": 100} if state else {}
    f = fleet(n=1, buffer_steps=4, sidecar_extra=extra)
    pub, wid = f.pubs[0], f.ids[0]
    chains = [tokens(60 + k, 2 * 16) for k in range(10)]
    for c in chains[:8]:
        pub.publish(batch("vllm", chain_events("vllm", c)))  # seq 0-7; the buffer keeps 4-7
    wait_for(lambda: f.sidecar.block_count(wid) == 16, what="eight chains")
    if state:
        checkpointed(f.sidecar)
    f.sidecar.stop(kill=True)
    pub.publish(batch("vllm", chain_events("vllm", chains[8])))  # seq 8, nobody listening
    pub.flush()
    sc = f.start_sidecar()
    pub.publish(batch("vllm", chain_events("vllm", chains[9])))  # seq 9
    kept = chains if state else chains[6:]  # the buffer holds 6-9 by then
    wait_for(lambda: snapshot(sc)[wid] == set().union(*(feed_blocks(c) for c in kept)),
             what="every chain" if state else "the buffer's chains")
    m = sc.metrics()
    assert (m["kvroute_sidecar_workers_restored_total"], m["kvroute_sidecar_restores_verified_total"]) == \
        ((1, 1) if state else (0, 0))
    assert sum(v for k, v in m.items() if k.startswith("kvroute_sidecar_resets_total")) == 0


def test_a_checkpoint_the_engine_does_not_confirm_is_dropped(fleet, tmp_path):
    """The engine restarted while the sidecar was down and has published past the
    checkpoint's sequence number: its batch there is another one, so what the checkpoint
    held is dropped, never served, and the new history is caught up from 0."""
    f = fleet(n=1, sidecar_extra={"state_file": str(tmp_path / "sidecar.state"), "checkpoint_interval_ms": 100})
    pub, wid = f.pubs[0], f.ids[0]
    old, new = [tokens(80 + k, 2 * 16) for k in range(2)], [tokens(90 + k, 2 * 16) for k in range(4)]
    for c in old:
        pub.publish(batch("vllm", chain_events("vllm", c)))  # seq 0-1
    wait_for(lambda: f.sidecar.block_count(wid) == 4, what="the old chains")
    checkpointed(f.sidecar)
    f.sidecar.stop(kill=True)
    endpoint, replay = f.specs[0][1], f.specs[0][2]
    pub.close()
    time.sleep(0.2)
    f.pubs[0] = pub = Publisher(endpoint, replay)  # restarted: empty, counting from 0 again
    for c in new[:3]:
        pub.publish(batch("vllm", chain_events("vllm", c)))  # seq 0-2
    pub.flush()
    sc = f.start_sidecar()
    pub.publish(batch("vllm", chain_events("vllm", new[3])))
    wait_for(lambda: snapshot(sc)[wid] == set().union(*(feed_blocks(c) for c in new)), what="only the new chains")
    assert metric(sc, "kvroute_sidecar_resets_total", reason="restore_unverified") == 1
    assert sc.metrics()["kvroute_sidecar_restores_verified_total"] == 0


def test_garbage_of_every_shape_is_counted_and_survived(fleet):
    f = fleet(n=2)
    bad, good = f.pubs
    sc = f.sidecar
    prompt = tokens(12, 4 * 16)
    bad.publish(batch("vllm", chain_events("vllm", prompt)))
    wait_for(lambda: sc.block_count(f.ids[0]) == 4, what="first chain")
    real = bytes(bad.encoder.encode(batch("vllm", chain_events("vllm", tokens(13, 4 * 16)))))
    bad.send_raw([b"just one frame"])
    bad.send_raw([b"", b"\x00\x01\x02", b"seq is not 8 bytes"])
    bad.send_raw([b"", b"\x00" * 8, b"x", b"four frames"])
    bad.send_payload(real[: len(real) // 2])                         # truncated
    bad.send_payload(b"\xc1" + os.urandom(64))                        # not msgpack
    bad.send_payload(random.Random(1).randbytes(8 << 20))            # 8 MiB of noise
    bad.send_payload(b"\xdd\xff\xff\xff\xff")                         # array claiming 4G items
    bad.send_payload(b"\x92\xcb" + b"\x00" * 8 + b"\x91\x93\xabBlockStored\x91\x01")  # cut short
    bad.flush()
    # Meanwhile the other worker's stream is served normally.
    good.publish(batch("sglang", chain_events("sglang", tokens(14, 3 * 16))))
    wait_for(lambda: sc.block_count(f.ids[1]) == 3, what="the other worker unaffected")
    wait_for(lambda: sc.metric("kvroute_sidecar_batches_bad_total") == 5, what="5 bad payloads")
    m = sc.metrics()
    assert m["kvroute_sidecar_frames_bad_total"] == 3
    assert m['kvroute_sidecar_resets_total{reason="undecodable_batch"}'] == 5
    assert sc.block_count(f.ids[0]) == 0  # what the bad batches changed is unknown: cleared
    # The stream goes on: a good batch after the garbage is applied.
    bad.publish(batch("vllm", chain_events("vllm", prompt)))
    wait_for(lambda: sc.block_count(f.ids[0]) == 4, what="rebuilt after garbage")
    assert sc.proc.poll() is None


def test_an_unknown_parent_never_corrupts_the_index(fleet):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(15, 4 * 16)
    pub.publish(batch("vllm", chain_events("vllm", prompt, hash_of=lambda i: 100 + i)))
    wait_for(lambda: sc.block_count(wid) == 4, what="chain")
    orphan = tokens(16, 2 * 16)
    pub.publish(batch("vllm", [stored("vllm", [500, 501], 999_999, orphan, 16),  # parent never seen
                               stored("vllm", [502], 501, tokens(17, 16), 16)]))  # child of the orphan
    wait_for(lambda: metric(sc, "kvroute_sidecar_events_total", type="BlockStored",
                            outcome="unknown_parent") == 2, what="both skipped")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt))
    # A removal of the skipped blocks is counted, not applied to anything else.
    pub.publish(batch("vllm", [removed("vllm", [500, 501])]))
    wait_for(lambda: metric(sc, "kvroute_sidecar_events_total", type="BlockRemoved",
                            outcome="not_held") == 1, what="removal of unheld counted")
    assert sc.block_count(wid) == 4


def test_offloaded_copies_keep_a_block_held(fleet):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(18, 2 * 16)
    ev = chain_events("vllm", prompt, hash_of=lambda i: 40 + i)
    cpu = [stored("vllm", e.block_hashes, e.parent_block_hash, e.token_ids, 16, medium="CPU") for e in ev]
    pub.publish(batch("vllm", ev + cpu))
    wait_for(lambda: sc.block_count(wid) == 2, what="two blocks")
    assert snapshot(sc, tiers=True)[wid] == (set(feed_blocks(prompt)), set())
    pub.publish(batch("vllm", [removed("vllm", [40, 41], medium="GPU")]))
    wait_for(lambda: sc.json("/v1/admin/workers")[1]["workers"][0]["offloaded_blocks"] == 2,
             what="held offloaded only")
    assert sc.block_count(wid) == 2
    # Clients that ask for tiers are told; others see plain stores.
    assert snapshot(sc, tiers=True)[wid] == (set(), set(feed_blocks(prompt)))
    assert snapshot(sc)[wid] == set(feed_blocks(prompt))
    pub.publish(batch("vllm", [removed("vllm", [40, 41], medium="CPU")]))
    wait_for(lambda: sc.block_count(wid) == 0, what="gone from every tier")


def test_cpu_tier_from_both_offload_event_forms(fleet):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    form = "vllm-0.33"
    a = tokens(26, 4 * 16)
    ha = [81, 82, 83, 84]

    def offloaded():
        return sc.json("/v1/admin/workers")[1]["workers"][0]["offloaded_blocks"]

    pub.publish(batch(form, [stored(form, ha, None, a, 16, medium="GPU", group_idx=0)], dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 4, what="GPU chain")
    # vLLM's offloading connector by default: one placeholder per offloaded block, its hash
    # only (no tokens, block_size 0). The blocks are known from their GPU store.
    pub.publish(batch(form, [stored(form, [h], None, [], 0, medium="CPU", group_idx=0) for h in ha]
                      + [stored(form, [999], None, [], 0, medium="CPU", group_idx=0)], dp_rank=0))
    pub.publish(batch(form, [removed(form, ha, medium="GPU", group_idx=0)], dp_rank=0))
    wait_for(lambda: offloaded() == 4, what="four blocks held in CPU memory only")
    assert snapshot(sc, tiers=True)[wid] == (set(), set(feed_blocks(a)))
    assert metric(sc, "kvroute_sidecar_events_total", type="BlockStored", outcome="unknown_block") == 1

    # With `self_describing_kv_events` (vLLM >= 0.24): a chunk's store carries its blocks'
    # hashes, parent and tokens, and a block shared by two chunks is announced by each.
    b = tokens(27, 2 * 16)
    c1, c2 = b + tokens(28, 2 * 16), b + tokens(29, 2 * 16)
    pub.publish(batch(form, [stored(form, [91, 92, 93, 94], None, c1, 16, medium="CPU", group_idx=0),
                             stored(form, [91, 92, 95, 96], None, c2, 16, medium="CPU", group_idx=0)], dp_rank=0))
    wait_for(lambda: offloaded() == 10, what="two chunks, six blocks")
    pub.publish(batch(form, [removed(form, [91, 92, 93, 94], medium="CPU", group_idx=0)], dp_rank=0))
    wait_for(lambda: offloaded() == 8, what="the first chunk evicted")
    assert snapshot(sc, tiers=True)[wid][1] == set(feed_blocks(a)) | set(feed_blocks(c2))
    pub.publish(batch(form, [removed(form, [91, 92, 95, 96] + ha, medium="CPU", group_idx=0)], dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 0, what="every tier empty")


@pytest.mark.parametrize("form,salt_field", [
    ("sglang-0.5.18", "metadata"), ("sglang-0.5.20", "cache_salt"), ("sglang-0.5.22", "cache_salt")])
def test_sglang_salted_pages_live_in_their_namespace(fleet, form, salt_field):
    f = fleet(n=1, replay_topic=FORMS[form].replay_topic)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    prompt = tokens(30, 3 * 16)
    # One BlockStored per page, each naming the salt (the engine's hashes differ too).
    salted = chain_events(form, prompt, hash_of=lambda i: 7000 + i, cache_salt="tenant-9")
    pub.publish(batch(form, salted + chain_events(form, prompt), dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 6, what="salted and plain chains")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt, ns=namespace(salt="tenant-9"))) | set(feed_blocks(prompt))
    if form == "sglang-0.5.22":
        pub.publish(batch(form, chain_events(form, tokens(31, 16), hash_of=lambda i: 8000 + i, lora_name="sql"),
                          dp_rank=0))
        wait_for(lambda: sc.block_count(wid) == 7, what="the adapter's page")
        assert set(feed_blocks(tokens(31, 16), ns=namespace("sql"))) <= snapshot(sc)[wid]


def test_sglang_bigram_pages_index_their_tokens(fleet):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    form = "sglang-0.5.22"
    prompt = tokens(32, 2 * 16 + 1)
    # EAGLE's bigram keys: each page's tokens are (token, next token) pairs.
    pairs = [[prompt[i], prompt[i + 1]] for i in range(32)]
    pub.publish(batch(form, [stored(form, [1], None, pairs[:16], 16, medium="GPU"),
                             stored(form, [2], 1, pairs[16:], 16, medium="GPU")], dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 2, what="two pages")
    assert snapshot(sc)[wid] == set(feed_blocks(prompt[:32]))


def test_unknown_fields_and_keys_are_ignored(fleet):
    f = fleet(n=1)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    a, b, c = tokens(33, 32), tokens(34, 16), tokens(35, 16)
    # vLLM 0.33's newest fields, set.
    pub.publish(batch("vllm-0.33", [stored("vllm-0.33", [1, 2], None, a, 16, medium="GPU", group_idx=0,
                                           kind="full_attention", locality="LOCAL", ownership="t2",
                                           session_id="s-1", lookahead_token_ids=[[7], [8]])], dp_rank=0))
    # A future release: more trailing fields in arrays, more keys in maps, another event type.
    enc = msgspec.msgpack.Encoder()
    pub.send_payload(enc.encode([time.time(), [
        ["BlockStored", [3], None, b, 16, None, "GPU", None, None, 0, "full_attention", None, "new", [1, 2]],
        {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": None, "token_ids": c, "block_size": 16,
         "lora_id": None, "medium": "GPU", "lora_name": None, "future": {"nested": [1, {"x": None}]}},
        {"type": "BlockPinned", "block_hashes": [4]},
    ], 0, "trailing batch field"]))
    wait_for(lambda: sc.block_count(wid) == 4, what="all four blocks")
    assert snapshot(sc)[wid] == set(feed_blocks(a)) | set(feed_blocks(b)) | set(feed_blocks(c))
    assert metric(sc, "kvroute_sidecar_events_total", type="unknown", outcome="malformed") == 1
    assert metric(sc, "kvroute_sidecar_batches_bad_total") == 0


class EnginePublisher:
    """The engine's own ZmqEventPublisher (vLLM 0.33.0 or SGLang 0.5.23, from their wheels),
    with one fault: drop_next() makes its PUB socket skip the next send, so the batch is
    numbered and buffered but lost in transit."""

    def __init__(self, engine, endpoint, replay_endpoint):
        self.mod = engine_wheels.vllm_kv_events() if engine == "vllm" else engine_wheels.sglang_kv_events()
        self.engine = engine
        self.pub = self.mod.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay_endpoint)
        self.drops = 0
        real, outer = self.pub._pub, self

        class Lossy:
            def send_multipart(self, frames, *args, **kw):
                if outer.drops:
                    outer.drops -= 1
                    return None
                return real.send_multipart(frames, *args, **kw)

            def __getattr__(self, name):
                return getattr(real, name)

        self.pub._pub = Lossy()

    def chain(self, toks, first_hash):
        """The engine's BlockStored events for a chain of whole blocks."""
        m, n = self.mod, len(toks) // 16
        hashes = [first_hash + i for i in range(n)]
        if self.engine == "vllm":
            return [m.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks, block_size=16,
                                  lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * n, group_idx=0,
                                  kv_cache_spec_kind="full_attention")]
        return [m.BlockStored(block_hashes=[h], parent_block_hash=hashes[i - 1] if i else None,
                              token_ids=toks[16 * i:16 * i + 16], block_size=16, lora_id=None, medium="GPU")
                for i, h in enumerate(hashes)]

    def publish(self, events, drop=False):
        if drop:
            self.drops += 1
        self.pub.publish(self.mod.KVEventBatch(time.time(), events))

    def close(self):
        self.pub.shutdown()
        atexit.unregister(self.pub.shutdown)  # SGLang's registers itself; once is enough


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_gaps_and_catch_up_are_replayed_from_the_engines_own_publisher(engine):
    ev, rp = free_port(), free_port()
    wid = f"127.0.0.1:{free_port()}"
    pub = EnginePublisher(engine, f"tcp://*:{ev}", f"tcp://*:{rp}")
    sc = None
    try:
        a, b, c, d = (tokens(40 + k, 2 * 16) for k in range(4))
        pub.publish(pub.chain(a, 100))  # seq 0, before the sidecar subscribed
        time.sleep(0.2)
        sc = Sidecar([(wid, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", "both")])
        time.sleep(0.3)
        pub.publish(pub.chain(b, 200))  # seq 1: the sidecar catches up on seq 0
        wait_for(lambda: sc.block_count(wid) == 4, what="caught up")
        pub.publish(pub.chain(c, 300), drop=True)  # seq 2, lost
        pub.publish(pub.chain(d, 400))  # seq 3: a gap, repaired by replay
        wait_for(lambda: sc.block_count(wid) == 8, what="the lost batch replayed")
        assert snapshot(sc)[wid] == set().union(*(feed_blocks(t) for t in (a, b, c, d)))
        m = sc.metrics()
        assert (m["kvroute_sidecar_sequence_gaps_total"], m["kvroute_sidecar_replays_ok_total"]) == (1, 2)
        assert m["kvroute_sidecar_frames_bad_total"] == 0
        assert sum(v for k, v in m.items() if k.startswith("kvroute_sidecar_resets_total")) == 0
    finally:
        if sc:
            sc.stop()
        pub.close()


# The largest payload the sidecar's sockets take (64 MiB), less room for the frame.
BIG = (64 << 20) - 4096


def peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_oversized_claims_survive_a_memory_limit(fleet):
    """Payloads whose headers claim as much as they can, at the largest size, to a sidecar
    that may map 1 GiB (it idles at ~160 MB; before the reservations were bounded, the first
    payload asked for 9.6 GB and aborted it): refused before the claimed lists are read,
    counted and survived. So is a payload packed with millions of the smallest real
    events (over the 65,536 events a batch may hold); one at the cap is applied as it
    decodes, one event at a time."""
    f = fleet(n=1, address_space=1 << 30)
    pub, sc, wid = f.pubs[0], f.sidecar, f.ids[0]
    # [0, [nil × 64M claimed]]: an array of events whose header claims 16M+ of them.
    n = BIG - 7
    pub.send_payload(b"\x92\x00\xdd" + n.to_bytes(4, "big") + b"\xc0" * n)
    # BlockStored claiming 64M hashes, and 64M tokens.
    pub.send_payload(b"\x92\x00\x91\x96\xabBlockStored\xdd" + (BIG - 20).to_bytes(4, "big") + b"\xc0" * (BIG - 20))
    pub.send_payload(b"\x92\x00\x91\x96\xabBlockStored\x90\xc0\xdd" + (BIG - 22).to_bytes(4, "big")
                     + b"\xc1" * (BIG - 22))
    # The smallest real events, as many as fit in 64 MiB: ["BlockStored", [], nil, [], 16]
    # (no block: vacuous) and ["AllBlocksCleared"].
    small = msgspec.msgpack.encode(["BlockStored", [], None, [], 16])
    clear = msgspec.msgpack.encode(["AllBlocksCleared"])
    for event in (small, clear):
        count = (BIG - 16) // len(event)
        pub.send_payload(b"\x92\x00\xdd" + count.to_bytes(4, "big") + event * count)
    pub.flush(timeout=30)
    wait_for(lambda: sc.metric("kvroute_sidecar_batches_bad_total") == 5, timeout=30, what="5 bad payloads")
    assert sc.metric("kvroute_sidecar_batches_over_cap_total") == 5
    # At the cap: applied.
    cap = 65536
    for event in (small, clear):
        pub.send_payload(b"\x92\x00\xdd" + cap.to_bytes(4, "big") + event * cap)
    pub.flush(timeout=30)
    wait_for(lambda: sc.metric('kvroute_sidecar_events_total{type="AllBlocksCleared",outcome="applied"}')
             == cap, timeout=60, what="the batches at the cap applied")
    assert sc.metric('kvroute_sidecar_events_total{type="BlockStored",outcome="applied"}') == cap
    peak = peak_rss_mb(sc.proc.pid)
    print(f"peak RSS after 64 MiB payloads: {peak:.0f} MB")
    # And it goes on: a real batch is indexed.
    pub.publish(batch("vllm", chain_events("vllm", tokens(50, 32)), dp_rank=0))
    wait_for(lambda: sc.block_count(wid) == 2, what="a real batch after the hostile ones")
    assert sc.proc.poll() is None, sc.logs()[-2000:]
    assert peak < 400


def test_a_silent_worker_whose_health_fails_is_marked_down(fleet):
    f = fleet(n=1)  # its id is a closed port: /health cannot answer
    sc, wid, pub = f.sidecar, f.ids[0], f.pubs[0]

    def state():
        return sc.json("/v1/admin/workers")[1]["workers"][0]["state"]

    wait_for(lambda: state() == "down", timeout=5, what="marked down")
    _, body = sc.get("/v1/kv/feed?epoch=0&since=0&cursor=0&timeout_ms=0")
    assert decode_frame(body)["workers"][0] == (wid, "both", False)
    pub.publish(batch("vllm", chain_events("vllm", tokens(19, 16))))
    wait_for(lambda: state() == "up", timeout=5, what="up again on its next event")


def test_admin_api(fleet):
    f = fleet(n=1)
    sc, wid = f.sidecar, f.ids[0]
    f.pubs[0].publish(batch("vllm", chain_events("vllm", tokens(20, 3 * 16))))
    wait_for(lambda: sc.block_count(wid) == 3, what="3 blocks")
    status, body = sc.get(f"/v1/admin/cache-view/{wid}")
    assert status == 200 and body == f'{{"worker_id":"{wid}","block_count":3}}'.encode()
    status, body = sc.json("/v1/admin/cache-view/10.9.9.9:1")
    assert status == 404 and body["error"] == "unknown worker"
    status, workers = sc.json("/v1/admin/workers")
    w = workers["workers"][0]
    assert (w["id"], w["role"], w["blocks"], w["last_seq"]) == (wid, "both", 3, 0)
    assert w["lag_ms"] is not None and w["lag_ms"] < 5000
    status, body = sc.get("/v1/kv/feed?epoch=0&since=x&cursor=0&timeout_ms=0")
    assert status == 400 and b"since" in body
    assert sc.get("/healthz")[0] == 200
    m = sc.metrics()
    assert m[f'kvroute_sidecar_worker_blocks{{worker="{wid}",role="both"}}'] == 3
    assert m['kvroute_sidecar_events_total{type="BlockStored",outcome="applied"}'] == 1
    assert m["kvroute_sidecar_feed_bad_requests_total"] == 1


def test_a_feed_poll_waits_for_the_next_change(fleet):
    f = fleet(n=1)
    sc = f.sidecar
    _, body = sc.get("/v1/kv/feed?epoch=0&since=0&cursor=0&timeout_ms=0")
    snap = decode_frame(body)
    t0 = time.time()
    _, body = sc.get(f"/v1/kv/feed?epoch={snap['epoch']}&since={snap['to']}&cursor=0&timeout_ms=300")
    empty = decode_frame(body)
    assert time.time() - t0 >= 0.25 and empty["ops"] == [] and empty["from"] == empty["to"] == snap["to"]
    import threading
    threading.Timer(0.3, lambda: f.pubs[0].publish(
        batch("vllm", chain_events("vllm", tokens(21, 16))))).start()
    # The next change may be the worker table's (its entry updated) before the blocks':
    # poll on from each answer until the stored blocks come.
    since, deadline = snap["to"], time.time() + 5
    while True:
        _, body = sc.get(f"/v1/kv/feed?epoch={snap['epoch']}&since={since}&cursor=0&timeout_ms=5000")
        delta = decode_frame(body)
        assert delta["to"] > since, "a poll with a timeout answered without a change"
        if delta["ops"] or time.time() > deadline:
            break
        since = delta["to"]
    assert delta["ops"] and delta["ops"][0][0] == OP_STORE, delta


def test_a_lingering_poll_gathers_changes_close_together(fleet):
    """`linger_ms` (the sync service's feed_linger_ms): once a poll has a change to send, its
    answer waits that long for more. Snapshots and polls that time out are never held."""
    import threading
    # No health checks: a worker marked down is a change too, and would be held.
    f = fleet(n=2, sidecar_extra={"health_path": ""})
    sc = f.sidecar
    ids = set(f.ids)
    t0 = time.time()
    _, body = sc.get("/v1/kv/feed?epoch=0&since=0&cursor=0&timeout_ms=0&linger_ms=1000")
    snap = decode_frame(body)
    assert snap["kind"] == SNAPSHOT_START and time.time() - t0 < 0.5

    def poll(since, linger, timeout=5000):
        t = time.time()
        _, body = sc.get(f"/v1/kv/feed?epoch={snap['epoch']}&since={since}&cursor=0"
                         f"&timeout_ms={timeout}&linger_ms={linger}")
        frame = decode_frame(body)
        return frame, time.time() - t, {frame["workers"][w][0] for _, w, _ in frame["ops"]}

    def two_changes(first):
        for delay, w in ((0.2, 0), (0.5, 1)):
            threading.Timer(delay, lambda w=w: f.pubs[w].publish(
                batch("vllm", chain_events("vllm", tokens(first + w, 16))))).start()

    # Waiting: the change at 0.2 s is held 0.8 s, and the one at 0.5 s goes with it.
    two_changes(40)
    delta, took, workers = poll(snap["to"], 800)
    assert took >= 0.95 and workers == ids, (took, workers)
    # Without a linger the same two changes take two answers.
    two_changes(50)
    first, took, workers = poll(delta["to"], 0)
    assert took < 0.45 and len(workers) == 1, (took, workers)
    wait_for(lambda: metric(sc, "kvroute_sidecar_events_total", type="BlockStored", outcome="applied") >= 4,
             what="the second change")
    # A change already there when the poll arrives is held too.
    second, took, workers = poll(first["to"], 600)
    assert took >= 0.55 and len(workers) == 1 and second["to"] > first["to"], (took, workers)
    # Nothing changes: answered at the poll's timeout, not held beyond it.
    empty, took, _ = poll(second["to"], 1000, timeout=300)
    assert empty["from"] == empty["to"] == second["to"] and 0.25 <= took < 0.9, (took, empty)


@pytest.mark.parametrize("text,field", [
    ("block_size = 0\n", "block_size"),
    ('[[workers]]\nid = "nohost"\nevents = "tcp://127.0.0.1:5557"\n', "workers[0].id"),
    ('[[workers]]\nid = "127.0.0.1:1"\nevents = "tcp://127.0.0.1:5557"\nrole = "x"\n', "workers[0].role"),
    ('surprise = 1\n', "surprise"),
])
def test_a_bad_config_refuses_to_start_naming_the_field(tmp_path, text, field):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    r = subprocess.run([str(SIDECAR), "--config", str(p)], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and field in r.stderr, r.stderr
