{{/* Labels of the monitoring objects: the chart's, as component monitoring, with the user's on top. */}}
{{- define "sparrowrl-operator.monitoringLabels" -}}
{{- $own := dict
  "helm.sh/chart" (printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-")
  "app.kubernetes.io/name" (include "sparrowrl-operator.name" .)
  "app.kubernetes.io/instance" .Release.Name
  "app.kubernetes.io/version" .Chart.AppVersion
  "app.kubernetes.io/managed-by" .Release.Service
  "app.kubernetes.io/component" "monitoring"
  "app.kubernetes.io/part-of" "sparrowrl" }}
{{- toYaml (merge (dict) .extra $own) }}
{{- end }}
