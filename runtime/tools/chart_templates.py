"""The Helm chart's fixed text: Chart.yaml and the templates `kiln deploy` writes.

Everything the plan decides is a value (runtime/tools/deploy.py default_values); these
templates only place values. Probe layout, gRPC health (grpc.health.v1, served by kiln serve):

    startupProbe    service ""  SERVING once the plan is loaded and verified; its budget is
                    probes.startupSeconds (sized from the plan's bytes), so a loading server
                    is never restarted; liveness and readiness start only after it passes
    readinessProbe  KServe service: NOT_SERVING while loading and while draining (SIGTERM)
    livenessProbe   service "": fails only after drainSeconds + 20 s of NOT_SERVING, so a
                    drain is never cut short; an engine that died is restarted after that
"""
from __future__ import annotations


def chart_yaml(name: str, version: str) -> str:
    return (f"apiVersion: v2\nname: {name}\ndescription: Kiln serving one plan (kiln serve), "
            f"sized from its manifest\ntype: application\nversion: {version}\n"
            f"appVersion: \"{version}\"\nicon: https://kubernetes.io/images/favicon.png\n")


HELPERS = """{{- define "kiln.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "kiln.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "kiln.labels" -}}
{{ include "kiln.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}
{{- define "kiln.planPath" -}}
{{- if .Values.plan.image -}}/oci/models/{{ .Values.plan.name }}{{- else -}}/models/{{ .Values.plan.name }}{{- end -}}
{{- end -}}
{{- define "kiln.args" -}}
- serve
- {{ include "kiln.planPath" . }}
{{ include "kiln.flags" . }}
{{- end -}}
{{- define "kiln.flags" -}}
- --host=0.0.0.0
- --port={{ .Values.ports.grpc }}
- --metrics-host=0.0.0.0
- --metrics-port={{ .Values.ports.metrics }}
- --model-name={{ .Values.modelName }}
- --threads={{ .Values.threads }}
- --drain-seconds={{ .Values.drainSeconds }}
{{- if .Values.plan.digest }}
- --expect-digest={{ .Values.plan.digest }}
{{- end }}
{{- if .Values.openai.enabled }}
- --http-port={{ .Values.ports.http }}
{{- end }}
{{- end -}}
{{- define "kiln.resources" -}}
requests:
  cpu: {{ .Values.threads | quote }}
  memory: {{ .Values.resources.memory | quote }}
limits:
  cpu: {{ .Values.threads | quote }}
  memory: {{ .Values.resources.memory | quote }}
{{- end -}}
"""

DEPLOYMENT = """{{- if and .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled }}
{{- fail "autoscaling: enable the HPA or the KEDA ScaledObject, not both" }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "kiln.fullname" . }}
  labels:
    {{- include "kiln.labels" . | nindent 4 }}
spec:
  {{- if not (or .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled) }}
  replicas: {{ .Values.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "kiln.selector" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kiln.selector" . | nindent 8 }}
      annotations:
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ .Values.ports.metrics | quote }}
        prometheus.io/path: /metrics
    spec:
      # the drain (in-flight requests finish after SIGTERM) plus time to exit
      terminationGracePeriodSeconds: {{ add .Values.drainSeconds 15 }}
      securityContext:
        runAsNonRoot: true
        runAsUser: 1000
        runAsGroup: 1000
      containers:
        - name: kiln
          image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          command: ["kiln"]
          args:
            {{- include "kiln.args" . | nindent 12 }}
          env:
            - name: OMP_NUM_THREADS
              value: {{ .Values.threads | quote }}
            - name: HOME    # caches (torch, triton) go to the writable emptyDir
              value: /tmp
          ports:
            - name: h2c
              containerPort: {{ .Values.ports.grpc }}
              protocol: TCP
            - name: metrics
              containerPort: {{ .Values.ports.metrics }}
              protocol: TCP
            {{- if .Values.openai.enabled }}
            - name: http
              containerPort: {{ .Values.ports.http }}
              protocol: TCP
            {{- end }}
          startupProbe:
            grpc:
              port: {{ .Values.ports.grpc }}
              service: ""
            periodSeconds: {{ .Values.probes.periodSeconds }}
            failureThreshold: {{ add1 (div .Values.probes.startupSeconds .Values.probes.periodSeconds) }}
          readinessProbe:
            grpc:
              port: {{ .Values.ports.grpc }}
              service: inference.GRPCInferenceService
            periodSeconds: {{ .Values.probes.periodSeconds }}
            failureThreshold: 1
          livenessProbe:
            grpc:
              port: {{ .Values.ports.grpc }}
              service: ""
            periodSeconds: 10
            failureThreshold: {{ add 2 (div .Values.drainSeconds 10) }}
          resources:
            {{- include "kiln.resources" . | nindent 12 }}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
          volumeMounts:
            - name: plan
              mountPath: {{ if .Values.plan.image }}/oci{{ else }}/models{{ end }}
              readOnly: true
            - name: tmp
              mountPath: /tmp
      volumes:
        - name: plan
          {{- if .Values.plan.image }}
          image:
            reference: {{ .Values.plan.image | quote }}
            pullPolicy: IfNotPresent
          {{- else }}
          persistentVolumeClaim:
            claimName: {{ .Values.plan.pvc | quote }}
            readOnly: true
          {{- end }}
        - name: tmp
          emptyDir: {}
"""

