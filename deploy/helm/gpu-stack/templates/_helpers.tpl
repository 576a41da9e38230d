{{/* Full name of the release's objects. */}}
{{- define "gpu-stack.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-stack.serviceAccountName" -}}
{{- default (include "gpu-stack.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "gpu-stack.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpu-stack.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "gpu-stack.operatorImage" -}}
{{- printf "%s/%s:%s" .Values.operator.repository .Values.operator.image (default .Chart.AppVersion .Values.operator.version) -}}
{{- end -}}

{{/*
A ClusterPolicy section with empty-string fields dropped, so an image left
empty in values falls back to the operator's built-in default instead of
being sent as "".
*/}}
{{- define "gpu-stack.section" -}}
{{- $out := dict -}}
{{- range $k, $v := . -}}
{{- if not (and (kindIs "string" $v) (eq $v "")) -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}
