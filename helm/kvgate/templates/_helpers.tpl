{{/* Names and labels shared by every template. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that never select: added to pod templates next to the selector labels. */}}
{{- define "kvgate.extraLabels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end }}

{{- define "kvgate.labels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "kvgate.extraLabels" . }}
{{- end }}

{{/* Gateway pods: the component label keeps the Service from selecting the Redis pod. */}}
{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "kvgate.redis.fullname" -}}
{{- printf "%s-redis" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kvgate.adminSecretName" -}}
{{- default (printf "%s-admin" (include "kvgate.fullname" .)) .Values.admin.existingSecret }}
{{- end }}

{{- define "kvgate.kubernetesDiscovery" -}}
{{- if eq (((.Values.config).discovery).kind | default "static") "kubernetes" }}true{{ end }}
{{- end }}

{{/* Where the vLLM pods are watched: the configured namespace or the release's. */}}
{{- define "kvgate.discoveryNamespace" -}}
{{- default .Release.Namespace ((.Values.config).discovery).namespace }}
{{- end }}

{{/* The Redis URL when it is not in a Secret. */}}
{{- define "kvgate.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "kvgate.redis.fullname" .) (int .Values.redis.port) }}
{{- else }}
{{- .Values.externalRedis.url }}
{{- end }}
{{- end }}

{{/* kvgate.yaml: the user's settings with the chart-managed keys filled in. */}}
{{- define "kvgate.configYaml" -}}
{{- $cfg := deepCopy (.Values.config | default dict) }}
{{- $_ := set $cfg "host" "0.0.0.0" }}
{{- $_ := set $cfg "port" (int .Values.service.port) }}
{{- $index := dict "backend" "redis" "key_prefix" .Values.index.keyPrefix }}
{{- $_ := set $cfg "index" $index }}
{{- $discovery := deepCopy ($cfg.discovery | default dict) }}
{{- $_ := set $discovery "namespace" (include "kvgate.discoveryNamespace" .) }}
{{- $_ := set $cfg "discovery" $discovery }}
{{- if .Values.g4.enabled }}
{{- $g4 := deepCopy ($cfg.g4 | default dict) }}
{{- $_ := set $g4 "path" .Values.g4.mountPath }}
{{- if .Values.g4.capacityBytes }}
{{- $_ := set $g4 "capacity_bytes" (int64 .Values.g4.capacityBytes) }}
{{- end }}
{{- $_ := set $cfg "g4" $g4 }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The vLLM arguments users add to their vLLM servers (NOTES.txt). */}}
{{- define "kvgate.vllmArgs" -}}
--enable-prompt-tokens-details
--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{{ .Values.vllm.eventsPort }}","replay_endpoint":"tcp://*:{{ .Values.vllm.replayPort }}"}'
{{- if .Values.g4.enabled }}
--kv-transfer-config '{"kv_connector":"KvgateConnector","kv_connector_module_path":"cache_tier.connector","kv_role":"kv_both","kv_connector_extra_config":{"g4_path":"{{ .Values.g4.mountPath }}"},"kv_load_failure_policy":"recompute"}'
{{- end }}
{{- end }}
