#!/usr/bin/env bash
# The chart's static checks (make test): helm lint and helm template for
# each gate value, NOTES.txt for each gate value, the schema refusing wrong
# values with a message that names them, and the chart's README current.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
helm="$repo/bin/helm"
chart="$repo/deploy/helm/inpod"

# NOTES.txt as helm install prints it. helm template never renders it and
# helm install --dry-run needs a cluster, so a copy of the chart renders it
# through tpl (same engine, values and helpers) into a ConfigMap.
notes_chart=$(mktemp -d)
trap 'rm -rf "$notes_chart"' EXIT
cp -R "$chart/." "$notes_chart/"
cp "$chart/templates/NOTES.txt" "$notes_chart/notes.txt"
printf '%s\n' 'apiVersion: v1' 'kind: ConfigMap' 'metadata: {name: notes}' 'data:' \
  '  notes: {{ tpl (.Files.Get "notes.txt") . | b64enc }}' >"$notes_chart/templates/zz-notes.yaml"
notes() { # helm args...
  local out
  out=$("$helm" template inpod "$notes_chart" -n inpod-system --show-only templates/zz-notes.yaml "$@") ||
    { echo "NOTES.txt does not render with $*" >&2; exit 1; }
  sed -n 's/^  notes: //p' <<<"$out" | base64 -d
}

"$helm" lint --strict "$chart" >/dev/null
for gates in deviceplugin dra node-condition none deviceplugin,node-condition dra,node-condition initcontainer deviceplugin,initcontainer; do
  # Without a gate that advertises the resource, the request policy would
  # hold every enrolled pod Pending: it is rendered only with one.
  args=(--set "gates={$gates}")
  out=$("$helm" template inpod "$chart" -n inpod-system "${args[@]}")
  # initcontainer is the admission policy's, not the agent's.
  agent=$(tr , '\n' <<<"$gates" | { grep -vx initcontainer || true; } | paste -sd,)
  want="--gate=${agent:-none}"
  grep -qF -- "$want" <<<"$out" || { echo "gates=$gates: rendered args lack $want" >&2; exit 1; }
  case $gates in
    *initcontainer*) grep -q 'name: inpod-wait-ready$' <<<"$out" || { echo "gates=$gates: no init-container policy" >&2; exit 1; }
      grep -q 'name: inpod-wait-ready-genuine$' <<<"$out" || { echo "gates=$gates: no policy refusing a pod's own inpod-wait-ready" >&2; exit 1; } ;;
    *) if grep -q 'inpod-wait-ready' <<<"$out"; then echo "gates=$gates: init-container policy without gate initcontainer" >&2; exit 1; fi ;;
  esac
  case $gates in
    *deviceplugin*|*dra*) grep -q 'name: inpod-redirection-request$' <<<"$out" || { echo "gates=$gates: no request policy" >&2; exit 1; } ;;
    *) if grep -q 'name: inpod-redirection-request$' <<<"$out"; then echo "gates=$gates: request policy without a gate that advertises the resource" >&2; exit 1; fi ;;
  esac
  # The readiness gate, whatever the gates.
  grep -q 'name: inpod-readiness-gate$' <<<"$out" || { echo "gates=$gates: no readiness-gate policy" >&2; exit 1; }
  "$helm" lint --strict "$chart" "${args[@]}" >/dev/null
  # NOTES.txt: the agents, enrolling, where each listed gate (and no other)
  # shows readiness, the readiness gate, uninstalling.
  out=$(notes "${args[@]}")
  for want in 'kubectl -n inpod-system get daemonset inpod-agent' 'kubectl label namespace <namespace> istio.io/dataplane-mode=ambient' \
    '@.type=="inpod.dev/redirected"' 'helm uninstall inpod -n inpod-system' 'kubectl -n inpod-system logs job/inpod-uninstall-hook'; do
    grep -qF -- "$want" <<<"$out" || { echo "gates=$gates: NOTES.txt lacks $want" >&2; exit 1; }
  done
  for gate in deviceplugin dra node-condition initcontainer none; do
    case $gate in
      deviceplugin) line='.status.allocatable.inpod\.dev/redirection' ;;
      dra) line='--field-selector spec.driver=redirection.inpod.dev' ;;
      node-condition) line='@.type=="InPodRedirectionReady"' ;;
      initcontainer) line='logs <pod> -c inpod-wait-ready' ;;
      none) line='none: no gate' ;;
    esac
    if [[ ",$gates," == *",$gate,"* ]]; then
      grep -qF -- "$line" <<<"$out" || { echo "gates=$gates: NOTES.txt lacks $line" >&2; exit 1; }
    elif grep -qF -- "$line" <<<"$out"; then
      echo "gates=$gates: NOTES.txt shows $gate's readiness ($line)" >&2; exit 1
    fi
  done
done
# An empty exclusion list renders selectors the API server accepts (no
# NotIn with no values).
if "$helm" template inpod "$chart" -n inpod-system --set-json 'enrollment.excludedNamespaces=[]' | grep -q 'values: \[\]'; then
  echo "excludedNamespaces=[] renders an empty NotIn" >&2; exit 1
fi
# helm upgrade --reuse-values keeps an older release's values: a value this
# chart added must not render a flag the agent refuses (an empty bool) when
# it is missing.
if "$helm" template inpod "$chart" -n inpod-system -f <(printf 'agent:\n  releaseStartupMemory: null\n') | grep -q -- '--release-startup-memory'; then
  echo "values without agent.releaseStartupMemory (an older release's) render --release-startup-memory" >&2; exit 1
fi
# The readiness gate: off renders no policy; an older release's values
# (helm upgrade --reuse-values), which lack the value, render none either
# (what that release had).
for vals in 'enrollment:\n  readinessGate: {enabled: false}\n' 'enrollment:\n  readinessGate: null\n'; do
  if "$helm" template inpod "$chart" -n inpod-system -f <(printf "$vals") | grep -q 'inpod-readiness-gate'; then
    echo "values $(printf "$vals" | tr '\n' ' ') render the readiness-gate policy" >&2; exit 1
  fi
