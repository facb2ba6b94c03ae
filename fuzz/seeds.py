"""Writes the kv_events seed corpus (fuzz/corpus/kv_events/) from the engines' own encoders:
vLLM 0.33.0's and SGLang 0.5.23's KV-event classes from their wheels (scripts/test.sh
downloads them into target/wheels/) and every older release's form as harness/kvevents.py
declares it, all encoded by msgspec, as the engines encode them. Each file is a selector
byte (invariants/src/kv_events.rs) and one batch payload, named by its content's hash.

    python3 fuzz/seeds.py
"""
import sys
from pathlib import Path

import msgspec
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from harness import kvevents  # noqa: E402
import engine_wheels  # noqa: E402

OUT = ROOT / "fuzz" / "corpus" / "kv_events"
ENC = msgspec.msgpack.Encoder()


def put(selector, payload):
    OUT.mkdir(parents=True, exist_ok=True)
    data = bytes([selector]) + payload
    (OUT / f"{xxhash.xxh3_64_intdigest(data):016x}").write_bytes(data)


def main():
    tokens = list(range(1000, 1064))
    n = 0
    for i, (name, form) in enumerate(sorted(kvevents.FORMS.items())):
        events = kvevents.chain_events(name, tokens, block_size=16)
        first = events[0].block_hashes[0]
        events.append(form.removed([first], medium="GPU") if "medium" in form.removed_names else form.removed([first]))
        events.append(form.cleared())
        put(i % 4, ENC.encode(form.batch(events, dp_rank=i % 2, ts=1_700_000_000.5)))
        n += 1
    vllm = engine_wheels.vllm_kv_events()
    stored = vllm.BlockStored(block_hashes=[2**64 - 1, 7, b"\x01" * 32], parent_block_hash=-5,
                              token_ids=list(range(48)), block_size=16, lora_id=3, medium="CPU",
                              lora_name="sql", extra_keys=[("sql", "salt"), ("sql", ("mm-hash", 0)), None],
                              group_idx=2, kv_cache_spec_kind="sliding_window")
    plain = vllm.BlockStored(block_hashes=[9, 10], parent_block_hash=None, token_ids=list(range(32)),
                             block_size=16, lora_id=None, medium="GPU", lora_name=None)
    put(0, ENC.encode(vllm.KVEventBatch(1.25, [plain, stored, vllm.BlockRemoved(block_hashes=[9], medium="GPU"),
                                                vllm.AllBlocksCleared()], 1)))
    put(2, ENC.encode(vllm.KVEventBatch(2.0, [plain], None)))
    sglang = engine_wheels.sglang_kv_events()
    s_stored = sglang.BlockStored(block_hashes=[-(2**63), 12], parent_block_hash=99, token_ids=list(range(2)),
                                  block_size=1, lora_id=None, medium="CPU_PINNED", cache_salt="tenant")
    put(1, ENC.encode(sglang.KVEventBatch(2.5, [s_stored, sglang.BlockRemoved(block_hashes=[12]),
                                                 sglang.AllBlocksCleared()], 0)))
    print(f"{n + 3} kv_events seeds written under {OUT}")


if __name__ == "__main__":
    main()
