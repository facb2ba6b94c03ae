#!/usr/bin/env python3
"""Event payloads for the ingest benchmark, encoded by msgspec exactly as vLLM publishes
them (tests/integration/kvevents.py has the engines' struct definitions).

    python3 sidecar/benches/make_events.py OUT [FORM] [BLOCKS]

Writes OUT: repeated [u32 LE worker][u32 LE length][payload]. Each of 16 workers stores
chains of 64 blocks (1024 tokens, 16 per block), 4 BlockStored events of 16 blocks per
batch (a scheduler step storing four requests' prompt blocks); SGLang sends one page per
event, so its batches hold 64 events of one block.
"""
import pathlib
import random
import struct
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "integration"))
import msgspec  # noqa: E402
from kvevents import batch, stored  # noqa: E402

WORKERS = 16
CHAIN_BLOCKS = 64
BLOCK = 16


def main():
    out = pathlib.Path(sys.argv[1])
    form = sys.argv[2] if len(sys.argv) > 2 else "vllm"
    total = int(sys.argv[3]) if len(sys.argv) > 3 else 1_000_000
    per_event = 1 if form == "sglang" else 16
    rng = random.Random(7)
    enc = msgspec.msgpack.Encoder()
    with out.open("wb") as f:
        made, chain = 0, 0
        while made < total:
            w = chain % WORKERS
            tokens = [rng.randrange(150_000) for _ in range(CHAIN_BLOCKS * BLOCK)]
            hashes = [rng.getrandbits(64) for _ in range(CHAIN_BLOCKS)]
            events, parent = [], None
            for s in range(0, CHAIN_BLOCKS, per_event):
                events.append(stored(form, hashes[s:s + per_event], parent,
                                     tokens[s * BLOCK:(s + per_event) * BLOCK], BLOCK))
                parent = hashes[s + per_event - 1]
            payload = enc.encode(batch(form, events))
            f.write(struct.pack("<II", w, len(payload)) + payload)
            made += CHAIN_BLOCKS
            chain += 1


if __name__ == "__main__":
    main()