done
out=$("$helm" template inpod "$chart" -n inpod-system --show-only templates/admission-readiness-gate.yaml)
for want in 'failurePolicy: Ignore' 'patchType: JSONPatch' 'path: "/spec/readinessGates/-"' 'path: "/spec/readinessGates"' \
  "g.conditionType == 'inpod.dev/redirected'" 'name: not-host-network' 'name: not-mirror' 'name: not-inpod' \
  'name: inpod-readiness-gate-pod-label' 'name: inpod-readiness-gate-namespace-label'; do
  grep -qF -- "$want" <<<"$out" || { echo "readiness-gate policy lacks $want" >&2; exit 1; }
done
if grep -q 'patchType: ApplyConfiguration' <<<"$out"; then echo "readiness-gate policy replaces the pod's readiness gates (an atomic list)" >&2; exit 1; fi
# The agent may patch pods/status, confined to its node's pods and to the
# one condition.
out=$("$helm" template inpod "$chart" -n inpod-system)
grep -qF 'resources: [pods/status]' <<<"$out" || { echo "the agent's ClusterRole lacks pods/status" >&2; exit 1; }
grep -qF 'resources: [pods, pods/status, nodes, nodes/status]' <<<"$out" || { echo "node confinement does not match pods/status" >&2; exit 1; }
echo "chart: lint and template pass for every gate value; the readiness gate with every gate, off when told"
# NOTES.txt follows the values it talks about.
out=$(notes --set enrollment.readinessGate.enabled=false --set uninstallHook.enabled=false --set resourceName=example.com/mesh)
for want in '.status.allocatable.example\.com/mesh' 'example.com/mesh: 1 at creation' 'uninstallHook.enabled=false'; do
  grep -qF -- "$want" <<<"$out" || { echo "NOTES.txt lacks $want" >&2; echo "$out" >&2; exit 1; }
done
if grep -q 'inpod.dev/redirected\|job/inpod-uninstall-hook' <<<"$out"; then
  echo "NOTES.txt names the readiness gate or the uninstall hook with both off" >&2; exit 1
fi
out=$(notes --set 'gates={node-condition}' --set controller.enabled=true --set controller.nodeTaintPolicy.enabled=true --set controller.taint.key=example.com/mesh-not-ready)
for want in 'kubectl -n inpod-system get deployment inpod-controller' 'kubectl taint nodes <node> example.com/mesh-not-ready:NoSchedule' \
  '--set controller.enabled=false --set controller.nodeTaintPolicy.enabled=false' 'kubectl taint nodes --all example.com/mesh-not-ready:NoSchedule-'; do
  grep -qF -- "$want" <<<"$out" || { echo "NOTES.txt in taint mode lacks $want" >&2; echo "$out" >&2; exit 1; }
done
echo "chart: NOTES.txt renders for every gate value, naming where each gate shows readiness"

# The init container (gate initcontainer): first, locked down, only into
# enrolled pods (the request policy's bindings), refusing rather than
# skipping an enrolled pod it cannot handle.
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={initcontainer}' --set initContainer.timeout=90s \
  --set-json 'enrollment.excludedNamespaces=["kube-system","ops"]' --show-only templates/admission-init-container.yaml)
for want in 'failurePolicy: Fail' 'path: "/spec/initContainers/0"' 'path: "/spec/initContainers"' 'runAsNonRoot: true' 'runAsUser: 65532' \
  'readOnlyRootFilesystem: true' 'allowPrivilegeEscalation: false' 'privileged: false' 'drop: ["ALL"]' 'type: "RuntimeDefault"' \
  'args: ["--timeout=90s"]' "c.name == 'inpod-wait-ready'" 'name: not-host-network' 'name: not-inpod' \
  'name: inpod-wait-ready-pod-label' 'name: inpod-wait-ready-namespace-label' 'values: ["kube-system","ops"]' \
  'terminationMessagePolicy: "FallbackToLogsOnError"' 'image: "ghcr.io/inpod-dev/inpod-waitready:'; do
  grep -qF -- "$want" <<<"$out" || { echo "init-container policy lacks $want" >&2; exit 1; }
done
if grep -q 'restartPolicy:' <<<"$out"; then echo "the init container is a sidecar: it must complete before the app starts" >&2; exit 1; fi
echo "chart: the init-container policy renders first, locked down, for enrolled pods only"

# inpod-controller (taint mode): both modes, with the node-taint policy; the
# controller's --taint and the policy's taint are one value.
for mode in bootstrap continuous; do
  args=(--set 'gates={node-condition}' --set controller.enabled=true --set controller.mode=$mode
    --set controller.nodeTaintPolicy.enabled=true --set controller.taint.key=example.com/mesh-not-ready
    --set-string 'controller.nodeSelector.example\.com/mesh=true')
  "$helm" lint --strict "$chart" "${args[@]}" >/dev/null
  out=$("$helm" template inpod "$chart" -n inpod-system "${args[@]}")
  for want in "--mode=$mode" "--taint=example.com/mesh-not-ready:NoSchedule" "--node-selector=example.com/mesh=true,kubernetes.io/os=linux" \
    'key: "example.com/mesh-not-ready", effect: "NoSchedule"' 'example.com/mesh: "true"' "kind: MutatingAdmissionPolicyBinding"; do
    grep -qF -- "$want" <<<"$out" || { echo "controller mode=$mode: rendered chart lacks $want" >&2; exit 1; }
  done
