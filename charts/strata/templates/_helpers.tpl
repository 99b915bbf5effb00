{{/*
strata.fit: the one place names are cut. Kubernetes object names, label values and DNS labels stop at 63
characters; every name in this chart goes through here.
*/}}
{{- define "strata.fit" -}}
{{- . | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.name" -}}
{{- include "strata.fit" (default .Chart.Name .Values.nameOverride) -}}
{{- end -}}

{{/* <release>-<chart>, or the release name alone when it already holds the chart name. */}}
{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- include "strata.fit" .Values.fullnameOverride -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- include "strata.fit" .Release.Name -}}
{{- else -}}
{{- include "strata.fit" (printf "%s-%s" .Release.Name $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator's objects: <fullname>-operator, cut to 63 characters. */}}
{{- define "strata.operator.fullname" -}}
{{- include "strata.fit" (printf "%s-operator" (include "strata.fullname" .)) -}}
{{- end -}}

{{- define "strata.labels" -}}
helm.sh/chart: {{ include "strata.fit" (printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_") }}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ include "strata.fit" .Release.Name }}
app.kubernetes.io/version: {{ include "strata.fit" .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: strata
{{- end -}}

{{- define "strata.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ include "strata.fit" .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "strata.operator.labels" -}}
{{ include "strata.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "strata.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- include "strata.fit" (default (include "strata.operator.fullname" .) .Values.serviceAccount.name) -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "strata.leaseName" -}}
{{- include "strata.fit" (default (include "strata.operator.fullname" .) .Values.operator.leaseName) -}}
{{- end -}}

{{- define "strata.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{/* Stage and gateway pods need the GPU build: the CUDA variant of the same tag unless set explicitly. */}}
{{- define "strata.workloadImage" -}}
{{- if .Values.operator.workloadImage -}}
{{ .Values.operator.workloadImage }}
{{- else -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}-cuda
{{- end -}}
{{- end -}}

{{/*
strata.operator.rules: what the operator does inside a watched namespace (or every namespace, in a ClusterRole),
and no more: children are written with server-side apply, which needs `create` for an object that does not exist
yet and `patch` otherwise; the children it watches are stage StatefulSets (a new plan generation replaces the old:
the only kind it deletes), the gateway Deployment and the coordinator Lease (readiness). In cluster-wide mode a read of ConfigMaps or Services
would reach every namespace, so none is granted. Extend this list together with the reconciler.
*/}}
{{- define "strata.operator.rules" -}}
- apiGroups: ["strata.dev"]
  resources: ["modeldeployments"]
  # kopf watches them and patches its own annotations on them.
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["strata.dev"]
  resources: ["modeldeployments/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["events"]
  # get: an Event written before a restart is found again and its count continues (strata.operator.events).
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["create", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The operator watches its gateway Deployments and coordinator Leases (labelled app.kubernetes.io/name=strata)
# instead of reading them on a timer.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["ingresses", "networkpolicies"]
  verbs: ["create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch"]
# Each deployment's gateway gets a ServiceAccount and a Role for its coordinator Lease, which the operator creates
# (create, then patch: server-side apply). The API server lets the operator grant only what it holds itself, so it
# holds get/update on leases here too; get also reads the coordinator's holder and term into status.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "patch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch", "update", "create", "patch"]
{{- with .Values.operator.secretNames }}
- apiGroups: [""]
  resources: ["secrets"]
  # Only the model tokens listed in operator.secretNames; an empty resourceNames would mean every Secret.
  resourceNames: {{ toJson . }}
  verbs: ["get"]
{{- end }}
{{- end -}}
