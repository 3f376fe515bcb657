#!/usr/bin/env bash
# The chart's static checks (make test): helm lint and helm template for
# each gate value, and the schema refusing wrong values with a message that
# names them.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
helm="$repo/bin/helm"
chart="$repo/deploy/helm/inpod"

"$helm" lint --strict "$chart" >/dev/null
for gates in deviceplugin dra node-condition none deviceplugin,node-condition dra,node-condition; do
  # Without a gate that advertises the resource, the request policy would
  # hold every enrolled pod Pending: those gate values go without it.
  args=(--set "gates={$gates}")
  case $gates in *deviceplugin*|*dra*) ;; *) args+=(--set enrollment.autoRequest.enabled=false) ;; esac
  out=$("$helm" template inpod "$chart" -n inpod-system "${args[@]}")
  want="--gate=$gates"
  grep -qF -- "$want" <<<"$out" || { echo "gates=$gates: rendered args lack $want" >&2; exit 1; }
  "$helm" lint --strict "$chart" "${args[@]}" >/dev/null
done
# An empty exclusion list renders selectors the API server accepts (no
# NotIn with no values).
if "$helm" template inpod "$chart" -n inpod-system --set-json 'enrollment.excludedNamespaces=[]' | grep -q 'values: \[\]'; then
  echo "excludedNamespaces=[] renders an empty NotIn" >&2; exit 1
fi
echo "chart: lint and template pass for every gate value"

refuse() { # want-in-message, helm args...
  local want=$1; shift
  local out
  if out=$("$helm" template inpod "$chart" -n inpod-system "$@" 2>&1); then
    echo "chart accepted $* (want refused: $want)" >&2; exit 1
  fi
  grep -qF -- "$want" <<<"$out" || { echo "chart refused $* without naming $want:" >&2; echo "$out" >&2; exit 1; }
}
refuse "gates" --set 'gates={devicepugin}'
refuse "gates" --set 'gates={none,deviceplugin}'
refuse "backend" --set redirection.backend=ebpf
refuse "resourceName" --set resourceName=redirection
refuse "resourceName" --set resourceName=kubernetes.io/redirection
refuse "zdsSocket" --set paths.zdsSocket=relative/ztunnel.sock
refuse "terminationGracePeriodSeconds" --set agent.terminationGracePeriodSeconds=30
refuse "excludedNamespaces" --set 'enrollment.excludedNamespaces={Kube_System}'
refuse "unknownValue" --set unknownValue=1
refuse "controller" --set controller.enabled=true
refuse "no gate in gates advertises it" --set 'gates={node-condition}'
refuse "no gate in gates advertises it" --set 'gates={none}'
refuse "maxUnavailable" --set agent.maxUnavailable=0
refuse "timeoutSeconds" --set uninstallHook.timeoutSeconds=600
refuse "metrics.service.enabled" --set metrics.service.enabled=false --set metrics.serviceMonitor.enabled=true
echo "chart: the schema refuses wrong values, naming them"