done
# The controller's client limits: qps always passed, burst only when set
# (0 lets the binary follow qps).
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' --set controller.enabled=true)
grep -qF -- "--kube-api-qps=100" <<<"$out" || { echo "controller: default --kube-api-qps=100 not rendered" >&2; exit 1; }
if grep -qF -- "--kube-api-burst" <<<"$out"; then echo "controller: --kube-api-burst rendered while controller.kubeAPI.burst is 0" >&2; exit 1; fi
# A release from before these values, upgraded with --reuse-values, has no
# controller.kubeAPI: it renders, with the binary's defaults.
"$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' --set controller.enabled=true --set controller.kubeAPI=null >/dev/null ||
  { echo "controller: values without controller.kubeAPI (an older release's, --reuse-values) do not render" >&2; exit 1; }
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' --set controller.enabled=true --set-json 'controller.kubeAPI={"qps":500}') ||
  { echo "controller: controller.kubeAPI.qps alone (an older release's values, --reuse-values --set) does not render" >&2; exit 1; }
grep -qF -- "--kube-api-qps=500" <<<"$out" || { echo "controller: controller.kubeAPI.qps alone not rendered" >&2; exit 1; }
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' --set controller.enabled=true --set controller.kubeAPI.qps=250 --set controller.kubeAPI.burst=500)
for want in "--kube-api-qps=250" "--kube-api-burst=500"; do
  grep -qF -- "$want" <<<"$out" || { echo "controller: rendered chart lacks $want" >&2; exit 1; }
done
# The mesh nodes are the agent's nodes at most: by default the policy and
# the controller select kubernetes.io/os=linux, not every node (a node
# without an agent would keep the taint forever).
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' --set controller.enabled=true --set controller.nodeTaintPolicy.enabled=true)
grep -qF -- "--node-selector=kubernetes.io/os=linux" <<<"$out" || { echo "controller: default --node-selector is not agent.nodeSelector" >&2; exit 1; }
binding=$(sed -n '/^kind: MutatingAdmissionPolicyBinding/,/^---/p' <<<"$out")
grep -qF 'kubernetes.io/os: linux' <<<"$binding" || { echo "node-taint policy binding does not select agent.nodeSelector:" >&2; echo "$binding" >&2; exit 1; }
if grep -q 'objectSelector: {}' <<<"$binding"; then echo "node-taint policy binding selects every node" >&2; exit 1; fi
# The uninstall hook deletes the node-taint binding first (Helm would delete
# it after the controller), allowed to delete that one binding only; never
# without the policy.
hook=$(sed -n '/name: inpod-uninstall-hook/,$p' <<<"$out")
for want in '--binding=inpod-node-startup-taint' 'kind: ClusterRole' 'resources: [mutatingadmissionpolicybindings]' 'resourceNames: ["inpod-node-startup-taint",'; do
  grep -qF -- "$want" <<<"$hook" || { echo "uninstall hook with the node-taint policy lacks $want" >&2; exit 1; }
done
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' --set controller.enabled=true)
if grep -q -- '--binding=inpod-node-startup-taint\|"inpod-node-startup-taint"' <<<"$(sed -n '/name: inpod-uninstall-hook/,$p' <<<"$out")"; then
  echo "uninstall hook deletes a node-taint binding the chart does not render" >&2; exit 1
fi
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' --set enrollment.readinessGate.enabled=false)
hook=$(sed -n '/name: inpod-uninstall-hook/,$p' <<<"$out")
if grep -q -- '--binding\|mutatingadmissionpolicybindings' <<<"$hook"; then
  echo "uninstall hook deletes bindings the chart does not render" >&2; exit 1
fi
# Always: it lists the nodes (those still labelled inpod.dev/cni-installed
# are named), and may do nothing else with them.
grep -qF 'resources: [nodes]' <<<"$hook" && grep -qF 'verbs: [list]' <<<"$hook" || { echo "uninstall hook cannot list the nodes" >&2; exit 1; }
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}')
if grep -q 'inpod-controller\|inpod-node-startup-taint' <<<"$out"; then
  echo "controller.enabled=false still renders inpod-controller objects" >&2; exit 1
fi
# Gate initcontainer and the readiness gate: the hook deletes every binding
# of their policies first (a pod created while the agents leave would wait
# for good, or never be Ready), by the names the chart renders, allowed
# those names only.
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={deviceplugin,initcontainer}')
names=$(awk '/^kind: MutatingAdmissionPolicyBinding/{b=1} b&&/^  name: /{print $2; b=0}' <<<"$out" | grep '^inpod-wait-ready\|^inpod-readiness-gate' || true)
[[ $(wc -l <<<"$names") == 4 ]] || { echo "gate initcontainer: want two inpod-wait-ready and two inpod-readiness-gate bindings, got: $names" >&2; exit 1; }
hook=$(sed -n '/name: inpod-uninstall-hook/,$p' <<<"$out")
rn=$(grep -A1 'resources: \[mutatingadmissionpolicybindings\]' <<<"$hook" | grep resourceNames || true)
for n in $names; do
  grep -qF -- "--binding=$n" <<<"$hook" || { echo "uninstall hook does not delete the init-container binding $n first" >&2; exit 1; }
  grep -qF "\"$n\"" <<<"$rn" || { echo "uninstall hook may not delete the init-container binding $n: $rn" >&2; exit 1; }
done
[[ $(grep -o '"[^"]*"' <<<"$rn" | wc -l) == 4 ]] || { echo "uninstall hook may delete more bindings than the init-container and readiness-gate ones: $rn" >&2; exit 1; }
echo "chart: inpod-controller renders in both modes with the node-taint policy; the uninstall hook deletes the node-taint, init-container and readiness-gate bindings first"
# Automatic resource requests by inpod-controller's webhook: a caBundle of
# one's own, or cert-manager's Certificate and cainjector; never both modes.
wh=(--set enrollment.autoRequest.mode=webhook --set controller.enabled=true)
out=$("$helm" template inpod "$chart" -n inpod-system "${wh[@]}" --set enrollment.autoRequest.webhook.caBundle=Q0E=)
for want in 'kind: MutatingWebhookConfiguration' 'caBundle: Q0E=' 'name: inpod-webhook' 'targetPort: webhook' 'failurePolicy: Ignore' \
  '--webhook-addr=:9443' '--exclude-namespaces=kube-system' 'containerPort: 9443' 'secretName: inpod-webhook-tls' 'optional: true' \
  '--resource-request=true' '--readiness-gate=true'; do
  grep -qF -- "$want" <<<"$out" || { echo "mode=webhook: rendered manifests lack $want" >&2; exit 1; }
