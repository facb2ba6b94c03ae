#!/usr/bin/env python3
"""Regenerates block_hashes.json with the reference xxHash C library (PyPI `xxhash`),
an implementation independent of the Rust crate the filter uses.

    python3 tests/vectors/generate.py > tests/vectors/block_hashes.json
"""
import json
import struct

import xxhash

SEED = 1337


def local_hash(block):
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block)}I", *block), seed=SEED)


def namespace(lora, salt):
    """0 (the base model) or the id of blocks stored under a LoRA adapter / cache salt."""
    parts = b""
    for tag, value in ((1, lora), (2, salt)):
        if value:
            raw = value.encode()
            parts += bytes([tag]) + struct.pack("<I", len(raw)) + raw
    if not parts:
        return 0
    return xxhash.xxh3_64_intdigest(b"kvroute-ns/1" + parts, seed=SEED) or 1


def seq_hashes(tokens, block_size, ns=0):
    whole = len(tokens) // block_size * block_size
    locals_, seqs = [], []
    for start in range(0, whole, block_size):
        local = local_hash(tokens[start:start + block_size])
        parent = seqs[-1] if seqs else (ns or None)
        seq = local if parent is None else xxhash.xxh3_64_intdigest(
            struct.pack("<QQ", parent, local), seed=SEED)
        locals_.append(local)
        seqs.append(seq)
    return locals_, seqs


def case(name, block_size, tokens, lora=None, cache_salt=None):
    ns = namespace(lora, cache_salt)
    locals_, seqs = seq_hashes(tokens, block_size, ns)
    # Hashes as decimal strings: JSON numbers above 2^53 lose precision in many parsers.
    out = {"name": name, "block_size": block_size, "tokens": tokens}
    if ns:
        out.update({"lora": lora, "cache_salt": cache_salt, "namespace": str(ns)})
    out.update({"local_hashes": [str(h) for h in locals_], "seq_hashes": [str(h) for h in seqs]})
    return out


def main():
    cases = [
        case("dynamo_reference_1000_to_1015", 16, list(range(1000, 1016))),
        case("three_blocks_and_a_partial", 16, list(range(0, 53))),
        case("shared_prefix_a", 16, list(range(500, 532)) + [1] * 16),
        case("shared_prefix_b", 16, list(range(500, 532)) + [2] * 16),
        case("large_ids", 4, [4294967295, 0, 2147483648, 65536, 151643, 151644, 151645, 7]),
        case("block_size_1", 1, [5, 6, 7]),
        case("shorter_than_one_block", 16, list(range(10))),
        case("lora_adapter", 16, list(range(1000, 1032)), lora="sql-adapter"),
        case("cache_salt", 16, list(range(1000, 1032)), cache_salt="tenant-42"),
        case("lora_and_cache_salt", 16, list(range(1000, 1032)), lora="sql-adapter", cache_salt="tenant-42"),
    ]
    doc = {
        "description": "kvroute block hashes: local_i = xxh3_64(LE u32 tokens of block i, seed); "
                       "seq_0 = local_0; seq_i = xxh3_64(LE u64 seq_{i-1} ++ LE u64 local_i, seed). "
                       "Trailing partial block not hashed. Namespaced cases (a LoRA adapter and/or a cache salt): "
                       "ns = xxh3_64(\"kvroute-ns/1\" ++ [1, le_u32 len, lora] ++ [2, le_u32 len, salt], seed), "
                       "absent parts omitted; seq_0 = xxh3_64(LE u64 ns ++ LE u64 local_0, seed). "
                       "Hashes are decimal strings of u64.",
        "seed": SEED,
        "cases": cases,
    }
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
