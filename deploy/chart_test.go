package deploy

import (
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

// The Helm chart in helm/leasehold, rendered offline (chartrender_test.go)
// with value sets an operator would use, and held to what the kustomize
// manifests are held to, and more: every object carries the recommended
// app.kubernetes.io labels, KEDA's maximum is the partition count, the
// ServiceMonitors select the metrics Services, and no secret is inline.

const chartDir = "helm/leasehold"

// chartValueSets are the releases the chart is checked with: the values
// file an operator would pass with -f, and the release.
var chartValueSets = []struct {
	name   string
	rel    helmRelease
	values string
}{
	{"defaults", helmRelease{"leasehold", "leasehold"}, ""},
	{"keda", helmRelease{"leasehold", "leasehold"}, `
serviceMonitor:
  enabled: true
  labels: {release: prometheus}
keda:
  enabled: true
  prometheus:
    serverAddress: http://prometheus-operated.monitoring.svc:9090
`},
	{"credential files and postgres", helmRelease{"prod", "jobs"}, `
partitions: 64
image: {repository: registry.example.com/team/leasehold, tag: "1.2.3+build.4"}
imagePullSecrets: [{name: registry}]
worker:
  drainTimeoutSeconds: 60
  concurrency: 32
  auth: {type: creds, existingSecret: nats-worker-creds, credsKey: worker.creds}
  nodeSelector: {pool: workers}
  podAnnotations: {example.com/team: payments}
sink:
  kind: postgres
  postgres: {existingSecret: leasehold-postgres}
  auth: {type: creds, existingSecret: nats-sink-creds}
init:
  replicas: 1
  auth: {type: creds, existingSecret: nats-admin-creds}
commonLabels: {example.com/cost-centre: jobs}
serviceMonitor:
  enabled: true
keda:
  enabled: true
  minReplicaCount: 1
  maxReplicaCount: 32
  prometheus:
    serverAddress: http://thanos-query.monitoring.svc:9090
    query: sum(leasehold_consumer_lag{namespace="jobs"})
    threshold: 250
    authenticationRef: prometheus-auth
    authModes: bearer
`},
	{"workers only", helmRelease{"orders", "batch"}, `
fullnameOverride: orders
nats: {url: "nats://nats-0.nats:4222,nats://nats-1.nats:4222", prefix: orders}
sink: {enabled: false}
init: {enabled: false}
otlpEndpoint: http://otel-collector.observability.svc:4318
worker:
  replicas: 2
  terminationGracePeriodSeconds: 26
  extraArgs: ["--concurrency=4"]
  spreadOverNodes: false
  podDisruptionBudget: {enabled: false}
`},
}

// renderedChart is one value set, rendered and decoded.
type renderedChart struct {
	rel    helmRelease
	values map[string]any
	files  map[string]string
	ms     []manifest
}

func renderChart(t *testing.T, c helmChart, rel helmRelease, values string) renderedChart {
	t.Helper()
	files, err := c.render(rel, values)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	merged, err := c.valuesWith(values)
	if err != nil {
		t.Fatal(err)
	}
	ms, err := decodeRendered(files)
	if err != nil {
		t.Fatal(err)
	}
	return renderedChart{rel, merged, files, ms}
}

// decodeRendered decodes every manifest the templates produced, strictly.
func decodeRendered(files map[string]string) ([]manifest, error) {
	var ms []manifest
	for _, name := range sortedKeys(files) {
		if name == "NOTES.txt" {
			continue
		}
		for i, doc := range splitDocuments([]byte(files[name])) {
			kind, obj, err := decodeChartDocument(doc)
			where := fmt.Sprintf("%s#%d", name, i)
			if err != nil {
				return nil, fmt.Errorf("%s: %w\n%s", where, err, doc)
			}
			ms = append(ms, manifest{where: where, kind: kind, obj: obj})
		}
	}
	return ms, nil
}

// decodeChartDocument decodes as decodeDocument does, with the kinds only
// the chart makes.
func decodeChartDocument(doc []byte) (string, any, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return "", nil, err
	}
	key := tm.APIVersion + "/" + tm.Kind
	var obj any
	switch key {
	case "monitoring.coreos.com/v1/ServiceMonitor":
		obj = &serviceMonitor{}
	case "keda.sh/v1alpha1/ScaledObject":
		obj = &chartScaledObject{}
	default:
		return decodeDocument(doc)
	}
	return key, obj, unmarshalStrict(doc, obj)
}

