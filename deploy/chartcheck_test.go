package deploy

import (
	"reflect"
	"regexp"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

var (
	seriesOnce sync.Once
	series     map[string]map[string]bool
)

// leaseholdSeries is exportedSeries, computed once for the chart's tests.
func leaseholdSeries(t *testing.T) map[string]map[string]bool {
	seriesOnce.Do(func() { series = exportedSeries(t) })
	if series == nil {
		t.Fatal("the exported series could not be read (see the first test that asked)")
	}
	return series
}

func TestChart(t *testing.T) {
	t.Parallel()
	c := loadChart(t, chartDir)
	if c.meta.APIVersion != "v2" || c.meta.Type != "application" || c.meta.Name != "leasehold" {
		t.Errorf("Chart.yaml: apiVersion %q type %q name %q, want v2 application leasehold", c.meta.APIVersion, c.meta.Type, c.meta.Name)
	}
	if !regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`).MatchString(c.meta.Version) {
		t.Errorf("Chart.yaml: version %q is not a semantic version", c.meta.Version)
	}
	s := leaseholdSeries(t)
	for _, vs := range chartValueSets {
		t.Run(vs.name, func(t *testing.T) {
			r := renderChart(t, c, vs.rel, vs.values)
			for _, p := range checkChart(c, r, s) {
				t.Error(p)
			}
			if notes := r.files["NOTES.txt"]; !strings.Contains(notes, "kubectl -n "+vs.rel.namespace) {
				t.Errorf("NOTES.txt does not say how to look at the release:\n%s", notes)
			}
			if t.Failed() {
				for _, name := range sortedKeys(r.files) {
					t.Logf("--- %s\n%s", name, r.files[name])
				}
			}
		})
	}
}

// TestChartChecksCatchMistakes breaks rendered output in ways that still
// decode, and expects checkChart to notice each one.
func TestChartChecksCatchMistakes(t *testing.T) {
	t.Parallel()
	c := loadChart(t, chartDir)
	s := leaseholdSeries(t)
	set := func(name string) (helmRelease, string) {
		for _, vs := range chartValueSets {
			if vs.name == name {
				return vs.rel, vs.values
			}
		}
		t.Fatalf("no value set %q", name)
		return helmRelease{}, ""
	}
	secretPassword := `            - name: NATS_PASSWORD
              valueFrom:
                secretKeyRef:
                  name: "leasehold-nats-worker"
                  key: "password"
`
	for _, m := range []struct{ name, set, file, old, new string }{
		{"a label missing", "defaults", "worker.yaml", "    app.kubernetes.io/part-of: leasehold\n", ""},
		{"a pod without the version label", "defaults", "sink.yaml", "        app.kubernetes.io/version: \"0.1.0\"\n", ""},
		{"liveness on another path", "defaults", "worker.yaml", "path: /livez", "path: /healthz"},
		{"grace below the drain", "defaults", "worker.yaml", "terminationGracePeriodSeconds: 40", "terminationGracePeriodSeconds: 25"},
		{"probe on another port", "defaults", "sink.yaml", "containerPort: 8081", "containerPort: 9091"},
		{"password inline", "defaults", "worker.yaml", secretPassword, "            - name: NATS_PASSWORD\n              value: hunter2\n"},
		{"password in the URL", "defaults", "worker.yaml", `value: "nats://nats.nats`, `value: "nats://worker:hunter2@nats.nats`},
		{"a sink reading the admin's Secret", "defaults", "sink.yaml", `name: "leasehold-nats-sink"`, `name: "leasehold-nats-admin"`},
		{"KEDA above the partitions", "keda", "scaledobject.yaml", "maxReplicaCount: 64", "maxReplicaCount: 65"},
		{"KEDA below the partitions", "keda", "scaledobject.yaml", "maxReplicaCount: 64", "maxReplicaCount: 8"},
		{"KEDA at zero", "keda", "scaledobject.yaml", "minReplicaCount: 2", "minReplicaCount: 0"},
		{"replicas beside KEDA", "keda", "worker.yaml", "  revisionHistoryLimit: 5\n", "  replicas: 3\n  revisionHistoryLimit: 5\n"},
		{"a metric nobody exports", "keda", "scaledobject.yaml", "leasehold_consumer_lag{", "leasehold_consumer_lags{"},
		{"ServiceMonitor selecting nothing", "keda", "servicemonitor.yaml", "      app.kubernetes.io/component: worker\n  namespaceSelector", "      app.kubernetes.io/component: workers\n  namespaceSelector"},
		{"ServiceMonitor on another port", "keda", "servicemonitor.yaml", "- port: http", "- port: metrics"},
		{"partitions disagree", "defaults", "init-job.yaml", `"--partitions=64"`, `"--partitions=32"`},
		{"PDB selecting nothing", "defaults", "worker.yaml", "      app.kubernetes.io/component: worker\n---\n# /metrics", "      app.kubernetes.io/component: workerz\n---\n# /metrics"},
	} {
		t.Run(m.name, func(t *testing.T) {
			rel, values := set(m.set)
			r := renderChart(t, c, rel, values)
			if p := checkChart(c, r, s); len(p) != 0 {
				t.Fatalf("the unbroken rendering has problems: %v", p)
			}
			r.files[m.file] = string(mutate(t, []byte(r.files[m.file]), m.old, m.new))
			ms, err := decodeRendered(r.files)
			if err != nil {
				t.Fatalf("the mutated output must still decode: %v", err)
			}
			r.ms = ms
			p := checkChart(c, r, s)
			if len(p) == 0 {
				t.Fatal("not caught")
			}
			t.Logf("caught: %s", strings.Join(p, "; "))
		})
	}
}