done
if grep -q 'kind: MutatingAdmissionPolicy' <<<"$out"; then echo "mode=webhook also renders the policy" >&2; exit 1; fi
out=$("$helm" template inpod "$chart" -n inpod-system "${wh[@]}" --set enrollment.autoRequest.webhook.certManager.enabled=true)
for want in 'kind: Certificate' 'kind: Issuer' 'cert-manager.io/inject-ca-from: inpod-system/inpod-webhook' 'secretName: inpod-webhook-tls' \
  'isCA: true' 'name: inpod-webhook-ca'; do
  grep -qF -- "$want" <<<"$out" || { echo "mode=webhook with cert-manager: rendered manifests lack $want" >&2; exit 1; }
done
if grep -q 'caBundle' <<<"$out"; then echo "mode=webhook with cert-manager also sets a caBundle" >&2; exit 1; fi
"$helm" lint --strict "$chart" "${wh[@]}" --set enrollment.autoRequest.webhook.certManager.enabled=true >/dev/null
out=$("$helm" template inpod "$chart" -n inpod-system)
if grep -q 'MutatingWebhookConfiguration\|inpod-webhook' <<<"$out"; then echo "mode=policy renders webhook objects" >&2; exit 1; fi
# Taint mode: no node advertises the resource, so the webhook serves the
# readiness gate alone, or is not there at all.
out=$("$helm" template inpod "$chart" -n inpod-system "${wh[@]}" --set enrollment.autoRequest.webhook.caBundle=Q0E= --set 'gates={node-condition}')
for want in 'kind: MutatingWebhookConfiguration' '--resource-request=false' '--readiness-gate=true'; do
  grep -qF -- "$want" <<<"$out" || { echo "mode=webhook in taint mode with the readiness gate: rendered manifests lack $want" >&2; exit 1; }
done
out=$("$helm" template inpod "$chart" -n inpod-system "${wh[@]}" --set enrollment.autoRequest.webhook.caBundle=Q0E= --set 'gates={node-condition}' \
  --set enrollment.readinessGate.enabled=false)
if grep -q 'MutatingWebhookConfiguration\|webhook-addr' <<<"$out"; then echo "mode=webhook in taint mode without the readiness gate renders the webhook (no node advertises the resource)" >&2; exit 1; fi
out=$("$helm" template inpod "$chart" -n inpod-system "${wh[@]}" --set enrollment.autoRequest.webhook.caBundle=Q0E= --set enrollment.readinessGate.enabled=false)
grep -qF -- '--readiness-gate=false' <<<"$out" || { echo "mode=webhook with the readiness gate off: no --readiness-gate=false" >&2; exit 1; }
if grep -q 'inpod-readiness-gate' <<<"$out"; then echo "mode=webhook with the readiness gate off renders its policy" >&2; exit 1; fi
echo "chart: mode=webhook renders the webhook with a caBundle or with cert-manager"

# Images by digest (make release's values-release.yaml): every image the
# chart renders is then repository@digest; without a digest (an older
# release's values, helm upgrade --reuse-values, lack the value) by tag.
digest=sha256:$(printf '%064d' 0 | tr 0 a)
out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={initcontainer}' --set controller.enabled=true \
  --set agent.image.digest=$digest --set controller.image.digest=$digest --set initContainer.image.digest=$digest)
for want in "image: \"ghcr.io/inpod-dev/inpod-agent@$digest\"" "image: \"ghcr.io/inpod-dev/inpod-controller@$digest\"" \
  "image: \"ghcr.io/inpod-dev/inpod-waitready@$digest\"" "initContainers[0].image == 'ghcr.io/inpod-dev/inpod-waitready@$digest'"; do
  grep -qF -- "$want" <<<"$out" || { echo "images by digest: rendered chart lacks $want" >&2; exit 1; }
done
if grep -q 'ghcr.io/inpod-dev/[a-z-]*:' <<<"$out"; then echo "images by digest: an image is still referenced by tag" >&2; exit 1; fi
out=$("$helm" template inpod "$chart" -n inpod-system -f <(printf 'agent:\n  image:\n    digest: null\n') --set agent.image.tag=v9)
grep -qF 'image: "ghcr.io/inpod-dev/inpod-agent:v9"' <<<"$out" || { echo "values without agent.image.digest do not render the image by tag" >&2; exit 1; }
# A tag over a digest (helm upgrade --reuse-values --set agent.image.tag=
# on an install pinned by values-release.yaml) is refused, not ignored.
for img in agent.image controller.image initContainer.image; do
  if out=$("$helm" template inpod "$chart" -n inpod-system --set 'gates={initcontainer}' --set controller.enabled=true \
    --set $img.digest=$digest --set $img.tag=v9 2>&1); then
    echo "$img: a tag and a digest together render (the tag would be ignored)" >&2; exit 1
  fi
  grep -qF -- "$img.digest=\"\"" <<<"$out" || { echo "$img: a tag with a digest is refused without saying how to run the tag:" >&2; echo "$out" >&2; exit 1; }