// serviceMonitor is the part of the Prometheus operator's ServiceMonitor
// (monitoring.coreos.com/v1) that the chart uses.
type serviceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		Endpoints []struct {
			Port          string `json:"port"`
			Path          string `json:"path"`
			Interval      string `json:"interval"`
			ScrapeTimeout string `json:"scrapeTimeout"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// chartScaledObject is the part of KEDA's ScaledObject the chart uses.
type chartScaledObject struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		ScaleTargetRef struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Name       string `json:"name"`
		} `json:"scaleTargetRef"`
		PollingInterval *int32 `json:"pollingInterval"`
		CooldownPeriod  *int32 `json:"cooldownPeriod"`
		MinReplicaCount *int32 `json:"minReplicaCount"`
		MaxReplicaCount *int32 `json:"maxReplicaCount"`
		Advanced        struct {
			HorizontalPodAutoscalerConfig struct {
				Behavior *autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior"`
			} `json:"horizontalPodAutoscalerConfig"`
		} `json:"advanced"`
		Triggers []struct {
			Type              string            `json:"type"`
			Metadata          map[string]string `json:"metadata"`
			AuthenticationRef *struct {
				Name string `json:"name"`
			} `json:"authenticationRef"`
		} `json:"triggers"`
	} `json:"spec"`
}

// prometheusMetadata are the metadata keys of KEDA's prometheus scaler, and
// whether each is required; KEDA ignores keys it does not know.
var prometheusMetadata = map[string]bool{
	"serverAddress": true, "query": true, "threshold": true,
	"activationThreshold": false, "namespace": false, "customHeaders": false, "ignoreNullValues": false,
	"queryParameters": false, "unsafeSsl": false, "timeout": false, "authModes": false,
}

// valueAt reads a dotted path of the merged values.
func valueAt(values map[string]any, dotted string) any {
	var v any = values
	for _, k := range strings.Split(dotted, ".") {
		m, _ := v.(map[string]any)
		v = m[k]
	}
	return v
}

func intAt(values map[string]any, dotted string) int { return int(toInt64(valueAt(values, dotted))) }

// wantKinds is how many objects of each kind the values call for.
func wantKinds(v map[string]any) map[string]int {
	n := map[string]int{}
	on := func(p string) bool { b, _ := valueAt(v, p).(bool); return b }
	for _, comp := range []string{"worker", "sink"} {
		if !on(comp + ".enabled") {
			continue
		}
		n["v1/ServiceAccount"]++
		n["apps/v1/Deployment"]++
		n["v1/Service"]++
		if on(comp + ".podDisruptionBudget.enabled") {
			n["policy/v1/PodDisruptionBudget"]++
		}
		if on("serviceMonitor.enabled") {
			n["monitoring.coreos.com/v1/ServiceMonitor"]++
		}
	}
	if on("init.enabled") {
		n["batch/v1/Job"]++
	}
	if on("keda.enabled") && on("worker.enabled") {
		n["keda.sh/v1alpha1/ScaledObject"]++
	}
	return n
}

// checkChart checks a rendered value set; series are the metric series
// leasehold exports (nil: the KEDA query's metrics are not checked).
func checkChart(c helmChart, r renderedChart, series map[string]map[string]bool) problems {
	var p problems
	have := map[string]int{}
	for _, m := range r.ms {
		have[m.kind]++
	}
	for kind, n := range wantKinds(r.values) {
		if have[kind] != n {
			p.addf("%d objects of %s, want %d", have[kind], kind, n)
		}
	}
	for kind := range have {
		if _, ok := wantKinds(r.values)[kind]; !ok {
			p.addf("an object of kind %s the values did not ask for", kind)
		}
	}
	checkChartLabels(&p, c, r)
	for _, lc := range leaseholdContainers(r.ms) {
		for _, q := range checkContainer(lc) {
			p.addf("%s: %s", lc.where, q)
		}
	}
	checkChartSelectors(&p, r.ms)
	checkChartSecrets(&p, r)
	for _, lc := range leaseholdContainers(r.ms) {
		inv, err := parseInvocation(lc.container.Args)
		if _, ok := commandFlags[inv.command]["partitions"]; !ok || err != nil {
			continue
		}
		if n, want := inv.int("partitions"), intAt(r.values, "partitions"); n != want {
			p.addf("%s runs with --partitions=%d, want the partitions value %d", lc.where, n, want)
		}
	}
	for _, so := range objectsOf[chartScaledObject](r.ms) {
		checkChartScaledObject(&p, so, r, series)
	}
	for _, sm := range objectsOf[serviceMonitor](r.ms) {
		checkServiceMonitor(&p, sm, r)
	}
	return p
}