// chartRefusals are values the chart must refuse to render, and what the
// refusal must say.
var chartRefusals = []struct{ name, values, says string }{
	{"grace not above the drain", "worker: {terminationGracePeriodSeconds: 25}", "is not above worker.drainTimeoutSeconds 25"},
	{"KEDA above the partitions", "serviceMonitor: {enabled: true}\nkeda: {enabled: true, maxReplicaCount: 65, prometheus: {serverAddress: http://p:9090}}", "above the 64 partitions"},
	{"KEDA min above max", "partitions: 4\nserviceMonitor: {enabled: true}\nkeda: {enabled: true, minReplicaCount: 5, prometheus: {serverAddress: http://p:9090}}", "minReplicaCount 5 is above keda.maxReplicaCount 4"},
	{"KEDA at zero", "keda: {minReplicaCount: 0}", "below the minimum"},
	{"KEDA without Prometheus", "serviceMonitor: {enabled: true}\nkeda: {enabled: true}", "keda.prometheus.serverAddress"},
	{"KEDA query without the labels it selects by", "keda: {enabled: true, prometheus: {serverAddress: http://p:9090}}", "serviceMonitor.enabled"},
	{"postgres without its Secret", "sink: {kind: postgres}", "sink.postgres.existingSecret"},
	{"no partitions", "partitions: 0", "below the minimum"},
	{"a misspelt key", "worker: {replica: 5}", "replica is not a key"},
	{"a password as a value", "worker: {auth: {password: hunter2}}", "password is not a key"},
	{"a Secret not named", "sink: {auth: {existingSecret: ''}}", "shorter than"},
	{"an unknown auth type", "sink: {auth: {type: none}}", "is not one of"},
	{"a TTL of fractions", "worker: {ttl: 1500ms}", "does not match"},
}

func TestChartRefuses(t *testing.T) {
	t.Parallel()
	c := loadChart(t, chartDir)
	for _, r := range chartRefusals {
		t.Run(r.name, func(t *testing.T) {
			_, err := c.render(helmRelease{"leasehold", "leasehold"}, r.values)
			if err == nil {
				t.Fatalf("rendered %q", r.values)
			}
			if !strings.Contains(err.Error(), r.says) {
				t.Fatalf("refused with %q, want it to say %q", err, r.says)
			}
			t.Logf("refused: %v", err)
		})
	}
}

