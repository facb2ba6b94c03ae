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


def seq_hashes(tokens, block_size):
    whole = len(tokens) // block_size * block_size
    locals_, seqs = [], []
    for start in range(0, whole, block_size):
        local = local_hash(tokens[start:start + block_size])
        seq = local if not seqs else xxhash.xxh3_64_intdigest(
            struct.pack("<QQ", seqs[-1], local), seed=SEED)
        locals_.append(local)
        seqs.append(seq)
    return locals_, seqs


def case(name, block_size, tokens):
    locals_, seqs = seq_hashes(tokens, block_size)
    # Hashes as decimal strings: JSON numbers above 2^53 lose precision in many parsers.
    return {"name": name, "block_size": block_size, "tokens": tokens,
            "local_hashes": [str(h) for h in locals_], "seq_hashes": [str(h) for h in seqs]}


def main():
    cases = [
        case("dynamo_reference_1000_to_1015", 16, list(range(1000, 1016))),
        case("three_blocks_and_a_partial", 16, list(range(0, 53))),
        case("shared_prefix_a", 16, list(range(500, 532)) + [1] * 16),
        case("shared_prefix_b", 16, list(range(500, 532)) + [2] * 16),
        case("large_ids", 4, [4294967295, 0, 2147483648, 65536, 151643, 151644, 151645, 7]),
        case("block_size_1", 1, [5, 6, 7]),
        case("shorter_than_one_block", 16, list(range(10))),
    ]
    doc = {
        "description": "kvroute block hashes: local_i = xxh3_64(LE u32 tokens of block i, seed); "
                       "seq_0 = local_0; seq_i = xxh3_64(LE u64 seq_{i-1} ++ LE u64 local_i, seed). "
                       "Trailing partial block not hashed. Hashes are decimal strings of u64.",
        "seed": SEED,
        "cases": cases,
    }
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
