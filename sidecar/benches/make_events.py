#!/usr/bin/env python3
"""Event payloads for the ingest benchmark, encoded by msgspec exactly as the engines publish
them (harness/kvevents.py has each release's struct definitions; FORM is one of
its names, e.g. vllm-0.33, vllm-0.22, sglang-0.5.22).

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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import msgspec  # noqa: E402
from harness.kvevents import FORMS, batch, stored  # noqa: E402

WORKERS = 16
CHAIN_BLOCKS = 64
BLOCK = 16


def main():
    out = pathlib.Path(sys.argv[1])
    form = sys.argv[2] if len(sys.argv) > 2 else "vllm-0.33"
    total = int(sys.argv[3]) if len(sys.argv) > 3 else 1_000_000
    per_event = 1 if FORMS[form].per_page else 16
    names = FORMS[form].stored_names
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
                # What the engine sets for a plain GPU store, where the release has the field.
                more = {k: v for k, v in (("medium", "GPU"), ("extra_keys", [None] * per_event), ("group_idx", 0),
                                          ("kind", "full_attention")) if k in names or f"kv_cache_spec_{k}" in names}
                events.append(stored(form, hashes[s:s + per_event], parent,
                                     tokens[s * BLOCK:(s + per_event) * BLOCK], BLOCK, **more))
                parent = hashes[s + per_event - 1]
            payload = enc.encode(batch(form, events, dp_rank=0))
            f.write(struct.pack("<II", w, len(payload)) + payload)
            made += CHAIN_BLOCKS
            chain += 1


if __name__ == "__main__":
    main()
