{{/* Names ---------------------------------------------------------------------------- */}}
{{- define "flywheel.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-wide prefix; short enough that "<prefix>-rollout-headless" fits 63 chars. */}}
{{- define "flywheel.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "flywheel.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<fullname>-<component>"; call with (dict "root" $ "component" "buffer"). */}}
{{- define "flywheel.componentName" -}}
{{- printf "%s-%s" (include "flywheel.fullname" .root) .component -}}
{{- end -}}

{{/* Labels -------------------------------------------------------------------------- */}}
{{- define "flywheel.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flywheel.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "flywheel.labels" -}}
helm.sh/chart: {{ include "flywheel.chart" .root }}
{{ include "flywheel.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: flywheel
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Images -------------------------------------------------------------------------- */}}
{{- define "flywheel.image" -}}
{{- $root := .root -}}
{{- $img := .image | default dict -}}
{{- $repo := default $root.Values.image.repository $img.repository -}}
{{- $tag := default (default $root.Chart.AppVersion $root.Values.image.tag) $img.tag -}}
{{- /* A digest pins the image by content: "<repo>@sha256:<hex>". */ -}}
{{- printf (ternary "%s@%s" "%s:%s" (hasPrefix "sha256:" $tag)) $repo $tag -}}
{{- end -}}

{{/* Secrets ------------------------------------------------------------------------- */}}
{{- define "flywheel.redisSecretName" -}}
{{- if .Values.redis.enabled -}}
{{- default (printf "%s-redis" (include "flywheel.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- else -}}
{{- default (printf "%s-redis" (include "flywheel.fullname" .)) .Values.externalRedis.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "flywheel.redisSecretKey" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.existingSecretPasswordKey -}}
{{- else -}}
{{- .Values.externalRedis.existingSecretPasswordKey -}}
{{- end -}}
{{- end -}}

{{/* True when the buffer gets a Redis password at all. */}}
{{- define "flywheel.redisHasPassword" -}}
{{- if or .Values.redis.enabled .Values.externalRedis.password .Values.externalRedis.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "flywheel.tokenSecretName" -}}
{{- default (printf "%s-token" (include "flywheel.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* A generated secret value that survives upgrades: the value given, else what the
     cluster holds (`lookup`), else a new random one, generated once per render so that
     the Secret and every pod's checksum of it agree. Without a cluster (`helm template`,
     GitOps) `lookup` finds nothing and each render generates new values: give them
     (auth.token, redis.auth.password) or use existingSecret there. */}}
{{- define "flywheel.secretValue" -}}
{{- $cache := get .root "flywheelGeneratedSecrets" | default dict -}}
{{- $_ := set .root "flywheelGeneratedSecrets" $cache -}}
{{- $slot := printf "%s/%s" .name .key -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if .value -}}
{{- .value -}}
{{- else if and $existing $existing.data (index $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- if not (hasKey $cache $slot) -}}
{{- $_ := set $cache $slot (randAlphaNum 32) -}}
{{- end -}}
{{- index $cache $slot -}}
{{- end -}}
{{- end -}}

{{/* Addresses ----------------------------------------------------------------------- */}}
{{- define "flywheel.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "flywheel.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s:6379/0" (include "flywheel.fullname" .) (include "flywheel.svcDomain" .) -}}
{{- else -}}
{{- required "externalRedis.url is required when redis.enabled is false" .Values.externalRedis.url -}}
{{- end -}}
{{- end -}}

{{- define "flywheel.rolloutReplicas" -}}
{{- if .Values.rollout.autoscaling.enabled -}}
{{- .Values.rollout.autoscaling.maxReplicas -}}
{{- else -}}
{{- .Values.rollout.replicaCount -}}
{{- end -}}
{{- end -}}

{{/* Replica i of the rollout StatefulSet is pod "<fullname>-rollout-i" behind the headless
     Service; callers replace "{i}" with the replica index (services.rollout.replica_host). */}}
{{- define "flywheel.rolloutHost" -}}
{{- $full := include "flywheel.fullname" . -}}
{{- printf "%s-rollout-{i}.%s-rollout-headless.%s" $full $full (include "flywheel.svcDomain" .) -}}
{{- end -}}

{{/* Pod annotations that roll a pod when what it reads changes: the ConfigMap and the
     Secrets (tokens, Redis password), so no pod keeps an old token after a change. */}}
{{- define "flywheel.checksums" -}}
checksum/config: {{ include "flywheel.config" . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secrets.yaml") . | sha256sum }}
{{- end -}}

{{/* A short hash of the release's values, app version and Secrets. A Job's pod template
     cannot be changed in place, so the prepare Job carries it in its name: an upgrade that
     changes any of them replaces the Job, one that changes nothing keeps it. The trainer
     Job is named by the hash of its own spec (`flywheel.trainerJobSpec`), so only what its
     pods run replaces it (it resumes from its checkpoint; a completed run stays completed). */}}
{{- define "flywheel.revisionHash" -}}
{{- $secrets := include (print .Template.BasePath "/secrets.yaml") . | sha256sum -}}
{{- printf "%s|%s|%s" (toYaml .Values) .Chart.AppVersion $secrets | sha256sum | trunc 6 -}}
{{- end -}}

{{- define "flywheel.trainerJobName" -}}
{{- printf "%s-trainer-%s" (include "flywheel.fullname" .) (include "flywheel.trainerJobSpec" . | sha256sum | trunc 6) -}}
{{- end -}}

{{/* The trainer's pod 0 (rank 0, the rendezvous, the gRPC service) by a name that is the
     same in every revision: the Service "<fullname>-trainer-0" selects the current Job's
     pod of completion index 0 (labels Kubernetes puts on the pods of an Indexed Job).
     The shared ConfigMap names only this Service, so an upgrade that replaces the Job
     changes no other pod. */}}
{{- define "flywheel.trainerMasterService" -}}
{{- printf "%s-trainer-0" (include "flywheel.fullname" .) -}}
{{- end -}}

{{- define "flywheel.trainerMaster" -}}
{{- printf "%s.%s" (include "flywheel.trainerMasterService" .) (include "flywheel.svcDomain" .) -}}
{{- end -}}

{{/* The demo: no `config.actor.path` given. A prepare Job writes the tiny model (with its
     supervised warm start) and the built-in arithmetic data onto the shared volume, as the
     local launcher and compose's `prepare` do, and the run takes the demo's configuration
     (files/demo.yaml, a copy of examples/demo.yaml); without `demo.enabled` the install
     fails here, saying what to set. */}}
{{- define "flywheel.demo" -}}
{{- if not (dig "actor" "path" "" .Values.config) -}}
{{- if not .Values.demo.enabled -}}
{{- fail "config.actor.path is empty: set it to a Hugging Face model directory on the shared volume (e.g. --set config.actor.path=/data/shared/models/Qwen2.5-1.5B-Instruct, copied there beforehand), or set demo.enabled=true to train the tiny demo model" -}}
{{- end -}}
{{- if not .Values.sharedStorage.enabled -}}
{{- fail "demo.enabled writes the demo model onto the shared volume: set sharedStorage.enabled=true, or config.actor.path to a model every pod can read" -}}
{{- end -}}
true
{{- else if and (not (dig "train_dataset" "path" "" .Values.config)) (not .Values.demo.enabled) -}}
{{- fail "config.train_dataset.path is empty: set it to a JSONL or parquet file of prompts on the shared volume (e.g. --set config.train_dataset.path=/data/shared/data/train.jsonl), or set demo.enabled=true to write the built-in arithmetic data there" -}}
{{- end -}}
{{- end -}}

{{/* The run's own configuration, as YAML: the demo's (files/demo.yaml, less the keys the
     chart owns) when the demo runs, with the user's `config` merged over it. */}}
{{- define "flywheel.userConfig" -}}
{{- $base := dict -}}
{{- if include "flywheel.demo" . -}}
{{- $base = .Files.Get "files/demo.yaml" | fromYaml -}}
{{- $_ := unset $base "cluster" -}}
{{- end -}}
{{- include "flywheel.deepMerge" (dict "dst" $base "src" (deepCopy .Values.config)) -}}
{{- toYaml $base -}}
{{- end -}}

{{/* Merge `src` into `dst` (in place), `src` winning everywhere: false, 0 and null too
     (Sprig's mergeOverwrite keeps the old value for those, so `max_head_offpolicyness: 0`
     or `valid_dataset: null` would not reach the run). Call with (dict "dst" . "src" .). */}}
{{- define "flywheel.deepMerge" -}}
{{- $dst := .dst -}}
{{- range $k, $v := .src -}}
{{- if and (kindIs "map" $v) (kindIs "map" (get $dst $k)) -}}
{{- include "flywheel.deepMerge" (dict "dst" (get $dst $k) "src" $v) -}}
{{- else -}}
{{- $_ := set $dst $k $v -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* True when a prepare Job runs: the demo model, or the built-in data set (no
     `config.train_dataset.path`) under demo.enabled. */}}
{{- define "flywheel.prepare" -}}
{{- if or (include "flywheel.demo" .) (and .Values.demo.enabled (not (dig "train_dataset" "path" "" .Values.config))) -}}true{{- end -}}
{{- end -}}

{{/* The run directory `<cluster.fileroot>/<experiment_name>/<trial_name>` on the shared volume. */}}
{{- define "flywheel.runDir" -}}
{{- $cfg := include "flywheel.userConfig" . | fromYaml -}}
{{- printf "%s/%s/%s" (trimSuffix "/" .Values.sharedStorage.mountPath) (dig "experiment_name" "flywheel" $cfg) (dig "trial_name" "trial0" $cfg) -}}
{{- end -}}

{{/* Written by the prepare Job last, once model and data are in place. */}}
{{- define "flywheel.preparedMarker" -}}
{{- printf "%s/prepared.yaml" (include "flywheel.runDir" .) -}}
{{- end -}}

{{/* Where prepare writes the demo model: the warm-started copy unless the warm start is off. */}}
{{- define "flywheel.demoModelPath" -}}
{{- $cfg := include "flywheel.userConfig" . | fromYaml -}}
{{- $ws := dig "launcher" "warm_start" dict $cfg -}}
{{- $on := and (ne (toString (dig "enabled" true $ws)) "false") (gt (int (dig "steps" 220 $ws)) 0) -}}
{{- printf "%s/model/%s" (include "flywheel.runDir" .) (ternary "sft" "base" $on) -}}
{{- end -}}

{{/* Init container of rollout and trainer pods while a prepare Job runs: wait for it. */}}
{{- define "flywheel.waitForPrepare" -}}
{{- if include "flywheel.prepare" . }}
initContainers:
  - name: wait-for-prepare
    image: {{ include "flywheel.image" (dict "root" . "image" dict) | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["python", "-c", "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(2)", {{ include "flywheel.preparedMarker" . | quote }}]
    resources:
      requests: {cpu: 10m, memory: 32Mi}
    securityContext:
      {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      {{- include "flywheel.sharedVolumeMount" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* What the chart owns in the configuration: the topology of its own objects (addresses,
     ports, the Redis URL, the rendezvous, ranks and replicas, the file root on the shared
     volume). Rendered as YAML; nothing in it depends on the revision, so a values change
     that leaves the topology alone leaves the ConfigMap, and every service pod, alone. */}}
{{- define "flywheel.ownedConfig" -}}
{{- $full := include "flywheel.fullname" . -}}
{{- $domain := include "flywheel.svcDomain" . -}}
{{- $owned := dict
  "cluster" (dict "fileroot" .Values.sharedStorage.mountPath)
  "buffer" (dict "redis_url" (include "flywheel.redisUrl" .))
  "rollout" (dict "n_replicas" (int (include "flywheel.rolloutReplicas" .)))
  "trainer" (dict
      "n_ranks" (mul .Values.trainer.nodes .Values.trainer.nprocPerNode)
      "backend" .Values.trainer.backend
      "weight_transport" (ternary "disk" .Values.trainer.weightTransport .Values.rollout.autoscaling.enabled)
      "master_addr" (include "flywheel.trainerMaster" .)
      "master_port" (int .Values.trainer.rendezvousPort))
  "services" (dict
      "buffer" (dict "host" (printf "%s-buffer.%s" $full $domain) "port" (int .Values.buffer.ports.grpc) "metrics_port" (int .Values.buffer.ports.metrics))
      "reward" (dict "host" (printf "%s-reward.%s" $full $domain) "port" (int .Values.reward.ports.grpc) "metrics_port" (int .Values.reward.ports.metrics))
      "rollout" (dict "host" (include "flywheel.rolloutHost" .) "port" (int .Values.rollout.ports.grpc) "metrics_port" (int .Values.rollout.ports.metrics) "port_stride" 0)
      "trainer" (dict "host" (include "flywheel.trainerMaster" .) "port" (int .Values.trainer.ports.grpc) "metrics_port" (int .Values.trainer.ports.metrics)))
-}}
{{- if .Values.rollout.sglang.enabled -}}
{{- $_ := set $owned.rollout "engine" "sglang" -}}
{{- $_ := set $owned.rollout "sglang" (dict "url" (printf "http://127.0.0.1:%d" (int .Values.rollout.sglang.port))) -}}
{{- end -}}
{{- toYaml $owned -}}
{{- end -}}

{{/* The chart value to set instead of each owned key of `config`. */}}
{{- define "flywheel.ownedBy" -}}
cluster.fileroot: sharedStorage.mountPath
buffer.redis_url: redis.enabled / externalRedis.url
rollout.n_replicas: rollout.replicaCount (rollout.autoscaling.maxReplicas when autoscaling)
rollout.engine: rollout.sglang.enabled
rollout.sglang.url: rollout.sglang.port
trainer.n_ranks: trainer.nodes x trainer.nprocPerNode
trainer.backend: trainer.backend
trainer.weight_transport: trainer.weightTransport (disk when rollout.autoscaling.enabled)
trainer.master_addr: the release name (the Service <release>-trainer-0)
trainer.master_port: trainer.rendezvousPort
services.*.host: the release name and namespace (each service binds 0.0.0.0 in its pod)
services.*.port: <service>.ports.grpc
services.*.metrics_port: <service>.ports.metrics
services.*.port_stride: nothing (every rollout replica is its own pod, on the same ports)
{{- end -}}

{{/* Refuse, at render time, a `config` that sets an owned key to another value than the
     chart's: the pods would disagree with the objects around them (a trainer whose
     n_ranks is not its pods' ranks exits 2 at start). Null counts as unset. */}}
{{- define "flywheel.checkOwned" -}}
{{- $owned := include "flywheel.ownedConfig" . | fromYaml -}}
{{- $by := include "flywheel.ownedBy" . | fromYaml -}}
{{- $user := .Values.config -}}
{{- range $block, $keys := $owned -}}
{{- range $key, $want := $keys -}}
{{- if eq $block "services" -}}
{{- range $field, $w := $want -}}
{{- $given := dig $block $key $field nil $user -}}
{{- if and (not (kindIs "invalid" $given)) (ne (toString $given) (toString $w)) -}}
{{- fail (printf "config.%s.%s.%s=%v: the chart sets it to %v; set %s instead, and leave it out of config" $block $key $field $given $w (index $by (printf "services.*.%s" $field))) -}}
{{- end -}}
{{- end -}}
{{- else if kindIs "map" $want -}}
{{- range $field, $w := $want -}}
{{- $given := dig $block $key $field nil $user -}}
{{- if and (not (kindIs "invalid" $given)) (ne (toString $given) (toString $w)) -}}
{{- fail (printf "config.%s.%s.%s=%v: the chart sets it to %v; set %s instead, and leave it out of config" $block $key $field $given $w (index $by (printf "%s.%s.%s" $block $key $field))) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $given := dig $block $key nil $user -}}
{{- if and (not (kindIs "invalid" $given)) (ne (toString $given) (toString $want)) -}}
{{- fail (printf "config.%s.%s=%v: the chart sets it to %v; set %s instead, and leave it out of config" $block $key $given $want (index $by (printf "%s.%s" $block $key))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Flywheel configuration every service reads: the run's own configuration
     (`flywheel.userConfig`), defaults the chart derives where it leaves a key unset (the
     device, where weights are published, the demo's model and data), and what the chart
     owns over both. */}}
{{- define "flywheel.config" -}}
{{- include "flywheel.checkOwned" . -}}
{{- $user := include "flywheel.userConfig" . | fromYaml -}}
{{- $mount := trimSuffix "/" .Values.sharedStorage.mountPath -}}
{{- $defaults := dict
  "trainer" (dict
      "device" (ternary "cuda" "auto" (eq .Values.trainer.backend "nccl"))
      "weight_dir" (printf "%s/weights" (include "flywheel.runDir" .)))
-}}
{{- $weights := dig "trainer" "weight_dir" "" $user -}}
{{- if and $weights (not (hasPrefix (printf "%s/" $mount) $weights)) -}}
{{- fail (printf "config.trainer.weight_dir=%s is not on the shared volume (%s): a restarted rollout replica loads the newest published weights from there; leave it unset (%s/weights) or put it under %s" $weights $mount (include "flywheel.runDir" .) $mount) -}}
{{- end -}}
{{- if include "flywheel.demo" . -}}
{{- $model := include "flywheel.demoModelPath" . -}}
{{- $_ := set $defaults "actor" (dict "path" $model) -}}
{{- $_ := set $defaults "tokenizer_path" $model -}}
{{- end -}}
{{- if include "flywheel.prepare" . -}}
{{- $_ := set $defaults "train_dataset" (dict "path" (printf "%s/data/train.jsonl" (include "flywheel.runDir" .))) -}}
{{- $valid := get $user "valid_dataset" -}}
{{- if and (kindIs "map" $valid) (not (get $valid "path")) -}}
{{- $_ := set $defaults "valid_dataset" (dict "path" (printf "%s/data/valid.jsonl" (include "flywheel.runDir" .))) -}}
{{- end -}}
{{- end -}}
{{- /* Defaults fill what the run leaves unset or null; the owned keys are kept over both. */ -}}
{{- $cfg := mustMerge $user $defaults -}}
{{- toYaml (mustMerge (include "flywheel.ownedConfig" . | fromYaml) $cfg) -}}
{{- end -}}

{{/* Pod pieces ---------------------------------------------------------------------- */}}

{{/* Environment every Flywheel container gets: secrets, never in args or the ConfigMap.
     Call with (dict "root" $ "component" "buffer"). With per-service credentials every
     server gets the digests of the callers' tokens (FLYWHEEL_CREDENTIALS) and only the
     callers get a token, their own role's (FLYWHEEL_TOKEN): rollout and trainer; the
     buffer and reward dial no Flywheel service and hold no token at all. */}}
{{- define "flywheel.commonEnv" -}}
{{- $root := .root -}}
- name: FLYWHEEL_CONFIG
  value: /etc/flywheel/flywheel.yaml
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if $root.Values.auth.enabled }}
{{- if $root.Values.auth.perService }}
- name: FLYWHEEL_CREDENTIALS
  valueFrom:
    secretKeyRef:
      name: {{ include "flywheel.tokenSecretName" $root }}
      key: credentials
{{- if has .component (list "rollout" "trainer") }}
- name: FLYWHEEL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "flywheel.tokenSecretName" $root }}
      key: {{ .component }}
{{- end }}
{{- else }}
- name: FLYWHEEL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "flywheel.tokenSecretName" $root }}
      key: {{ $root.Values.auth.existingSecretKey }}
{{- end }}
{{- end }}
{{- if $root.Values.tls.enabled }}
- name: FLYWHEEL_TLS_CERT
  value: {{ printf "%s/tls.crt" $root.Values.tls.mountPath }}
- name: FLYWHEEL_TLS_KEY
  value: {{ printf "%s/tls.key" $root.Values.tls.mountPath }}
- name: FLYWHEEL_TLS_CA
  value: {{ printf "%s/ca.crt" $root.Values.tls.mountPath }}
{{- if $root.Values.tls.requireClientCert }}
- name: FLYWHEEL_TLS_REQUIRE_CLIENT_CERT
  value: "1"
{{- end }}
{{- with $root.Values.tls.serverName }}
- name: FLYWHEEL_TLS_SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secret with tls.crt, tls.key and ca.crt. */}}
{{- define "flywheel.tlsSecretName" -}}
{{- if .Values.tls.existingSecret -}}
{{- .Values.tls.existingSecret -}}
{{- else if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "flywheel.fullname" .) -}}
{{- else -}}
{{- fail "tls.enabled needs tls.existingSecret (a Secret with tls.crt, tls.key, ca.crt) or tls.certManager.enabled" -}}
{{- end -}}
{{- end -}}

{{/* Probes: startup and readiness are native gRPC health checks of the service; liveness
     is HTTP /healthz, because a service is deliberately NOT_SERVING while it drains or
     applies new weights, and that must take it out of the Service, not restart it.
     Call with (dict "probes" .Values.X.probes "ports" .Values.X.ports "service" "flywheel.v1.XService"). */}}
{{- define "flywheel.probes" -}}
{{- if .probes.startup.enabled }}
startupProbe:
  {{- if .tls }}
  httpGet:
    path: /readyz
    port: metrics
  {{- else }}
  grpc:
    port: {{ .ports.grpc }}
    service: {{ .service }}
  {{- end }}
  periodSeconds: {{ .probes.startup.periodSeconds }}
  failureThreshold: {{ .probes.startup.failureThreshold }}
  timeoutSeconds: 3
{{- end }}
{{- if .probes.readiness.enabled }}
readinessProbe:
  {{- if .tls }}
  httpGet:
    path: /readyz
    port: metrics
  {{- else }}
  grpc:
    port: {{ .ports.grpc }}
    service: {{ .service }}
  {{- end }}
  periodSeconds: {{ .probes.readiness.periodSeconds }}
  failureThreshold: {{ .probes.readiness.failureThreshold }}
  timeoutSeconds: 3
{{- end }}
{{- if .probes.liveness.enabled }}
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: {{ .probes.liveness.periodSeconds }}
  failureThreshold: {{ .probes.liveness.failureThreshold }}
  timeoutSeconds: 3
{{- end }}
{{- end -}}

{{- define "flywheel.ports" -}}
ports:
  - name: grpc
    containerPort: {{ .grpc }}
    protocol: TCP
  - name: metrics
    containerPort: {{ .metrics }}
    protocol: TCP
{{- end -}}

{{/* Volumes of every Flywheel pod: the config, a writable /tmp (root fs is read-only). */}}
{{- define "flywheel.baseVolumes" -}}
- name: config
  configMap:
    name: {{ include "flywheel.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "flywheel.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "flywheel.baseVolumeMounts" -}}
- name: config
  mountPath: /etc/flywheel
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "flywheel.sharedVolume" -}}
{{- if .Values.sharedStorage.enabled }}
- name: shared
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-shared" (include "flywheel.fullname" .)) .Values.sharedStorage.existingClaim }}
{{- end }}
{{- end -}}

{{- define "flywheel.sharedVolumeMount" -}}
{{- if .Values.sharedStorage.enabled }}
- name: shared
  mountPath: {{ .Values.sharedStorage.mountPath }}
{{- end }}
{{- end -}}

{{- define "flywheel.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "flywheel.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Pod-level settings shared by every Flywheel pod. Call with (dict "root" $ "svc" .Values.X). */}}
{{- define "flywheel.podCommon" -}}
serviceAccountName: {{ include "flywheel.serviceAccountName" .root }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with .svc.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .svc.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .svc.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The container of one Flywheel service. Call with (dict "root" $ "component" "buffer"
     "svc" .Values.buffer "grpcService" "flywheel.v1.BufferService" "command" (list ...)
     "extraArgs" (list ...) "extraEnv" "<yaml>" "extraMounts" "<yaml>"). The service binds
     0.0.0.0 in its own pod; everyone else dials the name written in the ConfigMap. */}}
{{- define "flywheel.serviceContainer" -}}
{{- $root := .root -}}
- name: {{ .component }}
  image: {{ include "flywheel.image" (dict "root" $root "image" .svc.image) | quote }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    {{- toYaml .command | nindent 4 }}
  args:
    - --config
    - /etc/flywheel/flywheel.yaml
    {{- range .extraArgs }}
    - {{ . | quote }}
    {{- end }}
    - {{ printf "services.%s.host=0.0.0.0" .component | quote }}
    {{- range $root.Values.extraOverrides }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "flywheel.commonEnv" (dict "root" $root "component" .component) | nindent 4 }}
    {{- with .extraEnv }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with .svc.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- include "flywheel.ports" .svc.ports | nindent 2 }}
  {{- include "flywheel.probes" (dict "probes" .svc.probes "ports" .svc.ports "service" .grpcService "tls" $root.Values.tls.enabled) | nindent 2 }}
  resources:
    {{- toYaml .svc.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    {{- include "flywheel.baseVolumeMounts" $root | nindent 4 }}
    {{- with .extraMounts }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The gRPC + metrics Service of a component (ClusterIP, or headless for StatefulSets). */}}
{{- define "flywheel.service" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ .name }}
  labels:
    {{- include "flywheel.labels" (dict "root" .root "component" .component) | nindent 4 }}
    flywheel.io/metrics: "true"
    flywheel.io/job: flywheel-{{ .component }}
spec:
  {{- if .headless }}
  clusterIP: None
  publishNotReadyAddresses: {{ .publishNotReady | default false }}
  {{- else }}
  type: ClusterIP
  {{- end }}
  selector:
    {{- include "flywheel.selectorLabels" (dict "root" .root "component" .component) | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .svc.ports.grpc }}
      targetPort: grpc
      appProtocol: grpc
    - name: metrics
      port: {{ .svc.ports.metrics }}
      targetPort: metrics
    {{- with .extraPorts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