done
echo "chart: images by digest when one is set, else by tag; never a tag that would be ignored"

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
refuse "gates" --set 'gates={none,initcontainer}'
refuse "runAsUser" --set 'gates={initcontainer}' --set initContainer.runAsUser=0
refuse "timeout" --set 'gates={initcontainer}' --set initContainer.timeout=2
refuse "pullPolicy" --set initContainer.image.pullPolicy=Sometimes
refuse "agent/image/digest" --set agent.image.digest=sha256:abc
refuse "controller/image/digest" --set controller.image.digest=abc
refuse "backend" --set redirection.backend=ebpf
refuse "resourceName" --set resourceName=redirection
refuse "resourceName" --set resourceName=kubernetes.io/redirection
refuse "zdsSocket" --set paths.zdsSocket=relative/ztunnel.sock
refuse "terminationGracePeriodSeconds" --set agent.terminationGracePeriodSeconds=30
refuse "excludedNamespaces" --set 'enrollment.excludedNamespaces={Kube_System}'
refuse "unknownValue" --set unknownValue=1
refuse "maxUnavailable" --set agent.maxUnavailable=0
refuse "timeoutSeconds" --set uninstallHook.timeoutSeconds=600
refuse "controller/mode" --set controller.enabled=true --set controller.mode=sometimes
refuse "controller/taint/effect" --set controller.enabled=true --set controller.taint.effect=NoExecute
refuse "controller/taint/key" --set controller.enabled=true --set 'controller.taint.key=not a key'
refuse "controller/grace" --set controller.enabled=true --set controller.grace=30
refuse "controller/replicas" --set controller.enabled=true --set controller.replicas=0
refuse "controller/kubeAPI/qps" --set controller.enabled=true --set controller.kubeAPI.qps=0
refuse "controller/kubeAPI/burst" --set controller.enabled=true --set controller.kubeAPI.burst=-1
refuse "controller/kubeAPI/qps" --set controller.enabled=true --set controller.kubeAPI.qps=9223372036854775807
refuse "controller.kubeAPI.burst 150 is below controller.kubeAPI.qps 300" --set controller.enabled=true --set controller.kubeAPI.qps=300 --set controller.kubeAPI.burst=150
refuse "controller.nodeTaintPolicy.enabled needs node-condition" --set controller.enabled=true --set controller.nodeTaintPolicy.enabled=true
refuse "set controller.enabled" --set enrollment.autoRequest.mode=webhook
refuse "set controller.enabled" --set enrollment.autoRequest.mode=webhook --set enrollment.autoRequest.enabled=false
refuse "readinessGate" --set enrollment.readinessGate.enabled=yes
refuse "certManager.enabled" --set enrollment.autoRequest.mode=webhook --set controller.enabled=true
refuse "caBundle" --set enrollment.autoRequest.mode=webhook --set controller.enabled=true --set 'enrollment.autoRequest.webhook.caBundle=-----BEGIN'
refuse "timeoutSeconds" --set enrollment.autoRequest.mode=webhook --set controller.enabled=true --set enrollment.autoRequest.webhook.certManager.enabled=true --set enrollment.autoRequest.webhook.timeoutSeconds=31
refuse "metrics.service.enabled" --set metrics.service.enabled=false --set metrics.serviceMonitor.enabled=true
refuse "agent/appArmorProfile/type" --set agent.appArmorProfile.type=unconfined
refuse "localhostProfile" --set agent.appArmorProfile.type=Localhost
refuse "seLinuxOptions" --set controller.seLinuxOptions.kind=spc_t
refuse "maxUnavailable" --set controller.podDisruptionBudget.maxUnavailable=0
refuse "autoscaler" --set autoscaler=gke
echo "chart: the schema refuses wrong values, naming them"

# What the cluster must serve (templates/checks.yaml). Offline (helm
# template) by --kube-version; live (helm install) by the kinds the cluster
# lists, which --api-versions v1/Pod stands for here.
wh135=(--kube-version 1.35 --set enrollment.autoRequest.mode=webhook --set controller.enabled=true --set enrollment.autoRequest.webhook.caBundle=Q0E=)
refuse "Kubernetes v1.35 does not serve admissionregistration.k8s.io/v1 MutatingAdmissionPolicy" --kube-version 1.35
refuse "set enrollment.autoRequest.mode=webhook with controller.enabled=true" --kube-version 1.35
"$helm" template inpod "$chart" -n inpod-system "${wh135[@]}" >/dev/null || { echo "1.35 with mode=webhook does not render" >&2; exit 1; }
"$helm" lint --strict "$chart" "${wh135[@]}" >/dev/null
refuse "gate initcontainer" "${wh135[@]}" --set 'gates={initcontainer}'
refuse "set controller.nodeTaintPolicy.enabled=false" "${wh135[@]}" --set 'gates={node-condition}' --set controller.nodeTaintPolicy.enabled=true
refuse "incompatible with Kubernetes v1.29" "${wh135[@]/1.35/1.29}"
refuse "does not serve resource.k8s.io/v1 DeviceClass" "${wh135[@]/1.35/1.33}" --set 'gates={dra}'
out=$(notes "${wh135[@]}" --set 'gates={dra}')
grep -qF 'WARNING: Kubernetes v1.35 serves the DeviceClass' <<<"$out" || { echo "gate dra on 1.35: NOTES.txt does not warn of the feature gates" >&2; exit 1; }
if notes --set 'gates={dra}' | grep -qF 'WARNING'; then echo "gate dra on 1.37: NOTES.txt warns" >&2; exit 1; fi
live=(--api-versions v1/Pod)
map=(--api-versions admissionregistration.k8s.io/v1/MutatingAdmissionPolicy)
refuse "Kubernetes v1.37.0 does not serve admissionregistration.k8s.io/v1 MutatingAdmissionPolicy" "${live[@]}"
"$helm" template inpod "$chart" -n inpod-system "${live[@]}" "${map[@]}" >/dev/null || { echo "a live cluster serving MutatingAdmissionPolicy: the defaults do not render" >&2; exit 1; }
refuse "does not serve resource.k8s.io/v1 DeviceClass" "${live[@]}" "${map[@]}" --set 'gates={dra}'
"$helm" template inpod "$chart" -n inpod-system "${live[@]}" "${map[@]}" --api-versions resource.k8s.io/v1/DeviceClass --set 'gates={dra}' >/dev/null ||
  { echo "a live cluster serving DeviceClass: gate dra does not render" >&2; exit 1; }
