{{/*
Names, labels, fixed paths, and the rendered kv-epp configuration file. Every template takes its
names and paths from here, so the Deployment, Services, RBAC and the InferencePool always agree.
*/}}

{{- define "kv-epp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the picker's resources (Deployment, Service, ServiceAccount...). Kept at 57
characters so suffixes like "-peers" still fit the 63-character DNS label limit. */}}
{{- define "kv-epp.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 57 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 57 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 57 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kv-epp.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-epp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kv-epp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{- define "kv-epp.labels" -}}
helm.sh/chart: {{ include "kv-epp.chart" . }}
{{ include "kv-epp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kv-epp
{{- end }}

{{/* The InferencePool this picker serves (the chart's own or one created elsewhere). */}}
{{- define "kv-epp.poolName" -}}
{{- default .Release.Name .Values.inferencePool.name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* API group of the InferencePool, from inferencePool.apiVersion. */}}
{{- define "kv-epp.poolGroup" -}}
{{- index (splitList "/" .Values.inferencePool.apiVersion) 0 }}
{{- end }}

{{- define "kv-epp.peerServiceName" -}}
{{- printf "%s-peers" (include "kv-epp.fullname" .) }}
{{- end }}

{{/* Cluster-scoped names carry the namespace, so two releases of the same name never collide. */}}
{{- define "kv-epp.metricsAuthName" -}}
{{- printf "%s-%s-metrics-auth" .Release.Namespace (include "kv-epp.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-epp.serviceAccountName" -}}
{{- if .Values.inferenceExtension.serviceAccount.create }}
{{- default (include "kv-epp.fullname" .) .Values.inferenceExtension.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.inferenceExtension.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kv-epp.image" -}}
{{- $i := .Values.inferenceExtension.image }}
{{- printf "%s/%s:%s" $i.hub $i.name (default .Chart.AppVersion $i.tag) }}
{{- end }}

{{/* Secrets: the chart's own unless an existing one is named. */}}
{{- define "kv-epp.peerSecretName" -}}
{{- default (printf "%s-peer-auth" (include "kv-epp.fullname" .)) .Values.inferenceExtension.peerAuth.existingSecret }}
{{- end }}

{{- define "kv-epp.adminSecretName" -}}
{{- default (printf "%s-admin-auth" (include "kv-epp.fullname" .)) .Values.inferenceExtension.admin.existingSecret }}
{{- end }}

{{- define "kv-epp.peerTlsSecretName" -}}
{{- default (printf "%s-peer-tls" (include "kv-epp.fullname" .)) .Values.inferenceExtension.peerTLS.existingSecret }}
{{- end }}

{{/* The names a peer certificate is issued for; replicas check `<peer Service>.<namespace>.svc`
(kv-epp's default peers.server_name under peers.service). */}}
{{- define "kv-epp.peerDnsNames" -}}
{{- $svc := include "kv-epp.peerServiceName" . }}
{{- $ns := .Release.Namespace }}
{{- toJson (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns)) }}
{{- end }}

{{- define "kv-epp.fingerprintSecretName" -}}
{{- default (printf "%s-salt-key" (include "kv-epp.fullname" .)) .Values.inferenceExtension.saltFingerprintKey.existingSecret }}
{{- end }}

{{/* Fixed paths inside the container. Secrets live outside /etc/kv-epp because a ConfigMap
volume is read-only and cannot hold mount points for other volumes. */}}
{{- define "kv-epp.configDir" -}}/etc/kv-epp{{- end }}
{{- define "kv-epp.configPath" -}}/etc/kv-epp/config.yaml{{- end }}
{{- define "kv-epp.peerAuthDir" -}}/var/run/secrets/kv-epp/peer-auth{{- end }}
{{- define "kv-epp.adminAuthDir" -}}/var/run/secrets/kv-epp/admin-auth{{- end }}
{{- define "kv-epp.saltKeyDir" -}}/var/run/secrets/kv-epp/salt{{- end }}
{{- define "kv-epp.tlsDir" -}}/var/run/secrets/kv-epp/tls{{- end }}
{{- define "kv-epp.clientCADir" -}}/var/run/secrets/kv-epp/client-ca{{- end }}
{{- define "kv-epp.peerTlsDir" -}}/var/run/secrets/kv-epp/peer-tls{{- end }}

{{/* KV event engine: config.events.engine, else derived from the model-server type. */}}
{{- define "kv-epp.eventsEngine" -}}
{{- $e := .Values.config.events.engine }}
{{- if $e }}{{ $e }}
{{- else if eq .Values.inferencePool.modelServerType "trtllm-serve" }}trtllm
{{- else if eq .Values.inferencePool.modelServerType "sglang" }}sglang
{{- else }}vllm
{{- end }}
{{- end }}

{{/* The drain Lease's name (config.peers.coordination: lease). */}}
{{- define "kv-epp.drainLeaseName" -}}
{{- printf "%s-drains" (include "kv-epp.fullname" .) }}
{{- end }}

{{/* "true" when a drain Lease is in use: coordination lease and an engine drained over HTTP
(TensorRT-LLM without its ZeroMQ transport), the only single-reader source; the Role allows
Leases only then. */}}
{{- define "kv-epp.drainLease" -}}
{{- $c := .Values.config }}
{{- if and (eq ($c.peers.coordination | default "lease") "lease") (eq (include "kv-epp.eventsEngine" .) "trtllm") (ne ($c.events.trtllm.transport | default "http") "zmq") }}true{{ end }}
{{- end }}

{{/* Checks the schema cannot express (they compare several values). */}}
{{- define "kv-epp.validate" -}}
{{- $ie := .Values.inferenceExtension }}
{{- $ports := dict }}
{{- range $name := list "extProcPort" "grpcHealthPort" "metricsPort" "adminPort" "peerPort" }}
{{- $p := toString (int (index $ie $name)) }}
{{- if hasKey $ports $p }}
{{- fail (printf "inferenceExtension.%s and inferenceExtension.%s are both %s: every port must differ" (index $ports $p) $name $p) }}
{{- end }}
{{- $_ := set $ports $p $name }}
{{- end }}
{{- $managed := dict
      "config-file" "the chart's ConfigMap (config.*)"
      "pool-name" "inferencePool.name"
      "pool-namespace" "the release namespace"
      "grpc-port" "inferenceExtension.extProcPort"
      "grpc-health-port" "inferenceExtension.grpcHealthPort"
      "metrics-port" "inferenceExtension.metricsPort"
      "admin-port" "inferenceExtension.adminPort"
      "peer-port" "inferenceExtension.peerPort"
      "peer-token-file" "inferenceExtension.peerAuth"
      "admin-token-file" "inferenceExtension.admin"
      "secure-serving" "inferenceExtension.tls.enabled"
      "cert-path" "inferenceExtension.tls.secretName"
      "client-ca-path" "inferenceExtension.tls.clientCA"
      "peer-cert-path" "inferenceExtension.peerTLS" }}
{{- range $flag, $_ := $ie.flags }}
{{- if hasKey $managed $flag }}
{{- fail (printf "inferenceExtension.flags.%s: the chart sets --%s itself; use %s" $flag $flag (index $managed $flag)) }}
{{- end }}
{{- end }}
{{- if and .Values.inferencePool.create (empty .Values.inferencePool.modelServers.matchLabels) }}
{{- fail "inferencePool.modelServers.matchLabels is required when inferencePool.create is true (labels of the model-server pods)" }}
{{- end }}
{{- if and (hasPrefix "inference.networking.x-k8s.io/" .Values.inferencePool.apiVersion) (gt (len .Values.inferencePool.targetPorts) 1) }}
{{- fail "inferencePool.targetPorts: inference.networking.x-k8s.io/v1alpha2 pools have a single target port; use inference.networking.k8s.io/v1 for several" }}
{{- end }}
{{- range $i, $m := .Values.config.models }}
{{- if and $m.tokenizer (empty $.Values.inferenceExtension.tokenizers.volume) }}
{{- fail (printf "config.models[%d].tokenizer is set but inferenceExtension.tokenizers.volume is empty: mount the tokenizer files" $i) }}
{{- end }}
{{- end }}
{{- if and $ie.tls.clientCA.secretName (not $ie.tls.enabled) }}
{{- fail "inferenceExtension.tls.clientCA.secretName needs inferenceExtension.tls.enabled: client certificates are part of the TLS handshake" }}
{{- end }}
{{- if and $ie.peerTLS.enabled $ie.peerTLS.certManager.enabled }}
{{- if $ie.peerTLS.existingSecret }}
{{- fail "inferenceExtension.peerTLS: set existingSecret or certManager.enabled, not both" }}
{{- end }}
{{- if not $ie.peerTLS.certManager.issuerRef.name }}
{{- fail "inferenceExtension.peerTLS.certManager.issuerRef.name is required when certManager.enabled is true" }}
{{- end }}
{{- end }}
{{- if and $ie.monitoring.prometheus.enabled $ie.monitoring.prometheus.auth.enabled (not $ie.monitoring.prometheus.auth.secretName) }}
{{- fail "inferenceExtension.monitoring.prometheus.auth.secretName is required when metrics auth and the ServiceMonitor are both enabled" }}
{{- end }}
{{- end }}

{{/* kv-epp's configuration file. Sections config.rs already reads are rendered as given; the
chart fills in ports, TLS, the pool and secret file paths from the values above, so flags and
file never disagree. */}}
{{- define "kv-epp.config" -}}
{{- $ie := .Values.inferenceExtension }}
{{- $c := .Values.config }}
{{- $server := dict
      "bind_address" $c.server.bind_address
      "grpc_port" (int $ie.extProcPort)
      "grpc_health_port" (int $ie.grpcHealthPort)
      "metrics_port" (int $ie.metricsPort)
      "secure_serving" $ie.tls.enabled
      "max_concurrent_streams" (int64 $c.server.max_concurrent_streams)
      "keepalive_interval_ms" (int64 $c.server.keepalive_interval_ms)
      "keepalive_timeout_ms" (int64 $c.server.keepalive_timeout_ms)
      "io_threads" (int64 $c.server.io_threads) }}
{{- if and $ie.tls.enabled $ie.tls.secretName }}
{{- $_ := set $server "cert_path" (include "kv-epp.tlsDir" .) }}
{{- end }}
{{- if and $ie.tls.enabled $ie.tls.clientCA.secretName }}
{{- $_ := set $server "client_ca_path" (printf "%s/%s" (include "kv-epp.clientCADir" .) $ie.tls.clientCA.key) }}
{{- end }}
{{- if $ie.monitoring.prometheus.auth.enabled }}
{{- $_ := set $server "metrics_auth" true }}
{{- end }}
{{- $salt := dict
      "sources" $c.salt.sources
      "required" $c.salt.required
      "fingerprint_key_file" (printf "%s/%s" (include "kv-epp.saltKeyDir" .) $ie.saltFingerprintKey.key) }}
{{- $engine := include "kv-epp.eventsEngine" . }}
{{- $events := dict "engine" $engine }}
{{- if or (eq $engine "vllm") (eq $engine "sglang") }}
{{- $_ := set $events "zmq" $c.events.zmq }}
{{- else if eq $engine "trtllm" }}
{{- $trtllm := omit $c.events.trtllm "transport" }}
{{- if eq ($c.events.trtllm.transport | default "http") "zmq" }}
{{- $_ := set $trtllm "transport" "zmq" }}
{{- $_ := set $events "zmq" $c.events.zmq }}
{{- end }}
{{- $_ := set $events "trtllm" $trtllm }}
{{- end }}
{{- if eq (toString $c.events.salted_events) "false" }}
{{- $_ := set $events "salted_events" false }}
{{- end }}
{{- $out := dict
      "server" $server
      "pool" (dict
        "name" (include "kv-epp.poolName" .)
        "namespace" .Release.Namespace
        "api_version" (ternary "v1alpha2" "v1" (hasPrefix "inference.networking.x-k8s.io/" .Values.inferencePool.apiVersion))
        "model_label" $c.pool.model_label
        "api_unreachable_timeout_ms" (int64 $c.pool.api_unreachable_timeout_ms))
      "routing" $c.routing
      "flow_control" $c.flow_control
      "scoring" $c.scoring
      "salt" $salt
      "index" $c.index
      "models" $c.models
      "workers" $c.workers
      "events" $events
      "peers" (dict
        "service" (include "kv-epp.peerServiceName" .)
        "coordination" ($c.peers.coordination | default "lease")
        "lease_name" (include "kv-epp.drainLeaseName" .)
        "lease_duration_seconds" (int64 $c.peers.lease_duration_seconds)
        "lease_renew_ms" (int64 $c.peers.lease_renew_ms)) }}
{{- toYaml $out }}
{{- end }}

{{/* One NetworkPolicy peer from a {namespaceSelector, podSelector} value: a null
namespaceSelector means the release namespace (the field is left out), {} every namespace. */}}
{{- define "kv-epp.networkPeer" -}}
- podSelector:{{ if .podSelector }}{{ toYaml .podSelector | nindent 4 }}{{ else }} {}{{ end }}
  {{- if kindIs "map" .namespaceSelector }}
  namespaceSelector:{{ if .namespaceSelector }}{{ toYaml .namespaceSelector | nindent 4 }}{{ else }} {}{{ end }}
  {{- end }}
{{- end }}

{{/* A Secret holding one random value that survives upgrades: the live Secret's value is reused
when there is one (lookup sees nothing during a dry run or offline render, so a fresh value is
drawn there). Arguments: root, name, key, purpose. */}}
{{- define "kv-epp.generatedSecret" -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- $value := "" }}
{{- if and $live $live.data (hasKey $live.data .key) }}
{{- $value = index $live.data .key }}
{{- else }}
{{- $value = randAlphaNum 48 | b64enc }}
{{- end }}
# {{ .purpose }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kv-epp.labels" .root | nindent 4 }}
type: Opaque
data:
  {{ .key }}: {{ $value }}
{{- end }}
