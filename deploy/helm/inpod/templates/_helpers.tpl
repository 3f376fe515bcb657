{{/* Labels every object carries. part-of=inpod also keeps inpod's own pods
out of the resource-request policy. */}}
{{- define "inpod.labels" -}}
app.kubernetes.io/name: inpod
app.kubernetes.io/part-of: inpod
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The agent's selector: also the agent's default --agent-selector, which
finds every installation's agents at uninstall. */}}
{{- define "inpod.agentSelector" -}}
app.kubernetes.io/name: inpod
app.kubernetes.io/component: agent
{{- end }}

{{/* An image reference from its values (list <image values> $ <values
path>): by digest when one is set (repository@digest), else by tag (default
the chart's appVersion). Both set is refused: an install pinned by digest
(values-release.yaml) upgraded with --reuse-values --set <path>.tag=<new>
would otherwise keep running the old image without a word. */}}
{{- define "inpod.image" -}}
{{- $image := index . 0 }}
{{- $ := index . 1 }}
{{- $path := index . 2 }}
{{- if and $image.digest $image.tag }}
{{- fail (printf "%s.tag (%s) and %s.digest are both set, and the digest would win: the tag would be ignored. To run that tag, also set %s.digest=\"\"; to run a release, pass its values-release.yaml with -f (it sets the digest)" $path $image.tag $path $path) }}
{{- end }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository ($image.tag | default $.Chart.AppVersion) }}
{{- end }}
{{- end }}

{{- define "inpod.agentImage" -}}
{{ include "inpod.image" (list .Values.agent.image $ "agent.image") }}
{{- end }}

