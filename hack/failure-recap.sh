#!/usr/bin/env bash
# failure-recap.sh LOG: after a failed go test run, print each failed test's
# log once more, at the end of the output: its last 60 lines (a test's
# verdicts come last), each cut at 400 characters, and any panic (a test
# timeout prints no "--- FAIL" line, only a panic naming the running test).
# A failing e2e test's report is otherwise buried under the tests that ran
# after it, and a CI excerpt shows only the tail. "--- FAIL:" is written
# "failed:" here so that nothing counting failures counts one twice.
set -euo pipefail
log=${1:?usage: failure-recap.sh LOG}
[[ -r $log ]] || exit 0
echo "=== the failed tests' output again (full output above) ==="
awk '
  function flush(  s, i) {
    s = n > 60 ? n - 59 : 1
    if (s > 1) print "    [... " s - 1 " earlier lines]"
    for (i = s; i <= n; i++) print b[i]
    n = 0
  }
  /^ *--- FAIL: / { flush(); f = 1; line = $0; sub(/--- FAIL: /, "failed: ", line); print ""; print line; next }
  /^(panic: |\trunning tests:|\t\tTest)/ { flush(); f = 0; print; next }
  /^(--- |=== |FAIL|ok |PASS)/ { flush(); f = 0; next }
  f && /^    / { b[++n] = length($0) > 400 ? substr($0, 1, 400) " [...]" : $0 }
  END { flush() }
' "$log"