// TestChartValuesHoldNoSecrets reads values.yaml for keys that could hold
// a secret. Keys that name a Secret (existingSecret, imagePullSecrets) or
// a key in one (...Key) are references, not secrets.
func TestChartValuesHoldNoSecrets(t *testing.T) {
	t.Parallel()
	c := loadChart(t, chartDir)
	secretish := regexp.MustCompile(`(?i)pass|token|seed|secret|creds|nkey|credential`)
	var walk func(where string, v any)
	walk = func(where string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, e := range v {
				if secretish.MatchString(k) && k != "existingSecret" && k != "imagePullSecrets" && !strings.HasSuffix(k, "Key") {
					t.Errorf("values %s.%s: a key that could hold a secret; read secrets from an existing Secret", where, k)
				}
				walk(where+"."+k, e)
			}
		case []any:
			for _, e := range v {
				walk(where+"[]", e)
			}
		}
	}
	walk("", c.values)
	// The schema allows no other keys, so none can be added to them.
	if errs := validateSchema(c.schema, c.schema, c.values, "values"); len(errs) > 0 {
		t.Errorf("values.yaml does not meet its own schema: %v", errs)
	}
}

// TestChartAgreesWithKustomize keeps the chart's defaults and the kustomize
// manifests in kubernetes/ the same where they overlap: the command lines
// (every flag's effective value), environment, ports, probes, resources,
// security and grace periods of the worker, the sink and init.
func TestChartAgreesWithKustomize(t *testing.T) {
	t.Parallel()
	chart := renderChart(t, loadChart(t, chartDir), helmRelease{"leasehold", "leasehold"}, "")
	byCommand := func(ms []manifest) map[string]leaseholdContainer {
		out := map[string]leaseholdContainer{}
		for _, lc := range leaseholdContainers(ms) {
			inv, err := parseInvocation(lc.container.Args)
			if err != nil {
				t.Fatalf("%s: %v", lc.where, err)
			}
			out[inv.command] = lc
		}
		return out
	}
	fromChart, fromKustomize := byCommand(chart.ms), byCommand(loadManifests(t, "kubernetes"))
	for _, cmd := range []string{"worker", "sink", "init"} {
		h, k := fromChart[cmd], fromKustomize[cmd]
		hi, _ := parseInvocation(h.container.Args)
		ki, _ := parseInvocation(k.container.Args)
		for _, flags := range []map[string]flagSpec{commandFlags[cmd], connectionFlags} {
			for name := range flags {
				if hv, kv := hi.value(name), ki.value(name); hv != kv {
					t.Errorf("%s --%s: chart %q, kubernetes/ %q", cmd, name, hv, kv)
				}
			}
		}
		hs, ks := h.owner.template.Spec, k.owner.template.Spec
		for _, f := range []struct {
			what   string
			chart  any
			kustom any
		}{
			{"env", h.container.Env, k.container.Env},
			{"ports", h.container.Ports, k.container.Ports},
			{"liveness probe", h.container.LivenessProbe, k.container.LivenessProbe},
			{"readiness probe", h.container.ReadinessProbe, k.container.ReadinessProbe},
			{"resources", h.container.Resources, k.container.Resources},
			{"container security", h.container.SecurityContext, k.container.SecurityContext},
			{"grace period", hs.TerminationGracePeriodSeconds, ks.TerminationGracePeriodSeconds},
			{"run as", podUser(hs), podUser(ks)},
		} {
			if !reflect.DeepEqual(f.chart, f.kustom) {
				t.Errorf("%s %s differs:\nchart:        %+v\nkubernetes/:  %+v", cmd, f.what, f.chart, f.kustom)
			}
		}
	}
}

// podUser is the pod security context without fsGroup, which only the
// chart sets (for credential files it mounts).
func podUser(s corev1.PodSpec) corev1.PodSecurityContext {
	if s.SecurityContext == nil {
		return corev1.PodSecurityContext{}
	}
	c := *s.SecurityContext
	c.FSGroup = nil
	return c
}