// objectMeta is the metadata of a decoded object.
func objectMeta(obj any) *metav1.ObjectMeta {
	if o, ok := obj.(metav1.ObjectMetaAccessor); ok {
		om, _ := o.GetObjectMeta().(*metav1.ObjectMeta)
		return om
	}
	return nil
}

// recommendedLabels are Kubernetes' recommended labels.
var recommendedLabels = []string{
	"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
	"app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
}

func checkChartLabels(p *problems, c helmChart, r renderedChart) {
	name, _ := valueAt(r.values, "nameOverride").(string)
	if name == "" {
		name = c.meta.Name
	}
	version, _ := valueAt(r.values, "image.tag").(string)
	if version == "" {
		version = c.meta.AppVersion
	}
	want := map[string]string{
		"app.kubernetes.io/name":       name,
		"app.kubernetes.io/instance":   r.rel.name,
		"app.kubernetes.io/version":    strings.ReplaceAll(version, "+", "_"),
		"app.kubernetes.io/part-of":    valueAt(r.values, "partOf").(string),
		"app.kubernetes.io/managed-by": "Helm",
	}
	check := func(where string, got map[string]string) {
		for _, k := range recommendedLabels {
			v, ok := got[k]
			if !ok {
				p.addf("%s: no label %s", where, k)
				continue
			}
			if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
				p.addf("%s: label %s=%q: %s", where, k, v, strings.Join(errs, "; "))
			}
			if w, ok := want[k]; ok && v != w {
				p.addf("%s: label %s=%q, want %q", where, k, v, w)
			}
		}
		if c := got["app.kubernetes.io/component"]; !slices.Contains([]string{"worker", "sink", "init"}, c) {
			p.addf("%s: component %q, want worker, sink or init", where, c)
		}
		for k, v := range valueAt(r.values, "commonLabels").(map[string]any) {
			if got[k] != v {
				p.addf("%s: common label %s=%v missing", where, k, v)
			}
		}
	}
	for _, m := range r.ms {
		om := objectMeta(m.obj)
		if om == nil {
			p.addf("%s: no metadata", m.where)
			continue
		}
		check(m.where, om.Labels)
		if om.Namespace != r.rel.namespace {
			p.addf("%s: namespace %q, want the release's %q", m.where, om.Namespace, r.rel.namespace)
		}
		if errs := validation.IsDNS1123Subdomain(om.Name); len(errs) > 0 {
			p.addf("%s: name %q: %s", m.where, om.Name, strings.Join(errs, "; "))
		}
	}
	for _, o := range podOwners(r.ms) {
		check(o.where+" pod template", o.template.Labels)
	}
}

