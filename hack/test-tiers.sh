#!/usr/bin/env bash
# Runs make test's tiers in order, stops at the first that fails, and ends
# with the time each took, so a slow tier shows in every CI log.
# Usage: hack/test-tiers.sh <make target>...
set -uo pipefail
make=${MAKE:-make}
summary=()
status=0
mmss() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }
for tier in "$@"; do
  start=$SECONDS
  result=ok
  "$make" --no-print-directory "$tier" || { result=FAILED; status=1; }
  summary+=("$(printf '  %-18s %7s  %s' "$tier" "$(mmss $((SECONDS - start)))" "$result")")
  [ "$status" -eq 0 ] || break
done
echo "== make test: time per tier"
printf '%s\n' "${summary[@]}"
printf '  %-18s %7s\n' total "$(mmss "$SECONDS")"
exit "$status"
