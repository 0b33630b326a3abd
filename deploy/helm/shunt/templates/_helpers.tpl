{{/* The agent's service account: istiod trusts istio-system/ztunnel as a node proxy by default.
     Beside a stock ztunnel (proxy: ztunnel) that account is ztunnel's chart's: shunt keeps its own. */}}
{{- define "shunt.serviceAccountName" -}}
{{- if .Values.serviceAccountName }}{{ .Values.serviceAccountName }}{{ else if and .Values.istio.enabled (eq .Values.proxy "builtin") }}ztunnel{{ else }}shunt{{ end }}
{{- end }}

{{/* istiod's address, as ztunnel's chart computes it. */}}
{{- define "shunt.istiod" -}}
istiod{{ if .Values.revision }}-{{ .Values.revision }}{{ end }}.{{ .Values.istioNamespace }}.svc:15012
{{- end }}

{{/* hub/image:tag, image:tag without a hub, or image when it is a full reference.
     hub and tag fall back to global.hub and global.tag, as in Istio's charts. */}}
{{- define "shunt.image" -}}
{{- $hub := .Values.hub | default .Values.global.hub -}}
{{- $tag := .Values.tag | default .Values.global.tag -}}
{{- if contains "/" .Values.image }}{{ .Values.image }}{{ else if $hub }}{{ $hub }}/{{ .Values.image }}:{{ $tag }}{{ else }}{{ .Values.image }}:{{ $tag }}{{ end }}
{{- end }}

{{/* "on"/"off" for a value a values file may give as a YAML 1.1 boolean
     (`capture: off` reads as false): the agent takes only the words. */}}
{{- define "shunt.onOff" -}}
{{- if kindIs "bool" . }}{{ ternary "on" "off" . }}{{ else }}{{ . }}{{ end }}
{{- end }}
