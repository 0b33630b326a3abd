{{/* The agent's service account: istiod trusts istio-system/ztunnel as a node proxy by default. */}}
{{- define "shunt.serviceAccountName" -}}
{{- if .Values.serviceAccountName }}{{ .Values.serviceAccountName }}{{ else if .Values.istio.enabled }}ztunnel{{ else }}shunt{{ end }}
{{- end }}

{{/* istiod's address, as ztunnel's chart computes it. */}}
{{- define "shunt.istiod" -}}
istiod{{ if .Values.revision }}-{{ .Values.revision }}{{ end }}.{{ .Values.istioNamespace }}.svc:15012
{{- end }}

{{/* hub/image:tag, image:tag without a hub, or image when it is a full reference. */}}
{{- define "shunt.image" -}}
{{- if contains "/" .Values.image }}{{ .Values.image }}{{ else if .Values.hub }}{{ .Values.hub }}/{{ .Values.image }}:{{ .Values.tag }}{{ else }}{{ .Values.image }}:{{ .Values.tag }}{{ end }}
{{- end }}
