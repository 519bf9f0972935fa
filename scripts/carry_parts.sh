#!/usr/bin/env bash
# Carry a file larger than one device call allows (64 MiB) to the GPU machine in parts, one
# folder per call, and join it there with its checksum checked. The approach of
# ../shared/tools/vllm/recv.sh: files under /tmp on the GPU machine survive from one call to the
# next only while the machine stays warm (about 30 s after a call returns), so the calls go
# back to back.
#
#   here:   bash scripts/carry_parts.sh split FILE DIR [MIB]
#             DIR/c1, DIR/c2, ...: one part of at most MIB MiB (default 45) each; the last folder
#             also holds NAME.sha256. DIR goes under an ignored folder (.gpu/ is, in
#             .git/info/exclude), so each DIR/cN travels as a device call's carry.
#   GPU:    bash scripts/carry_parts.sh recv DIR/cN       (every call but the last)
#           bash scripts/carry_parts.sh join DIR/cN [DEST] (the last call: prints the file's path)
#             parts wait in /tmp/carry/<basename of DIR>/; the file is joined there (or at DEST),
#             once per machine: a later join finds it whole and checks it again.
#   CARRY_STORE replaces /tmp/carry (the tests use it).
set -euo pipefail
STORE_ROOT=${CARRY_STORE:-/tmp/carry}

die() { echo "carry_parts.sh: $*" >&2; exit 2; }

split_file() {
  local file=$1 dir=$2 mib=${3:-45}
  [ -f "$file" ] || die "no file $file"
  [[ "$mib" =~ ^[1-9][0-9]*$ ]] || die "part size must be a positive number of MiB, got $mib"
  [ -e "$dir" ] && die "$dir exists: remove it first (parts of another file must not mix)"
  local name tmp
  name=$(basename "$file")
  tmp=$(mktemp -d)
  split -b "${mib}M" -d -a 2 "$file" "$tmp/$name.part."
  local i=0 part
  for part in "$tmp"/*; do
    i=$((i + 1))
    mkdir -p "$dir/c$i"
    mv "$part" "$dir/c$i/"
  done
  (cd "$(dirname "$file")" && sha256sum "$name") >"$dir/c$i/$name.sha256"
  rmdir "$tmp"
  echo "$file -> $i part(s) under $dir (c1..c$i, at most $mib MiB each; checksum in c$i)"
}

receive() {
  local part=$1
  [ -d "$part" ] || die "no folder $part (was it carried?)"
  local store
  store=$STORE_ROOT/$(basename "$(dirname "$(realpath "$part")")")
  mkdir -p "$store" && cp "$part"/* "$store"/
  echo "$store: $(ls "$store" | tr '\n' ' ')"
}

join_parts() {
  local part=$1 dest=${2:-}
  receive "$part" >&2
  local store sums name
  store=$STORE_ROOT/$(basename "$(dirname "$(realpath "$part")")")
  sums=$(ls "$store"/*.sha256 2>/dev/null | head -1)
  [ -n "$sums" ] || die "no checksum in $store: join with the last part's folder"
  name=$(basename "$sums" .sha256)
  dest=${dest:-$store/$name}
  if ! (cd "$(dirname "$dest")" 2>/dev/null && sed "s#  .*#  $(basename "$dest")#" "$sums" \
        | sha256sum -c --status 2>/dev/null); then
    mkdir -p "$(dirname "$dest")"
    cat "$store/$name".part.* >"$dest.tmp"
    if ! (cd "$(dirname "$dest")" && sed "s#  .*#  $(basename "$dest").tmp#" "$sums" \
          | sha256sum -c --status); then
      rm -f "$dest.tmp"
      die "$name: checksum mismatch; parts here: $(ls "$store" | tr '\n' ' ') (a call missed? the machine went cold? start again at c1)"
    fi
    mv "$dest.tmp" "$dest"
  fi
  echo "$dest"
}

case ${1:-} in
  split) [ $# -ge 3 ] || die "usage: split FILE DIR [MIB]"; split_file "$2" "$3" "${4:-45}" ;;
  recv) [ $# -eq 2 ] || die "usage: recv DIR/cN"; receive "$2" ;;
  join) [ $# -ge 2 ] || die "usage: join DIR/cN [DEST]"; join_parts "$2" "${3:-}" ;;
  *) die "usage: split FILE DIR [MIB] | recv DIR/cN | join DIR/cN [DEST]" ;;
esac