{{/* The ServiceAccount of the agent, as the API server names its user. */}}
{{- define "inpod.agentUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:inpod-agent
{{- end }}

{{- define "inpod.controllerImage" -}}
{{ include "inpod.image" (list .Values.controller.image $ "controller.image") }}
{{- end }}

{{/* The startup taint's key: controller.taint.key, or the one the
autoscaler waits out as a startup taint (values.yaml, autoscaler). */}}
{{- define "inpod.taintKey" -}}
{{- $byAutoscaler := dict "karpenter" "readiness.k8s.io/inpod-redirection" "cluster-autoscaler" "startup-taint.cluster-autoscaler.kubernetes.io/inpod-redirection" }}
{{- .Values.controller.taint.key | default (get $byAutoscaler (.Values.autoscaler | default "none")) | default "inpod.dev/not-ready" }}
{{- end }}

{{/* The startup taint as inpod-controller's --taint spells it. */}}
{{- define "inpod.controllerTaint" -}}
{{ include "inpod.taintKey" . }}:{{ .Values.controller.taint.effect }}
{{- end }}

{{/* inpod's own startup-taint keys, those inpod.taintKey picks by autoscaler,
other than the current key (comma-separated). They are always in
--previous-taints, key alone: a rollback, a downgrade or a GitOps render
(helm template: no lookup) that switches autoscaler gets no deployed --taint,
and nodes tainted under the other key would keep it for good. They are
inpod's names, and the controller still removes them only from a ready
node. */}}
{{- define "inpod.builtinPreviousKeys" -}}
{{- $current := include "inpod.taintKey" . }}
{{- $out := list }}
{{- range list "inpod.dev/not-ready" "readiness.k8s.io/inpod-redirection" "startup-taint.cluster-autoscaler.kubernetes.io/inpod-redirection" }}
{{- if ne . $current }}{{ $out = append $out . }}{{ end }}
{{- end }}
{{- join "," $out }}
{{- end }}

{{/* The startup taints of earlier configurations beyond the built-in keys
(comma-separated; empty: none). From controller.taint.previousKeys (a key
alone: either effect), and, on a live install (lookup finds nothing under
helm template), the deployed controller's --taint and the --previous-taints
it already carried: a second change before the first one's nodes are ready
strands none either. A key the built-in ones cover is left to them. The
current taint is never one of them: an entry is compared by key (the
deployed --previous-taints carry the built-in keys, the current one among
them after a switch back), except one naming another effect, as the deployed
--taint does when only the effect changed. */}}
{{- define "inpod.earlierTaints" -}}
{{- $currentKey := include "inpod.taintKey" . }}
{{- $currentEffect := .Values.controller.taint.effect }}
{{- $builtin := splitList "," (include "inpod.builtinPreviousKeys" .) }}
{{- $all := list }}
{{- range (.Values.controller.taint.previousKeys | default list) }}
{{- $all = append $all . }}
{{- end }}
{{- $deployed := lookup "apps/v1" "Deployment" .Release.Namespace "inpod-controller" }}
{{- range (dig "spec" "template" "spec" "containers" list $deployed) }}
{{- if eq .name "controller" }}
{{- range (.args | default list) }}
{{- if hasPrefix "--taint=" . }}
{{- $all = append $all (trimPrefix "--taint=" .) }}
{{- else if hasPrefix "--previous-taints=" . }}
{{- $all = concat $all (splitList "," (trimPrefix "--previous-taints=" .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $out := list }}
{{- range $all }}
{{- $kv := splitList ":" . }}
{{- $effect := ternary (last $kv) "" (gt (len $kv) 1) }}
{{- if or (not .) (has (first $kv) $builtin) }}
{{- else if and (eq (first $kv) $currentKey) (or (not $effect) (eq $effect $currentEffect)) }}
{{- else }}{{ $out = append $out . }}
{{- end }}
{{- end }}
{{- join "," ($out | uniq) }}
{{- end }}

{{/* inpod-controller's --previous-taints: the earlier taints and the
built-in keys. The controller removes them when it would remove its own
(node ready) and never adds them, so a key (or effect) changed on upgrade,
rollback or a GitOps render strands no node. */}}
{{- define "inpod.previousTaints" -}}
{{- $l := list }}
{{- with include "inpod.earlierTaints" . }}{{ $l = append $l . }}{{ end }}
{{- with include "inpod.builtinPreviousKeys" . }}{{ $l = append $l . }}{{ end }}
{{- join "," $l }}
{{- end }}

{{/* The mesh nodes: agent.nodeSelector merged with controller.nodeSelector
(the controller's wins on a shared key). A node the agent never runs on must
never match, or the node-taint policy taints it and nothing removes the
taint. As a dict for the binding's objectSelector. */}}
{{- define "inpod.meshNodeLabels" -}}
{{- toYaml (merge (deepCopy (.Values.controller.nodeSelector | default dict)) (deepCopy (.Values.agent.nodeSelector | default dict))) }}
{{- end }}

{{/* The mesh nodes as a label selector (--node-selector). */}}
{{- define "inpod.meshNodeSelector" -}}
{{- $terms := list }}
{{- range $k, $v := (include "inpod.meshNodeLabels" . | fromYaml) }}
{{- $terms = append $terms (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $terms }}
{{- end }}

{{/* The enrollment rules an admission policy on pods shares with the
agent, as CEL matchConditions: never hostNetwork pods, never inpod's own
(part-of=inpod in the release namespace: anywhere else the label is a
user's, and the agent enrolls such a pod like any other). Never mirror pods either (the API copies of static pods):
the kubelet runs the static manifest, not their spec, so a request would
only skew the scheduler's accounting and an init container would never run
(where the agent has run, it still enrolls the static pod at its CNI ADD; on a node it has not
reached yet nothing holds one). The label and namespace rules are the bindings' selectors
(inpod.enrollmentBindings): a MutatingAdmissionPolicy cannot read the
namespace's labels in CEL. */}}
{{- define "inpod.enrolledPodConditions" -}}
- name: not-host-network
  expression: '!has(object.spec.hostNetwork) || !object.spec.hostNetwork'
- name: not-mirror
  expression: >-
    !has(object.metadata.annotations) || !('kubernetes.io/config.mirror' in object.metadata.annotations)
- name: not-inpod
  expression: >-
    request.namespace != {{ .Release.Namespace | squote }} ||
    !has(object.metadata.labels) || !('app.kubernetes.io/part-of' in object.metadata.labels) ||
    object.metadata.labels['app.kubernetes.io/part-of'] != 'inpod'
{{- end }}

{{/* The two bindings that apply a pod policy (list $ "policy-name") to the
pods the enrollment rules enroll: one for pods labelled ambient, one for
unlabelled pods in namespaces labelled ambient (the pod's own label decides
when it says ambient or none); never the excluded namespaces. */}}
{{- define "inpod.enrollmentBindings" -}}
{{- $ := index . 0 }}
{{- $policy := index . 1 }}
{{- /* Optional third element: "Validating" for a ValidatingAdmissionPolicy
(its bindings deny). */}}
{{- $kind := "Mutating" }}
{{- if eq (len .) 3 }}{{ $kind = index . 2 }}{{ end }}
{{- $label := $.Values.enrollment.label }}
---
apiVersion: admissionregistration.k8s.io/v1
kind: {{ $kind }}AdmissionPolicyBinding
metadata:
  name: {{ $policy }}-pod-label
  labels:
    {{- include "inpod.labels" $ | nindent 4 }}
spec:
  policyName: {{ $policy }}
  {{- if eq $kind "Validating" }}
  validationActions: [Deny]
  {{- end }}
  matchResources:
    objectSelector:
      matchLabels:
        {{ $label }}: ambient
    {{- with $.Values.enrollment.excludedNamespaces }}
    namespaceSelector:
      matchExpressions:
        - {key: kubernetes.io/metadata.name, operator: NotIn, values: {{ toJson . }}}
    {{- end }}
---
apiVersion: admissionregistration.k8s.io/v1
kind: {{ $kind }}AdmissionPolicyBinding
metadata:
  name: {{ $policy }}-namespace-label
  labels:
    {{- include "inpod.labels" $ | nindent 4 }}
spec:
  policyName: {{ $policy }}
  {{- if eq $kind "Validating" }}
  validationActions: [Deny]
  {{- end }}
  matchResources:
    # The pod's own label decides when it says ambient or none.
    objectSelector:
      matchExpressions:
        - {key: {{ $label }}, operator: NotIn, values: [ambient, none]}
    namespaceSelector:
      matchLabels:
        {{ $label }}: ambient
      {{- with $.Values.enrollment.excludedNamespaces }}
      matchExpressions:
        - {key: kubernetes.io/metadata.name, operator: NotIn, values: {{ toJson . }}}
      {{- end }}
{{- end }}

{{/* The pod condition the agent sets True once a pod's redirection is
proven, and the readiness gate of enrolled pods (DESIGN.md, "per-pod
proof"). */}}
{{- define "inpod.readinessGateCondition" -}}
inpod.dev/redirected
{{- end }}

{{/* "true" when enrolled pods get the readiness gate, else "". A release
installed before the value existed (helm upgrade --reuse-values keeps its
values) does not get it: that is what it had. */}}
{{- define "inpod.readinessGate" -}}
{{- if dig "readinessGate" "enabled" false .Values.enrollment }}true{{ end }}
{{- end }}

{{/* "true" when enrolled pods get the resource request: only with a gate
that advertises the resource (otherwise, taint mode, every enrolled pod
would wait for a resource no node offers). */}}
{{- define "inpod.autoRequest" -}}
{{- if and .Values.enrollment.autoRequest.enabled (or (has "deviceplugin" .Values.gates) (has "dra" .Values.gates)) }}true{{ end }}
{{- end }}

{{/* "true" when inpod-controller's webhook serves admission (mode=webhook):
for the request, the readiness gate, or both. */}}
{{- define "inpod.webhook" -}}
{{- if and (eq .Values.enrollment.autoRequest.mode "webhook") (or (include "inpod.autoRequest" .) (include "inpod.readinessGate" .)) }}true{{ end }}
{{- end }}

{{- define "inpod.waitReadyImage" -}}
{{ include "inpod.image" (list .Values.initContainer.image $ "initContainer.image") }}
{{- end }}

{{/* A map of resource quantities as a CEL map literal of strings. */}}
{{- define "inpod.celQuantities" -}}
{{- $terms := list }}
{{- range $k, $v := . }}
{{- $terms = append $terms (printf "%q: %q" $k (toString $v)) }}
{{- end }}
{{- printf "{%s}" (join ", " $terms) }}
{{- end }}

{{/* inpod-wait-ready as a CEL object of the init-container policy's
mutation. */}}
{{- define "inpod.waitReadyContainer" -}}
{{- $ic := .Values.initContainer -}}
Object.spec.initContainers{
  name: "inpod-wait-ready",
  image: {{ include "inpod.waitReadyImage" . | quote }},
  imagePullPolicy: {{ $ic.image.pullPolicy | quote }},
  args: [{{ printf "--timeout=%s" $ic.timeout | quote }}],
  terminationMessagePolicy: "FallbackToLogsOnError",
  resources: Object.spec.initContainers.resources{
    requests: {{ include "inpod.celQuantities" $ic.resources.requests }},
    limits: {{ include "inpod.celQuantities" $ic.resources.limits }}
  },
  securityContext: Object.spec.initContainers.securityContext{
    runAsNonRoot: true,
    runAsUser: {{ int $ic.runAsUser }},
    runAsGroup: {{ int $ic.runAsUser }},
    readOnlyRootFilesystem: true,
    allowPrivilegeEscalation: false,
    privileged: false,
    capabilities: Object.spec.initContainers.securityContext.capabilities{drop: ["ALL"]},
    seccompProfile: Object.spec.initContainers.securityContext.seccompProfile{type: "RuntimeDefault"}
  }
}
{{- end }}
