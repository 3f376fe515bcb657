#!/usr/bin/env bash
# failure-recap.sh LOG: after a failed go test run, print each failed test's
# own log lines (file_test.go:N: ...) once more, shortened, at the end of
# the output. A failing e2e test's report is otherwise buried under the
# tests that ran after it, and a CI excerpt shows only the tail.
set -euo pipefail
log=${1:?usage: failure-recap.sh LOG}
[[ -r $log ]] || exit 0
awk '
  /^--- FAIL: / { infail = 1; n = 0; print ""; print; next }
  /^(--- |=== |FAIL|ok |PASS)/ { infail = 0 }
  infail && /^ +[A-Za-z0-9_]+\.go:[0-9]+: / {
    if (++n > 40) { if (n == 41) print "        [... more lines in the full log]"; next }
    line = $0; if (length(line) > 400) line = substr(line, 1, 400) " [...]"
    print line
  }
' "$log" | { echo "=== failed tests, their own lines again (full output above) ==="; cat; }