refuse "needs cert-manager" "${live[@]}" "${map[@]}" "${wh[@]}" --set enrollment.autoRequest.webhook.certManager.enabled=true
"$helm" template inpod "$chart" -n inpod-system "${live[@]}" "${map[@]}" "${wh[@]}" --set enrollment.autoRequest.webhook.certManager.enabled=true \
  --api-versions cert-manager.io/v1/Certificate >/dev/null || { echo "a live cluster with cert-manager: mode=webhook with cert-manager does not render" >&2; exit 1; }
refuse "needs the Prometheus operator" "${live[@]}" "${map[@]}" --set metrics.serviceMonitor.enabled=true
echo "chart: refuses, naming the value to set instead, what the cluster (its version, or its APIs when live) does not serve"

# Autoscalers: the startup taint each one waits out, unless the key is set;
# Karpenter refused with a gate it cannot scale for.
for pair in none=inpod.dev/not-ready karpenter=readiness.k8s.io/inpod-redirection \
  cluster-autoscaler=startup-taint.cluster-autoscaler.kubernetes.io/inpod-redirection; do
  args=(--set autoscaler=${pair%%=*} --set 'gates={node-condition}' --set controller.enabled=true --set controller.nodeTaintPolicy.enabled=true)
  out=$("$helm" template inpod "$chart" -n inpod-system "${args[@]}")
  for want in "--taint=${pair#*=}:NoSchedule" "key: \"${pair#*=}\", effect: \"NoSchedule\"" "- key: ${pair#*=}"; do
    grep -qF -- "$want" <<<"$out" || { echo "autoscaler=${pair%%=*}: rendered chart lacks $want" >&2; exit 1; }
  done
  "$helm" lint --strict "$chart" "${args[@]}" >/dev/null
done
out=$("$helm" template inpod "$chart" -n inpod-system --set autoscaler=karpenter --set 'gates={node-condition}' --set controller.enabled=true --set controller.taint.key=example.com/mine)
grep -qF -- "--taint=example.com/mine:NoSchedule" <<<"$out" || { echo "autoscaler=karpenter overrides a controller.taint.key that is set" >&2; exit 1; }
if "$helm" template inpod "$chart" -n inpod-system -f <(printf 'controller:\n  enabled: true\n  taint: {key: inpod.dev/not-ready, effect: NoSchedule}\nautoscaler: null\n') --set 'gates={node-condition}' |
  grep -qF -- '--taint=inpod.dev/not-ready:NoSchedule'; then :; else echo "an older release's values (no autoscaler) change the taint" >&2; exit 1; fi
# A key changed on upgrade: the controller also removes the earlier taints
# (controller.taint.previousKeys, and on a live upgrade the deployed
# controller's --taint and --previous-taints, read by lookup), and its pods
# tolerate them. helm template's lookup finds nothing, so a copy of the chart
# reads "the deployed" Deployment from a file instead.
tc=(--set 'gates={node-condition}' --set controller.enabled=true)
out=$("$helm" template inpod "$chart" -n inpod-system "${tc[@]}" --set autoscaler=karpenter --set-json 'controller.taint.previousKeys=["example.com/old","inpod.dev/not-ready"]' --show-only templates/controller-deployment.yaml)
for want in '--previous-taints=example.com/old,inpod.dev/not-ready,startup-taint.cluster-autoscaler.kubernetes.io/inpod-redirection' '- key: example.com/old'; do
  grep -qF -- "$want" <<<"$out" || { echo "controller.taint.previousKeys: rendered Deployment lacks $want" >&2; exit 1; }
