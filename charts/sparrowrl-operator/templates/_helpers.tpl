{{/* The chart's name, cut to 63 characters (a label value's limit). */}}
{{- define "sparrowrl-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: the release name alone when it already holds the chart's name. */}}
{{- define "sparrowrl-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "sparrowrl-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sparrowrl-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sparrowrl-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "sparrowrl-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: sparrowrl
{{- end }}

{{- define "sparrowrl-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sparrowrl-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sparrowrl-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The job pods' default image: sparrowrl-runtime beside the operator's, as `make push` puts them. */}}
{{- define "sparrowrl-operator.runtimeImage" -}}
{{- $repo := .Values.image.repository }}
{{- $registry := ternary (printf "%s/" (dir $repo)) "" (contains "/" $repo) }}
{{- $beside := printf "%ssparrowrl-runtime:%s" $registry (default .Chart.AppVersion .Values.image.tag) }}
{{- default $beside .Values.runtimeImage }}
{{- end }}

{{/* The jobs' NetworkPolicy settings, for the operator (SPARROWRL_NETWORK_POLICY): whether jobs get
one, who scrapes them, and this operator's pods as a NetworkPolicyPeer (it reads each trainer's status). */}}
{{- define "sparrowrl-operator.networkPolicy" -}}
{{- $operator := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "sparrowrl-operator.selectorLabels" . | fromYaml)) }}
{{- dict "jobs" .Values.networkPolicy.jobs "metricsFrom" .Values.networkPolicy.metricsFrom "operator" $operator | toJson }}
{{- end }}
