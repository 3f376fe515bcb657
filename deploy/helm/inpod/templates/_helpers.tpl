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

{{- define "inpod.agentImage" -}}
{{ .Values.agent.image.repository }}:{{ .Values.agent.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The ServiceAccount of the agent, as the API server names its user. */}}
{{- define "inpod.agentUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:inpod-agent
{{- end }}

{{- define "inpod.controllerImage" -}}
{{ .Values.controller.image.repository }}:{{ .Values.controller.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The startup taint as inpod-controller's --taint spells it. */}}
{{- define "inpod.controllerTaint" -}}
{{ .Values.controller.taint.key }}:{{ .Values.controller.taint.effect }}
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
