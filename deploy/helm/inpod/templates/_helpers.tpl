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
