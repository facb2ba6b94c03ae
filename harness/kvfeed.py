"""The kvroute feed protocol (docs/feed-protocol.md), written independently of the Rust
code from the document alone: block hashing, frame encoding and a long-poll feed server.

The real sidecar replaces FeedServer in production; the tests use this one to drive the
filter inside a real Envoy with exactly the bytes the protocol specifies.
"""
import http.server
import json
import random
import struct
import threading
import urllib.parse

import xxhash

SEED = 1337
SEGMENT_BASE_BLOCKS = 32
MAGIC = b"KVRF"
VERSION = 1
DELTA, SNAPSHOT_START, SNAPSHOT_MORE = 0, 1, 2
OP_STORE, OP_REMOVE, OP_CLEAR, OP_STORE_OFFLOADED = 1, 2, 3, 4
ROLES = {"both": 0, "prefill": 1, "decode": 2}


def namespace(lora=None, salt=None):
    """The namespace of blocks stored under a LoRA adapter and/or cache salt; 0 = base."""
    parts = b""
    for tag, value in ((1, lora), (2, salt)):
        if value:
            raw = value.encode()
            parts += bytes([tag]) + struct.pack("<I", len(raw)) + raw
    return xxhash.xxh3_64_intdigest(b"kvroute-ns/1" + parts, seed=SEED) or 1 if parts else 0


def block_hashes(tokens, block_size=16, ns=0):
    """Chained XXH3-64 sequence hashes of every whole block (the first chained onto the
    namespace unless it is the base model's)."""
    out = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        local = xxhash.xxh3_64_intdigest(
            struct.pack(f"<{block_size}I", *tokens[start:start + block_size]), seed=SEED)
        parent = out[-1] if out else (ns or None)
        out.append(local if parent is None else xxhash.xxh3_64_intdigest(
            struct.pack("<QQ", parent, local), seed=SEED))
    return out