done
# inpod's other built-in keys are always previous, key alone: a rollback, a
# downgrade or a GitOps render (no lookup) that switches autoscaler strands
# no node either.
declare -A others=(
  [none]='readiness.k8s.io/inpod-redirection,startup-taint.cluster-autoscaler.kubernetes.io/inpod-redirection'
  [karpenter]='inpod.dev/not-ready,startup-taint.cluster-autoscaler.kubernetes.io/inpod-redirection'
  [cluster-autoscaler]='inpod.dev/not-ready,readiness.k8s.io/inpod-redirection'
)
for a in none karpenter cluster-autoscaler; do
  out=$("$helm" template inpod "$chart" -n inpod-system "${tc[@]}" --set autoscaler="$a" --show-only templates/controller-deployment.yaml)
  grep -qxF -- "            - --previous-taints=${others[$a]}" <<<"$out" ||
    { echo "autoscaler=$a without lookup: want exactly the other built-in keys previous, ${others[$a]}" >&2; echo "$out" >&2; exit 1; }
  for k in ${others[$a]//,/ }; do
    grep -qxF -- "        - key: $k" <<<"$out" || { echo "autoscaler=$a: the controller does not tolerate $k" >&2; exit 1; }
  done
done
out=$(notes "${tc[@]}")
grep -q 'earlier taints' <<<"$out" && { echo "NOTES.txt names earlier taints where none were given" >&2; exit 1; }
notes "${tc[@]}" | grep -qF "other startup taints (${others[none]})" ||
  { echo "NOTES.txt does not name the built-in keys the controller removes" >&2; exit 1; }
refuse "controller/taint/previousKeys" --set-json 'controller.taint.previousKeys=["not a key"]'
# The current key listed as previous is not previous: compared by key, not
# key:effect (no second toleration of it, no "earlier taint" in NOTES.txt).
out=$("$helm" template inpod "$chart" -n inpod-system "${tc[@]}" --set autoscaler=karpenter --set-json 'controller.taint.previousKeys=["readiness.k8s.io/inpod-redirection"]' --show-only templates/controller-deployment.yaml)
grep -qxF -- "            - --previous-taints=${others[karpenter]}" <<<"$out" ||
  { echo "the current key in controller.taint.previousKeys is rendered as previous" >&2; echo "$out" >&2; exit 1; }
[ "$(grep -cxF -- '        - key: readiness.k8s.io/inpod-redirection' <<<"$out")" = 1 ] ||
  { echo "the current key in controller.taint.previousKeys is tolerated twice" >&2; echo "$out" >&2; exit 1; }
out=$(notes "${tc[@]}" --set-json 'controller.taint.previousKeys=["inpod.dev/not-ready"]')
grep -q 'earlier taints' <<<"$out" &&
  { echo "NOTES.txt calls the current key in controller.taint.previousKeys an earlier taint" >&2; exit 1; }
# An effect change without lookup (helm template, GitOps): the current key
# with its old effect is listed, rendered as previous, and tolerated; an
# effect the controller refuses is refused by the schema.
out=$("$helm" template inpod "$chart" -n inpod-system "${tc[@]}" --set controller.taint.effect=PreferNoSchedule --set-json 'controller.taint.previousKeys=["inpod.dev/not-ready:NoSchedule"]' --show-only templates/controller-deployment.yaml)
grep -qE -- '--previous-taints=([^ ]*,)?inpod.dev/not-ready:NoSchedule(,|$)' <<<"$out" ||
  { echo "controller.taint.previousKeys: the current key with its old effect is not rendered as previous" >&2; echo "$out" >&2; exit 1; }
refuse "controller/taint/previousKeys" --set-json 'controller.taint.previousKeys=["inpod.dev/old:NoExecute"]'
# The controller refuses a key whose name passes 63 characters or whose
# prefix passes 253 (IsQualifiedName), and would crash-loop on it: the
# schema refuses them first, and takes the longest it accepts
# (taintcontroller's TestNewPreviousTaintKeyLengths).
n63=$(printf 'n%.0s' {1..63}); l60=$(printf 'p%.0s' {1..60}); p253="$l60.$l60.$l60.$l60.ppppppppp"
refuse "controller/taint/previousKeys" --set-json "controller.taint.previousKeys=[\"example.com/${n63}x\"]"
refuse "controller/taint/previousKeys" --set-json "controller.taint.previousKeys=[\"${n63}x\"]"
refuse "controller/taint/previousKeys" --set-json "controller.taint.previousKeys=[\"${p253}p/n\"]"
"$helm" template inpod "$chart" -n inpod-system "${tc[@]}" --set-json "controller.taint.previousKeys=[\"$p253/$n63\"]" | grep -qF -- "--previous-taints=$p253/$n63," ||
  { echo "controller.taint.previousKeys: a key of a 253-character prefix and a 63-character name is refused" >&2; exit 1; }
notes "${tc[@]}" --set-json 'controller.taint.previousKeys=["inpod.dev/old"]' | grep -qF 'the earlier taints inpod.dev/old' ||
  { echo "NOTES.txt does not name the earlier taints the controller removes" >&2; exit 1; }
upgrade_chart=$(mktemp -d)
trap 'rm -rf "$notes_chart" "$upgrade_chart"' EXIT
cp -R "$chart/." "$upgrade_chart/"
sed -i 's|lookup "apps/v1" "Deployment" .Release.Namespace "inpod-controller"|.Files.Get "deployed.yaml" \| fromYaml|' "$upgrade_chart/templates/_helpers.tpl"
grep -qF 'deployed.yaml' "$upgrade_chart/templates/_helpers.tpl" || { echo "chart-check: the lookup of the deployed controller was not found to stand in for" >&2; exit 1; }
deployed() { # helm args...: render "the deployed" controller
  "$helm" template inpod "$upgrade_chart" -n inpod-system "${tc[@]}" "$@" --show-only templates/controller-deployment.yaml >"$upgrade_chart/deployed.yaml.new"
  mv "$upgrade_chart/deployed.yaml.new" "$upgrade_chart/deployed.yaml"
}
: >"$upgrade_chart/deployed.yaml"
deployed --set controller.taint.key=example.com/a
out=$("$helm" template inpod "$upgrade_chart" -n inpod-system "${tc[@]}" --set controller.taint.key=example.com/b --show-only templates/controller-deployment.yaml)
for want in '--taint=example.com/b:NoSchedule' "--previous-taints=example.com/a:NoSchedule,inpod.dev/not-ready,${others[none]}" '- key: example.com/a'; do
  grep -qF -- "$want" <<<"$out" || { echo "upgrade key example.com/a -> b: rendered Deployment lacks $want" >&2; echo "$out" >&2; exit 1; }
done
# A second change before the first one's nodes are all ready keeps both.
deployed --set controller.taint.key=example.com/b
out=$("$helm" template inpod "$upgrade_chart" -n inpod-system "${tc[@]}" --set autoscaler=karpenter --show-only templates/controller-deployment.yaml)
grep -qF -- "--previous-taints=example.com/b:NoSchedule,example.com/a:NoSchedule,${others[karpenter]}" <<<"$out" ||
  { echo "upgrade example.com/b -> karpenter: the earlier --previous-taints are dropped" >&2; echo "$out" >&2; exit 1; }
# Back to a key it had: that one is current, not previous, though the
# deployed --previous-taints name it.
deployed --set autoscaler=karpenter
out=$("$helm" template inpod "$upgrade_chart" -n inpod-system "${tc[@]}" --set controller.taint.key=example.com/a --show-only templates/controller-deployment.yaml)
grep -qxF -- "            - --previous-taints=example.com/b:NoSchedule,inpod.dev/not-ready,readiness.k8s.io/inpod-redirection,startup-taint.cluster-autoscaler.kubernetes.io/inpod-redirection" <<<"$out" ||
  { echo "upgrade back to example.com/a: want the others previous, not the current one" >&2; echo "$out" >&2; exit 1; }
# The effect alone changed: the old effect of the same key is previous.
: >"$upgrade_chart/deployed.yaml"
deployed
out=$("$helm" template inpod "$upgrade_chart" -n inpod-system "${tc[@]}" --set controller.taint.effect=PreferNoSchedule --show-only templates/controller-deployment.yaml)
grep -qxF -- "            - --previous-taints=inpod.dev/not-ready:NoSchedule,${others[none]}" <<<"$out" ||
  { echo "upgrade effect NoSchedule -> PreferNoSchedule: the old effect is not previous" >&2; echo "$out" >&2; exit 1; }
refuse "karpenter issue 751" --set autoscaler=karpenter
refuse "autoscaler=karpenter with gate dra" --set autoscaler=karpenter --set 'gates={dra}'
"$helm" template inpod "$chart" -n inpod-system --set autoscaler=karpenter --set 'gates={deviceplugin}' --set enrollment.autoRequest.enabled=false >/dev/null ||
  { echo "autoscaler=karpenter refused without the resource request (nothing asks for the resource)" >&2; exit 1; }
out=$(notes --set autoscaler=cluster-autoscaler)
grep -qF 'k8s.io/cluster-autoscaler/node-template/resources/inpod.dev/redirection=' <<<"$out" || { echo "autoscaler=cluster-autoscaler: NOTES.txt lacks the node-template resource" >&2; exit 1; }
out=$(notes --set autoscaler=karpenter --set 'gates={node-condition}' --set controller.enabled=true --set controller.nodeTaintPolicy.enabled=true)
grep -qF 'readiness.k8s.io/inpod-redirection:NoSchedule is one karpenter waits out' <<<"$out" || { echo "autoscaler=karpenter: NOTES.txt does not name the startup taint" >&2; echo "$out" >&2; exit 1; }
# A key of one's own is a startup taint to the autoscaler only when it has
# the prefix; otherwise NOTES.txt warns, naming what to set.
for as in karpenter cluster-autoscaler; do
  out=$(notes --set autoscaler=$as "${tc[@]}" --set controller.taint.key=example.com/mine)
  if grep -qF 'is one '"$as"' waits out' <<<"$out"; then echo "autoscaler=$as, controller.taint.key=example.com/mine: NOTES.txt claims a startup taint" >&2; exit 1; fi
  want=$([[ $as == karpenter ]] && echo "startupTaints" || echo "--startup-taint")
  for w in 'WARNING: the startup taint example.com/mine:NoSchedule' "$want" 'controller.taint.key=""'; do
    grep -qF -- "$w" <<<"$out" || { echo "autoscaler=$as, controller.taint.key=example.com/mine: NOTES.txt lacks $w" >&2; echo "$out" >&2; exit 1; }
  done
done
out=$(notes --set autoscaler=karpenter "${tc[@]}" --set controller.taint.key=readiness.k8s.io/mine)
grep -qF 'readiness.k8s.io/mine:NoSchedule is one karpenter waits out' <<<"$out" || { echo "autoscaler=karpenter, a readiness.k8s.io/ key of one's own: NOTES.txt does not name it a startup taint" >&2; exit 1; }
echo "chart: each autoscaler gets a startup taint it waits out; Karpenter refused with the gates it cannot scale for"

# Platform options: SELinux and AppArmor per container, the controller's
# PodDisruptionBudget and zone spread, the quota for critical pods.
out=$("$helm" template inpod "$chart" -n inpod-system --set controller.enabled=true --set 'gates={node-condition}' --set agent.seLinuxOptions.type=spc_t \
  --set agent.appArmorProfile.type=Unconfined --set controller.seLinuxOptions.type=spc_t --set resourceQuota.enabled=true)
agent=$(sed -n '/^kind: DaemonSet/,/^---/p' <<<"$out")
ctrl=$(sed -n '/^kind: Deployment/,/^---/p' <<<"$out")
for want in 'seLinuxOptions:' 'type: spc_t' 'appArmorProfile:' 'type: Unconfined'; do
  grep -qF -- "$want" <<<"$agent" || { echo "agent: rendered DaemonSet lacks $want" >&2; exit 1; }
done
grep -qF 'type: spc_t' <<<"$ctrl" || { echo "controller: rendered Deployment lacks its seLinuxOptions" >&2; exit 1; }
if grep -qF 'appArmorProfile' <<<"$ctrl"; then echo "controller: renders an appArmorProfile it was not given" >&2; exit 1; fi
for want in 'topologyKey: topology.kubernetes.io/zone' 'whenUnsatisfiable: ScheduleAnyway'; do
  grep -qF -- "$want" <<<"$ctrl" || { echo "controller: rendered Deployment lacks $want" >&2; exit 1; }
done
for want in 'kind: PodDisruptionBudget' 'maxUnavailable: 1' 'kind: ResourceQuota' 'scopeName: PriorityClass' 'values: ["system-node-critical","system-cluster-critical"]' 'pods: "5000"'; do
  grep -qF -- "$want" <<<"$out" || { echo "rendered chart lacks $want" >&2; exit 1; }
done
out=$("$helm" template inpod "$chart" -n inpod-system)
if grep -q 'seLinuxOptions\|appArmorProfile\|kind: PodDisruptionBudget\|kind: ResourceQuota' <<<"$out"; then
  echo "the defaults render a security option, a PodDisruptionBudget without the controller, or a quota" >&2; exit 1
fi
echo "chart: SELinux and AppArmor options, the controller's disruption budget and spread, the critical-pod quota"

# The chart's README: every value documented, values.yaml and the schema
# agreeing, and the committed file what make chart-docs writes.
(cd "$repo" && go run ./internal/chartdoc/cmd/chartdoc -chart deploy/helm/inpod -check)
echo "chart: README.md documents every value and is current"
