{{/*
The templates use a small set of functions: Go's text/template built-ins,
Helm's include, required and fail, and sprig's default, dict, quote, toYaml,
nindent, trunc, trimSuffix, contains, replace, list, int and add. The chart's
offline test (deploy/chart_test.go) renders them with its own
implementation of exactly these; keep to them, or teach the test.
*/}}

{{- define "leasehold.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name. */}}
{{- define "leasehold.fullname" -}}
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

{{/* The version label: the image tag, as a label value allows it. */}}
{{- define "leasehold.version" -}}
{{- default .Chart.AppVersion .Values.image.tag | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "leasehold.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component: the part of the labels that selectors
use. Selectors are immutable on a Deployment, so nothing that changes
between releases (the version) is in them.
Call with (dict "ctx" $ "component" "worker").
*/}}
{{- define "leasehold.selectorLabels" -}}
app.kubernetes.io/name: {{ include "leasehold.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The recommended labels, on every object and pod of a component. */}}
{{- define "leasehold.labels" -}}
{{ include "leasehold.selectorLabels" . }}
app.kubernetes.io/version: {{ include "leasehold.version" .ctx | quote }}
app.kubernetes.io/part-of: {{ .ctx.Values.partOf }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "leasehold.bucket" -}}
{{- default (printf "%s-leases" .Values.nats.prefix) .Values.nats.bucket }}
{{- end }}

{{/*
The partition count, checked: 1 to 65536 (leasehold.MaxPartitions).
*/}}
{{- define "leasehold.partitions" -}}
{{- $p := int .Values.partitions }}
{{- if or (lt $p 1) (gt $p 65536) }}
{{- fail (printf "partitions %d: use 1 to 65536, the count `leasehold init` gives the job stream" $p) }}
{{- end }}
{{- $p }}
{{- end }}

{{/*
The connection flags every command takes.
*/}}
{{- define "leasehold.connectionArgs" -}}
- {{ printf "--prefix=%s" .Values.nats.prefix | quote }}
- {{ printf "--bucket=%s" (include "leasehold.bucket" .) | quote }}
{{- end }}

{{/*
The NATS environment of one role: the URL, and the credentials from the
role's Secret. Call with (dict "ctx" $ "role" "worker" "auth" .Values.worker.auth).
*/}}
{{- define "leasehold.natsEnv" -}}
{{- $a := .auth }}
{{- $secret := required (printf "%s.auth.existingSecret: name the Secret holding the %s's NATS credentials" .role .role) $a.existingSecret -}}
- name: NATS_URL
  value: {{ required "nats.url is required" .ctx.Values.nats.url | quote }}
{{- if eq $a.type "password" }}
- name: NATS_USER
  valueFrom:
    secretKeyRef:
      name: {{ $secret | quote }}
      key: {{ $a.userKey | quote }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret | quote }}
      key: {{ $a.passwordKey | quote }}
{{- else if eq $a.type "creds" }}
- name: NATS_CREDS
  value: {{ printf "/etc/leasehold/nats/%s" $a.credsKey | quote }}
{{- else }}
{{- fail (printf "%s.auth.type %q: use password or creds" .role $a.type) }}
{{- end }}
{{- with .ctx.Values.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/* The volume mount of a role's credentials file (auth.type creds). */}}
{{- define "leasehold.natsVolumeMount" -}}
- name: nats-credentials
  mountPath: /etc/leasehold/nats
  readOnly: true
{{- end }}

{{/* The volume of a role's credentials file (auth.type creds). */}}
{{- define "leasehold.natsVolume" -}}
- name: nats-credentials
  secret:
    secretName: {{ .auth.existingSecret | quote }}
    # Readable by the pod's group (fsGroup) only.
    defaultMode: 0440
    items:
      - key: {{ .auth.credsKey | quote }}
        path: {{ .auth.credsKey | quote }}
{{- end }}

{{/*
The pod security context every leasehold pod runs with: non-root, the
restricted Pod Security Standard.
*/}}
{{- define "leasehold.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "leasehold.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/*
/livez and /readyz on the --http port, with the timings of values.
Call with (dict "liveness" .Values.worker.livenessProbe "readiness" ...).
*/}}
{{- define "leasehold.probes" -}}
livenessProbe:
  httpGet:
    path: /livez
    port: http
  {{- toYaml .liveness | nindent 2 }}
readinessProbe:
  httpGet:
    path: /readyz
    port: http
  {{- toYaml .readiness | nindent 2 }}
{{- end }}