def anchor_position(pos):
    if pos < SEGMENT_BASE_BLOCKS:
        return 0
    k = (pos // SEGMENT_BASE_BLOCKS).bit_length() - 1
    return SEGMENT_BASE_BLOCKS << k


def feed_blocks(tokens, block_size=16, ns=0):
    """(hash, anchor) of every whole block, as the feed carries them."""
    h = block_hashes(tokens, block_size, ns)
    return [(h[i], h[anchor_position(i)]) for i in range(len(h))]


def encode_frame(kind, epoch, from_version, to_version, block_size, workers, ops, next_cursor=0):
    """workers: [(id, role, up)]; ops: [(code, worker_index, [(hash, anchor)] or None)]."""
    out = bytearray(MAGIC)
    out += struct.pack("<HBBQQQQIII", VERSION, kind, 0, epoch, from_version, to_version,
                       next_cursor, block_size, len(workers), len(ops))
    for wid, role, up in workers:
        raw = wid.encode()
        out += struct.pack("<B", len(raw)) + raw + struct.pack("<BB", ROLES[role], 0 if up else 1)
    for code, worker, blocks in ops:
        out += struct.pack("<BI", code, worker)
        if code in (OP_STORE, OP_REMOVE, OP_STORE_OFFLOADED):
            out += struct.pack("<I", len(blocks))
            for h, a in blocks:
                out += struct.pack("<QQ", h, a)
    return bytes(out)


def decode_frame(data):
    """A frame as a dict (the inverse of encode_frame); raises ValueError if malformed."""
    if len(data) < 52 or data[:4] != MAGIC:
        raise ValueError("not a KVRF frame")
    version, kind, _flags, epoch, from_v, to_v, cursor, block_size, n_workers, n_ops = \
        struct.unpack_from("<HBBQQQQIII", data, 4)
    if version != VERSION:
        raise ValueError(f"frame version {version}")
    pos = 52
    role_names = {v: k for k, v in ROLES.items()}
    workers = []
    for _ in range(n_workers):
        n = data[pos]
        wid = data[pos + 1:pos + 1 + n].decode()
        role, state = data[pos + 1 + n], data[pos + 2 + n]
        workers.append((wid, role_names[role], state == 0))
        pos += 3 + n
    ops = []
    for _ in range(n_ops):
        code, worker = struct.unpack_from("<BI", data, pos)
        pos += 5
        blocks = None
        if code in (OP_STORE, OP_REMOVE, OP_STORE_OFFLOADED):
            (count,) = struct.unpack_from("<I", data, pos)
            pos += 4
            blocks = [struct.unpack_from("<QQ", data, pos + 16 * i) for i in range(count)]
            pos += 16 * count
        ops.append((code, worker, blocks))
    if pos != len(data):
        raise ValueError("trailing bytes")
    return {"kind": kind, "epoch": epoch, "from": from_v, "to": to_v, "next_cursor": cursor,
            "block_size": block_size, "workers": workers, "ops": ops}


class FeedState:
    """The sidecar's side of the protocol: the fleet, what each worker holds, a change log."""

    def __init__(self, block_size=16, history=1000):
        self.block_size = block_size
        self.epoch = random.getrandbits(63) + 1
        self.version = 0
        self.workers = {}  # id -> [role, up]
        self.held = {}  # id -> {hash: anchor}
        self.log = []  # (version, [(op, id, blocks)])
        self.history = history
        self.cond = threading.Condition()
        self.polls = 0
        self.page_blocks = None  # page snapshots when set
        self.hold_pages = False  # while set, a snapshot's later pages wait (a slow snapshot)
        self.page_requests = 0  # requests for a later page (the client applied the one before)
        self.snapshot = None
        self.snapshot_pages_served = 0

    def _commit(self, ops):
        self.version += 1
        self.log.append((self.version, ops))
        del self.log[:-self.history]
        self.cond.notify_all()

    def set_workers(self, workers):
        """workers: [(id, role, up)] — the whole fleet."""
        with self.cond:
            self.workers = {w: [r, u] for w, r, u in workers}
            for w in list(self.held):
                if w not in self.workers:
                    del self.held[w]
            for w in self.workers:
                self.held.setdefault(w, {})
            self._commit([])

    def store(self, worker, tokens, ns=0):
        """`worker` now holds the blocks of `tokens`, in namespace `ns` (base: 0)."""
        blocks = feed_blocks(tokens, self.block_size, ns)
        with self.cond:
            self.held[worker].update(blocks)
            self._commit([(OP_STORE, worker, blocks)])
        return blocks

    def remove(self, worker, blocks):
        with self.cond:
            for h, _ in blocks:
                self.held[worker].pop(h, None)
            self._commit([(OP_REMOVE, worker, blocks)])

    def clear(self, worker):
        with self.cond:
            self.held[worker] = {}
            self._commit([(OP_CLEAR, worker, None)])

    def release_pages(self):
        with self.cond:
            self.hold_pages = False
            self.cond.notify_all()

    def restart(self):
        """A new epoch, as after a sidecar restart: clients must take a snapshot."""
        with self.cond:
            self.epoch = random.getrandbits(63) + 1
            self._commit([])

    def _worker_list(self):
        ids = list(self.workers)
        return ids, [(w, self.workers[w][0], self.workers[w][1]) for w in ids]

    def answer(self, epoch, since, cursor, timeout_s):
        with self.cond:
            self.polls += 1
            oldest = self.log[0][0] - 1 if self.log else self.version
            if cursor != 0:
                page = self._snapshot_page(epoch, since, cursor)
                if page is not None:
                    return page
            elif epoch == self.epoch and since == self.version:
                self.cond.wait_for(lambda: self.version != since or self.epoch != epoch, timeout_s)
            if epoch != self.epoch or since > self.version or since < oldest or cursor != 0 \
                    or (epoch == 0 and since == 0):
                return self._snapshot_start()
            ids, wl = self._worker_list()
            ops = []
            for v, entries in self.log:
                if v <= since:
                    continue
                for code, w, blocks in entries:
                    if w in ids:
                        ops.append((code, ids.index(w), blocks))
            return encode_frame(DELTA, self.epoch, since, self.version, self.block_size, wl, ops)

    def _snapshot_start(self):
        """A snapshot of the current state, in pages of at most `page_blocks` blocks when
        set (the pages are kept, as the protocol requires, until the next snapshot)."""
        ids, wl = self._worker_list()
        blocks = [(ids.index(w), b) for w in ids for b in self.held.get(w, {}).items()]
        size = self.page_blocks or max(len(blocks), 1)
        pages = []
        for start in range(0, max(len(blocks), 1), size):
            ops = {}
            for wi, b in blocks[start:start + size]:
                ops.setdefault(wi, []).append(b)
            pages.append([(OP_STORE, wi, bs) for wi, bs in ops.items()])
        self.snapshot = (self.epoch, self.version, wl, pages)
        self.snapshot_pages_served += 1
        return encode_frame(SNAPSHOT_START, self.epoch, 0, self.version, self.block_size, wl, pages[0],
                            next_cursor=1 if len(pages) > 1 else 0)

    def _snapshot_page(self, epoch, since, cursor):
        if not self.snapshot:
            return None
        s_epoch, s_version, wl, pages = self.snapshot
        if (epoch, since) != (s_epoch, s_version) or cursor >= len(pages):
            return None
        self.page_requests += 1
        self.cond.wait_for(lambda: not self.hold_pages, 30)
        self.snapshot_pages_served += 1
        return encode_frame(SNAPSHOT_MORE, s_epoch, 0, s_version, self.block_size, wl, pages[cursor],
                            next_cursor=cursor + 1 if cursor + 1 < len(pages) else 0)


class FeedServer:
    """FeedState served over HTTP on loopback, with switches for fault tests."""

    def __init__(self, state, port=0):
        self.state = state
        self.fail_with = None  # an HTTP status to answer instead of a frame
        self.garbage = None  # bytes to answer instead of a frame
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body are separate writes: with Nagle on, the body waits for
            # Envoy's delayed ACK (~40 ms a response).
            disable_nagle_algorithm = True

            def log_message(self, *a):
                pass

            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                view = "/v1/admin/cache-view/"
                if url.path.startswith(view):
                    # The specification's verification endpoint, as the sidecar serves it.
                    wid = urllib.parse.unquote(url.path[len(view):])
                    held = server.state.held.get(wid)
                    if held is None:
                        return self._send(404, json.dumps({"error": f"unknown worker {wid}"}).encode(),
                                          "application/json")
                    body = json.dumps({"worker_id": wid, "block_count": len(held)})
                    return self._send(200, body.encode(), "application/json")
                if url.path != "/v1/kv/feed":
                    return self._send(404, b'{"error":"not found"}', "application/json")
                if server.fail_with:
                    return self._send(server.fail_with, b"", "text/plain")
                if server.garbage is not None:
                    return self._send(200, server.garbage, "application/x-kvroute-feed")
                q = urllib.parse.parse_qs(url.query)
                try:
                    epoch, since, cursor, timeout_ms = (int(q[k][0]) for k in
                                                        ("epoch", "since", "cursor", "timeout_ms"))
                except (KeyError, ValueError):
                    return self._send(400, b'{"error":"bad query"}', "application/json")
                body = server.state.answer(epoch, since, cursor, min(timeout_ms, 1000) / 1000)
                self._send(200, body, "application/x-kvroute-feed")

            def _send(self, status, body, ctype):
                try:
                    self.send_response(status)
                    self.send_header("content-type", ctype)
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # Envoy went away mid-poll (test teardown)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def main():
    """A stand-alone feed server, to route requests by hand before the real sidecar runs:

        python3 harness/kvfeed.py --port 9100 \\
            --workers 127.0.0.1:8101,127.0.0.1:8102 --hold 127.0.0.1:8102=1000:320

    serves the two workers (up, role both) and says 127.0.0.1:8102 caches the prompt of
    token ids 1000..1319 (20 blocks of 16)."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--workers", required=True, help="comma-separated ip:port worker ids")
    ap.add_argument("--hold", action="append", default=[],
                    help="WORKER=FIRST:COUNT: the worker caches token ids FIRST..FIRST+COUNT-1")
    args = ap.parse_args()
    state = FeedState(block_size=args.block_size)
    state.set_workers([(w, "both", True) for w in args.workers.split(",")])
    for h in args.hold:
        worker, rng = h.split("=")
        first, count = (int(x) for x in rng.split(":"))
        state.store(worker, list(range(first, first + count)))
    server = FeedServer(state, port=args.port)
    print(f"kvfeed: serving {len(state.workers)} workers on 127.0.0.1:{server.port}", flush=True)
    server.thread.join()


if __name__ == "__main__":
    main()
