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
  out=$("$helm" template inpod "$chart" -n inpod-system --set "gates={$gates}")
  want="--gate=$gates"
  grep -qF -- "$want" <<<"$out" || { echo "gates=$gates: rendered args lack $want" >&2; exit 1; }
  "$helm" lint --strict "$chart" --set "gates={$gates}" >/dev/null
done
echo "chart: lint and template pass for every gate value"

# Automatic resource requests by inpod-controller's webhook: a caBundle of
# one's own, or cert-manager's Certificate and cainjector; never both modes.
wh=(--set enrollment.autoRequest.mode=webhook --set controller.enabled=true)
out=$("$helm" template inpod "$chart" -n inpod-system "${wh[@]}" --set enrollment.autoRequest.webhook.caBundle=Q0E=)
for want in 'kind: MutatingWebhookConfiguration' 'caBundle: Q0E=' 'name: inpod-webhook' 'targetPort: webhook' 'failurePolicy: Ignore'; do
  grep -qF -- "$want" <<<"$out" || { echo "mode=webhook: rendered manifests lack $want" >&2; exit 1; }
done
if grep -q 'kind: MutatingAdmissionPolicy' <<<"$out"; then echo "mode=webhook also renders the policy" >&2; exit 1; fi
out=$("$helm" template inpod "$chart" -n inpod-system "${wh[@]}" --set enrollment.autoRequest.webhook.certManager.enabled=true)
for want in 'kind: Certificate' 'kind: Issuer' 'cert-manager.io/inject-ca-from: inpod-system/inpod-webhook' 'secretName: inpod-webhook-tls'; do
  grep -qF -- "$want" <<<"$out" || { echo "mode=webhook with cert-manager: rendered manifests lack $want" >&2; exit 1; }
done
if grep -q 'caBundle' <<<"$out"; then echo "mode=webhook with cert-manager also sets a caBundle" >&2; exit 1; fi
"$helm" lint --strict "$chart" "${wh[@]}" --set enrollment.autoRequest.webhook.certManager.enabled=true >/dev/null
out=$("$helm" template inpod "$chart" -n inpod-system)
if grep -q 'MutatingWebhookConfiguration\|inpod-webhook' <<<"$out"; then echo "mode=policy renders webhook objects" >&2; exit 1; fi
echo "chart: mode=webhook renders the webhook with a caBundle or with cert-manager"

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
refuse "set controller.enabled" --set enrollment.autoRequest.mode=webhook
refuse "certManager.enabled" --set enrollment.autoRequest.mode=webhook --set controller.enabled=true
refuse "caBundle" --set enrollment.autoRequest.mode=webhook --set controller.enabled=true --set 'enrollment.autoRequest.webhook.caBundle=-----BEGIN'
refuse "timeoutSeconds" --set enrollment.autoRequest.mode=webhook --set controller.enabled=true --set enrollment.autoRequest.webhook.certManager.enabled=true --set enrollment.autoRequest.webhook.timeoutSeconds=31
refuse "metrics.service.enabled" --set metrics.service.enabled=false --set metrics.serviceMonitor.enabled=true
echo "chart: the schema refuses wrong values, naming them"
