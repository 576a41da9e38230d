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

{{/* The repository of the gpu-stack images; installing without one fails. */}}
{{- define "gpu-stack.imageRepository" -}}
{{- required "imageRepository is not set: no registry publishes the gpu-stack images. Build them (README, Images), push them to a registry of yours and install with --set imageRepository=<registry>/<path>" .Values.imageRepository -}}
{{- end -}}

{{/* The tag of the gpu-stack images. */}}
{{- define "gpu-stack.imageTag" -}}
{{- .Values.imageTag | default .Chart.AppVersion -}}
{{- end -}}

{{/*
A gpu-stack image: (dict "root" $ "image" NAME [ "repository" R ] [ "version" V ]);
repository and version default to imageRepository and imageTag.
*/}}
{{- define "gpu-stack.image" -}}
{{- $repo := .repository | default (include "gpu-stack.imageRepository" .root) -}}
{{- $tag := .version | default (include "gpu-stack.imageTag" .root) -}}
{{- printf "%s/%s:%s" $repo .image $tag -}}
{{- end -}}

{{- define "gpu-stack.operatorImage" -}}
{{- include "gpu-stack.image" (dict "root" . "image" .Values.operator.image "repository" .Values.operator.repository "version" .Values.operator.version) -}}
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
