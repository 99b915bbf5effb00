#!/usr/bin/env bash
# A file larger than one device call may carry (64 MiB with the tree), such as the real Gemma 3 270M (253 MB), in
# pieces that travel one call each while the machine stays warm. A call's carried paths do not outlive the next call,
# so each call copies its piece out of the tree into a folder of the machine's own.
#
#   here:        bash bench/gpu-pieces.sh split FILE DIR      pieces of 60 MB and FILE's sha256 into DIR (ignored)
#   each call:   bash bench/gpu-pieces.sh keep DIR STORE      carry one piece of DIR; it is copied into STORE
#   last call:   bash bench/gpu-pieces.sh join STORE OUT      the pieces in order into OUT, checked against the sha256
set -euo pipefail
case "${1:-}" in
  split)
    mkdir -p "$3"
    rm -f "$3"/piece-* "$3"/sha256
    split -b 60000000 -d -a 2 "$2" "$3/piece-"
    sha256sum "$2" | cut -c1-64 > "$3/sha256"
    ls -l "$3"
    ;;
  keep)
    mkdir -p "$3"
    cp "$2"/* "$3"/
    ls -l "$3"
    ;;
  join)
    cat "$2"/piece-* > "$3"
    got=$(sha256sum "$3" | cut -c1-64)
    if [ "$got" != "$(cat "$2/sha256")" ]; then
      echo "gpu-pieces: $3 has sha256 $got, not the split file's $(cat "$2/sha256")" >&2
      exit 1
    fi
    echo "joined $3 ($(stat -c %s "$3") bytes)"
    ;;
  *)
    echo "usage: gpu-pieces.sh split FILE DIR | keep DIR STORE | join STORE OUT" >&2
    exit 2
    ;;
esac
