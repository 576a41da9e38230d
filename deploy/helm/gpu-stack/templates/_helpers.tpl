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
{{- required "imageRepository is not set: no registry publishes the gpu-stack images. Build them (docs/operator.md, Images), push them to a registry of yours and install with --set imageRepository=<registry>/<path>" .Values.imageRepository -}}
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

{{/*
A chart hook's ServiceAccount, ClusterRole and ClusterRoleBinding, made for
the hook and deleted after it. Takes a dict: root (.), name, hook (the
helm.sh/hook annotations), weight (of the Job; the account comes first) and
rules (the ClusterRole's).
*/}}
{{- define "gpu-stack.hookAccount" -}}
{{- $root := .root -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ .name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "gpu-stack.labels" $root | nindent 4 }}
  annotations:
    {{- toYaml .hook | nindent 4 }}
    helm.sh/hook-weight: {{ sub .weight 10 | quote }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ .name }}
  labels:
    {{- include "gpu-stack.labels" $root | nindent 4 }}
  annotations:
    {{- toYaml .hook | nindent 4 }}
    helm.sh/hook-weight: {{ sub .weight 10 | quote }}
rules:
  {{- toYaml .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ .name }}
  labels:
    {{- include "gpu-stack.labels" $root | nindent 4 }}
  annotations:
    {{- toYaml .hook | nindent 4 }}
    helm.sh/hook-weight: {{ sub .weight 9 | quote }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ .name }}
subjects:
  - kind: ServiceAccount
    name: {{ .name }}
    namespace: {{ $root.Release.Namespace }}
{{- end -}}

{{/*
A chart hook's Job: `gpu-operator` with the given args, in the operator's
image, under the hook's ServiceAccount. Takes a dict: root (.), name, hook,
weight, component (the pod's component label and container name) and args.
*/}}
{{- define "gpu-stack.hookJob" -}}
{{- $root := .root -}}
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ .name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "gpu-stack.labels" $root | nindent 4 }}
  annotations:
    {{- toYaml .hook | nindent 4 }}
    helm.sh/hook-weight: {{ .weight | quote }}
spec:
  backoffLimit: 2
  activeDeadlineSeconds: 600
  template:
    metadata:
      labels:
        app.kubernetes.io/name: {{ $root.Chart.Name }}
        app.kubernetes.io/instance: {{ $root.Release.Name }}
        app.kubernetes.io/component: {{ .component }}
    spec:
      serviceAccountName: {{ .name }}
      restartPolicy: Never
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        runAsGroup: 65532
        seccompProfile:
          type: RuntimeDefault
      {{- with $root.Values.operator.imagePullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "gpu-stack.operatorImage" $root }}
          imagePullPolicy: {{ $root.Values.operator.imagePullPolicy }}
          args:
            {{- toYaml .args | nindent 12 }}
            - --log-format={{ $root.Values.operator.logFormat }}
          env:
            - name: RUST_LOG
              value: {{ $root.Values.operator.logLevel | quote }}
          resources:
            {{- toYaml $root.Values.operator.resources | nindent 12 }}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
      {{- with $root.Values.operator.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.operator.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.operator.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