// checkChartSelectors checks that each Deployment selects its own pods and
// each PodDisruptionBudget and Service the pods of exactly one Deployment,
// on a port its container declares.
func checkChartSelectors(p *problems, ms []manifest) {
	owners := podOwners(ms)
	matching := func(sel labels.Selector) []podOwner {
		var out []podOwner
		for _, o := range owners {
			if o.kind == "Deployment" && sel.Matches(labels.Set(o.template.Labels)) {
				out = append(out, o)
			}
		}
		return out
	}
	for _, o := range owners {
		if o.kind != "Deployment" {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(o.selector)
		if err != nil || sel.Empty() || !sel.Matches(labels.Set(o.template.Labels)) {
			p.addf("%s: selector %v does not select its pods' labels %v (%v)", o.where, o.selector, o.template.Labels, err)
		}
	}
	for _, m := range ms {
		switch o := m.obj.(type) {
		case *policyv1.PodDisruptionBudget:
			sel, err := metav1.LabelSelectorAsSelector(o.Spec.Selector)
			if err != nil {
				p.addf("%s: %v", m.where, err)
			} else if got := matching(sel); len(got) != 1 {
				p.addf("%s: PodDisruptionBudget %s selects %d Deployments, want 1", m.where, o.Name, len(got))
			}
		case *corev1.Service:
			got := matching(labels.SelectorFromSet(o.Spec.Selector))
			if len(got) != 1 {
				p.addf("%s: Service %s selects %d Deployments, want 1", m.where, o.Name, len(got))
				continue
			}
			for _, sp := range o.Spec.Ports {
				if !slices.ContainsFunc(got[0].template.Spec.Containers, func(c corev1.Container) bool { return resolvePort(c, sp.TargetPort) != 0 }) {
					p.addf("%s: Service port %s targets %s, which %s does not declare", m.where, sp.Name, sp.TargetPort.String(), got[0].name)
				}
			}
		}
	}
}

// checkChartSecrets checks that no secret is inline: the chart makes no
// Secret, every credential comes from the Secret the values name for that
// pod's role (a worker pod never reads the admin's), and no NATS URL
// carries a password.
func checkChartSecrets(p *problems, r renderedChart) {
	secretsOf := map[string][]string{
		"worker": {"worker.auth.existingSecret"},
		"sink":   {"sink.auth.existingSecret", "sink.postgres.existingSecret"},
		"init":   {"init.auth.existingSecret"},
	}
	for _, m := range r.ms {
		if strings.HasSuffix(m.kind, "/Secret") {
			p.addf("%s: the chart makes a Secret; credentials belong in Secrets the operator creates", m.where)
		}
	}
	for _, o := range podOwners(r.ms) {
		role := o.template.Labels["app.kubernetes.io/component"]
		named := map[string]bool{}
		for _, k := range secretsOf[role] {
			if s, _ := valueAt(r.values, k).(string); s != "" {
				named[s] = true
			}
		}
		for _, v := range o.template.Spec.Volumes {
			if v.Secret != nil && !named[v.Secret.SecretName] {
				p.addf("%s: volume %s mounts Secret %q, which no value names for the %s", o.where, v.Name, v.Secret.SecretName, role)
			}
		}
		for _, c := range append(slices.Clone(o.template.Spec.InitContainers), o.template.Spec.Containers...) {
			for _, e := range c.Env {
				if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && !named[e.ValueFrom.SecretKeyRef.Name] {
					p.addf("%s/%s: env %s reads Secret %q, which no value names for the %s", o.where, c.Name, e.Name, e.ValueFrom.SecretKeyRef.Name, role)
				}
				if (isSecret(e.Name) || e.Name == "NATS_USER") && e.Value != "" {
					p.addf("%s/%s: env %s is a literal; it must come from a Secret", o.where, c.Name, e.Name)
				}
				if e.Name != "NATS_URL" {
					continue
				}
				for _, s := range strings.Split(e.Value, ",") {
					if u, err := url.Parse(strings.TrimSpace(s)); err != nil || u.User != nil {
						p.addf("%s/%s: NATS_URL %q carries user information (or does not parse); credentials come from the auth Secret", o.where, c.Name, s)
					}
				}
			}
		}
	}
}

var metricName = regexp.MustCompile(`\bleasehold_[a-z_]+\b`)

func checkChartScaledObject(p *problems, so chartScaledObject, r renderedChart, series map[string]map[string]bool) {
	partitions := intAt(r.values, "partitions")
	ref := so.Spec.ScaleTargetRef
	var target *appsv1.Deployment
	for _, d := range objectsOf[appsv1.Deployment](r.ms) {
		if d.Name == ref.Name {
			target = &d
		}
	}
	if ref.APIVersion != "apps/v1" || ref.Kind != "Deployment" || target == nil || target.Labels["app.kubernetes.io/component"] != "worker" {
		p.addf("ScaledObject %s: scaleTargetRef %s %s %q is not the worker Deployment", so.Name, ref.APIVersion, ref.Kind, ref.Name)
		return
	}
	if target.Spec.Replicas != nil {
		p.addf("Deployment %s sets replicas %d beside KEDA: every upgrade would reset KEDA's count", target.Name, *target.Spec.Replicas)
	}
	want := partitions
	if n := intAt(r.values, "keda.maxReplicaCount"); n > 0 {
		want = n
	}
	switch max := so.Spec.MaxReplicaCount; {
	case max == nil:
		p.addf("ScaledObject %s: no maxReplicaCount (KEDA's default is 100)", so.Name)
	case int(*max) > partitions:
		p.addf("ScaledObject %s: maxReplicaCount %d is above the %d partitions", so.Name, *max, partitions)
	case int(*max) != want:
		p.addf("ScaledObject %s: maxReplicaCount %d, want %d", so.Name, *max, want)
	}
	if min := so.Spec.MinReplicaCount; min == nil || *min < 1 {
		p.addf("ScaledObject %s: minReplicaCount %s, want at least 1: a worker must hold the partitions to work them and report their backlog", so.Name, describePtr(min))
	}
	if b := so.Spec.Advanced.HorizontalPodAutoscalerConfig.Behavior; b == nil || b.ScaleDown == nil ||
		!slices.ContainsFunc(b.ScaleDown.Policies, func(hp autoscalingv2.HPAScalingPolicy) bool { return hp.Type == autoscalingv2.PodsScalingPolicy }) {
		p.addf("ScaledObject %s: scale-down is not limited to a number of pods per period", so.Name)
	}
	if len(so.Spec.Triggers) != 1 || so.Spec.Triggers[0].Type != "prometheus" {
		p.addf("ScaledObject %s: want one prometheus trigger", so.Name)
		return
	}
	md := so.Spec.Triggers[0].Metadata
	for k, required := range prometheusMetadata {
		if required && md[k] == "" {
			p.addf("ScaledObject %s: trigger metadata %s is required", so.Name, k)
		}
	}
	for k := range md {
		if _, ok := prometheusMetadata[k]; !ok {
			p.addf("ScaledObject %s: the prometheus scaler has no metadata key %q", so.Name, k)
		}
	}
	if n, err := strconv.ParseFloat(md["threshold"], 64); err != nil || n <= 0 {
		p.addf("ScaledObject %s: threshold %q, want a positive number", so.Name, md["threshold"])
	}
	if _, err := strconv.ParseBool(md["ignoreNullValues"]); err != nil {
		p.addf("ScaledObject %s: ignoreNullValues %q, want true or false", so.Name, md["ignoreNullValues"])
	}
	if !strings.Contains(md["query"], "leasehold_consumer_lag") {
		p.addf("ScaledObject %s: query %q does not read the backlog, leasehold_consumer_lag", so.Name, md["query"])
	}
	if series == nil {
		return
	}
	exported := map[string]bool{} // series and label names
	for name, ls := range series {
		exported[name] = true
		for l := range ls {
			exported[l] = true
		}
	}
	for _, name := range metricName.FindAllString(md["query"], -1) {
		if !exported[name] {
			p.addf("ScaledObject %s: query reads %s, which leasehold exports neither as a series nor as a label", so.Name, name)
		}
	}
}

func checkServiceMonitor(p *problems, sm serviceMonitor, r renderedChart) {
	sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
	if err != nil || sel.Empty() {
		p.addf("ServiceMonitor %s: selector %v: %v", sm.Name, sm.Spec.Selector, err)
		return
	}
	var got []corev1.Service
	for _, s := range objectsOf[corev1.Service](r.ms) {
		if sel.Matches(labels.Set(s.Labels)) {
			got = append(got, s)
		}
	}
	if len(got) != 1 {
		p.addf("ServiceMonitor %s selects %d Services, want 1", sm.Name, len(got))
		return
	}
	if c, sc := sm.Labels["app.kubernetes.io/component"], got[0].Labels["app.kubernetes.io/component"]; c != sc {
		p.addf("ServiceMonitor %s of the %s selects the Service %s of the %s", sm.Name, c, got[0].Name, sc)
	}
	if !slices.Contains(sm.Spec.NamespaceSelector.MatchNames, r.rel.namespace) {
		p.addf("ServiceMonitor %s looks in namespaces %v, not the release's %s", sm.Name, sm.Spec.NamespaceSelector.MatchNames, r.rel.namespace)
	}
	if len(sm.Spec.Endpoints) == 0 {
		p.addf("ServiceMonitor %s has no endpoints", sm.Name)
	}
	for _, e := range sm.Spec.Endpoints {
		if !slices.ContainsFunc(got[0].Spec.Ports, func(sp corev1.ServicePort) bool { return sp.Name == e.Port }) {
			p.addf("ServiceMonitor %s scrapes port %q, which Service %s does not name", sm.Name, e.Port, got[0].Name)
		}
		if e.Path != "/metrics" {
			p.addf("ServiceMonitor %s scrapes %s, not /metrics", sm.Name, e.Path)
		}
	}
	for k, v := range valueAt(r.values, "serviceMonitor.labels").(map[string]any) {
		if sm.Labels[k] != v {
			p.addf("ServiceMonitor %s lacks the label %s=%v Prometheus selects it by", sm.Name, k, v)
		}
	}
}

func describePtr(n *int32) string {
	if n == nil {
		return "unset"
	}
	return strconv.Itoa(int(*n))
}