SERVICE = """apiVersion: v1
kind: Service
metadata:
  name: {{ include "kiln.fullname" . }}
  labels:
    {{- include "kiln.labels" . | nindent 4 }}
  annotations:
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.ports.metrics | quote }}
spec:
  selector:
    {{- include "kiln.selector" . | nindent 4 }}
  ports:
    - name: h2c
      port: {{ .Values.ports.grpc }}
      targetPort: h2c
      appProtocol: kubernetes.io/h2c
    - name: metrics
      port: {{ .Values.ports.metrics }}
      targetPort: metrics
    {{- if .Values.openai.enabled }}
    - name: http
      port: {{ .Values.ports.http }}
      targetPort: http
    {{- end }}
"""

PDB = """apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kiln.fullname" . }}
  labels:
    {{- include "kiln.labels" . | nindent 4 }}
spec:
  minAvailable: {{ .Values.podDisruptionBudget.minAvailable }}
  selector:
    matchLabels:
      {{- include "kiln.selector" . | nindent 6 }}
"""

HPA = """{{- if .Values.autoscaling.hpa.enabled }}
# Scales on requests waiting per pod (kiln_queue_length, exposed to the HPA by the
# Prometheus adapter as a pods metric), not on CPU: a full batch keeps CPU high at any load.
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "kiln.fullname" . }}
  labels:
    {{- include "kiln.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "kiln.fullname" . }}
  minReplicas: {{ .Values.autoscaling.minReplicas }}
  maxReplicas: {{ .Values.autoscaling.maxReplicas }}
  metrics:
    - type: Pods
      pods:
        metric:
          name: {{ .Values.inferenceExtension.queueMetric }}
        target:
          type: AverageValue
          averageValue: {{ .Values.autoscaling.queueLengthTarget | quote }}
  behavior:
    scaleDown:
      stabilizationWindowSeconds: 300
{{- end }}
"""

KEDA = """{{- if .Values.autoscaling.keda.enabled }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "kiln.fullname" . }}
  labels:
    {{- include "kiln.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    name: {{ include "kiln.fullname" . }}
  minReplicaCount: {{ .Values.autoscaling.minReplicas }}
  maxReplicaCount: {{ .Values.autoscaling.maxReplicas }}
  triggers:
    - type: prometheus
      metadata:
        serverAddress: {{ .Values.autoscaling.keda.prometheusAddress | quote }}
        query: sum({{ .Values.inferenceExtension.queueMetric }}{app_kubernetes_io_instance="{{ .Release.Name }}"})
        threshold: {{ .Values.autoscaling.queueLengthTarget | quote }}
{{- end }}
"""

KSERVE = """{{- if .Values.kserve.enabled }}
apiVersion: serving.kserve.io/v1alpha1
kind: ServingRuntime
metadata:
  name: {{ include "kiln.fullname" . }}
  labels:
    {{- include "kiln.labels" . | nindent 4 }}
spec:
  supportedModelFormats:
    - name: kiln-plan
      version: "1"
      autoSelect: true
  protocolVersions:
    - v2
    - grpc-v2
  containers:
    - name: kserve-container
      image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
      command: ["kiln"]
      args:
        - serve
        - /mnt/models/{{ .Values.plan.name }}
        {{- include "kiln.flags" . | nindent 8 }}
      env:
        - name: OMP_NUM_THREADS
          value: {{ .Values.threads | quote }}
      ports:
        - name: h2c
          containerPort: {{ .Values.ports.grpc }}
          protocol: TCP
      resources:
        {{- include "kiln.resources" . | nindent 8 }}
---
# The modelcar form: storageUri oci://<registry>/<repo>@sha256:<digest of kiln package
# --modelcar, whose busybox layer runs KServe's sidecar shell>; the image's /models/<name>
# appears at /mnt/models/<name>.
apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata:
  name: {{ .Values.modelName }}
  annotations:
    serving.kserve.io/enable-prometheus-scraping: "true"
spec:
  predictor:
    model:
      modelFormat:
        name: kiln-plan
      runtime: {{ include "kiln.fullname" . }}
      {{- $image := .Values.plan.image | default "registry.example/kiln-plans/PLAN@sha256:DIGEST" }}
      storageUri: {{ $image | trimPrefix "oci://" | printf "oci://%s" | quote }}
{{- end }}
"""

TEMPLATES = {"_helpers.tpl": HELPERS, "deployment.yaml": DEPLOYMENT, "service.yaml": SERVICE,
             "pdb.yaml": PDB, "hpa.yaml": HPA, "keda-scaledobject.yaml": KEDA,
             "kserve.yaml": KSERVE}
