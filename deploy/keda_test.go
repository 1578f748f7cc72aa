package deploy

import (
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// scaledObject is the part of KEDA's ScaledObject (keda.sh/v1alpha1) that
// keda/scaledobject.yaml uses; k8s.io/api has no type for it.
type scaledObject struct {
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
		Advanced        *struct {
			HorizontalPodAutoscalerConfig *struct {
				Behavior *autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior"`
			} `json:"horizontalPodAutoscalerConfig"`
		} `json:"advanced"`
		Triggers []struct {
			Type     string            `json:"type"`
			Metadata map[string]string `json:"metadata"`
		} `json:"triggers"`
	} `json:"spec"`
}

// natsJetStreamMetadata are the metadata keys KEDA's nats-jetstream scaler
// reads, and whether each is required. KEDA ignores keys it does not know,
// so a misspelt one would silently fall back to its default.
var natsJetStreamMetadata = map[string]bool{
	"natsServerMonitoringEndpoint": true,
	"account":                      true,
	"stream":                       true,
	"consumer":                     true,
	"lagThreshold":                 false,
	"activationLagThreshold":       false,
	"useHttps":                     false,
}

func TestScaledObject(t *testing.T) {
	t.Parallel()
	sos := objectsOf[scaledObject](loadManifests(t, "keda"))
	if len(sos) != 1 {
		t.Fatalf("%d ScaledObjects, want 1", len(sos))
	}
	for _, p := range checkScaledObject(sos[0], loadManifests(t, "kubernetes"), loadHelmValues(t)) {
		t.Error(p)
	}
}

func TestScaledObjectChecksCatchMistakes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, old, new string }{
		{"more workers than partitions", "maxReplicaCount: 64", "maxReplicaCount: 65"},
		{"another stream", "stream: leasehold-jobs", "stream: jobs"},
		{"misspelt metadata key", `lagThreshold: "1000"`, `lagTreshold: "1000"`},
		{"another target", "    name: leasehold-worker\n  pollingInterval", "    name: leasehold-sink\n  pollingInterval"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ms, err := decodeFile("scaledobject.yaml", mutate(t, readFile(t, "keda/scaledobject.yaml"), c.old, c.new))
			if err != nil {
				t.Fatalf("the mutated file must still decode: %v", err)
			}
			found := checkScaledObject(*ms[0].obj.(*scaledObject), loadManifests(t, "kubernetes"), loadHelmValues(t))
			if len(found) == 0 {
				t.Fatal("not caught")
			}
			t.Logf("caught: %s", strings.Join(found, "; "))
		})
	}
}

func checkScaledObject(so scaledObject, k8s []manifest, values helmValues) problems {
	var p problems
	ref := so.Spec.ScaleTargetRef
	if ref.Kind != "Deployment" || ref.APIVersion != "apps/v1" {
		p.addf("scaleTargetRef %s %s, want apps/v1 Deployment", ref.APIVersion, ref.Kind)
	}
	var target *invocation
	for _, lc := range leaseholdContainers(k8s) {
		if lc.owner.kind == "Deployment" && lc.owner.name == ref.Name {
			if inv, err := parseInvocation(lc.container.Args); err == nil {
				target = &inv
			}
		}
	}
	if target == nil || target.command != "worker" {
		p.addf("scaleTargetRef %q is not a Deployment running `leasehold worker`", ref.Name)
		return p
	}
	partitions := target.int("partitions")
	if so.Spec.MaxReplicaCount == nil {
		p.addf("maxReplicaCount is not set (KEDA's default is 100), and more workers than the %d partitions idle", partitions)
		return p
	}
	maxR := int(*so.Spec.MaxReplicaCount)
	if maxR > partitions {
		p.addf("maxReplicaCount %d is above the %d partitions: the extra workers would hold nothing", maxR, partitions)
	}
	if so.Spec.MinReplicaCount == nil || *so.Spec.MinReplicaCount < 1 || int(*so.Spec.MinReplicaCount) > maxR {
		p.addf("minReplicaCount %v: use 1..maxReplicaCount", so.Spec.MinReplicaCount)
	}
	if so.Namespace != "leasehold" {
		p.addf("namespace %q, want the workers' namespace leasehold", so.Namespace)
	}
	var found bool
	for _, tr := range so.Spec.Triggers {
		if tr.Type != "nats-jetstream" {
			continue
		}
		found = true
		for k := range tr.Metadata {
			if _, ok := natsJetStreamMetadata[k]; !ok {
				p.addf("trigger metadata %q: the nats-jetstream scaler has no such key (it would be ignored)", k)
			}
		}
		for k, required := range natsJetStreamMetadata {
			if required && tr.Metadata[k] == "" {
				p.addf("trigger metadata %q is required", k)
			}
		}
		if got, want := tr.Metadata["stream"], target.value("prefix")+"-jobs"; got != want {
			p.addf("stream %q, want the job stream %q", got, want)
		}
		if v, ok := tr.Metadata["lagThreshold"]; ok {
			if n, err := strconv.Atoi(v); err != nil || n < 1 {
				p.addf("lagThreshold %q: want a positive integer", v)
			}
		}
		if v, ok := tr.Metadata["useHttps"]; ok {
			if _, err := strconv.ParseBool(v); err != nil {
				p.addf("useHttps %q: want true or false", v)
			}
		}
		if _, ok := values.Config.Merge.Accounts[tr.Metadata["account"]]; !ok {
			p.addf("account %q is not an account of the NATS Helm values", tr.Metadata["account"])
		}
		host, port, err := net.SplitHostPort(tr.Metadata["natsServerMonitoringEndpoint"])
		if err != nil {
			p.addf("natsServerMonitoringEndpoint: %v", err)
			continue
		}
		if port != strconv.Itoa(values.Config.Monitor.Port) || !values.Config.Monitor.Enabled {
			p.addf("monitoring endpoint port %s, but the NATS Helm values serve monitoring on %d (enabled %v)", port, values.Config.Monitor.Port, values.Config.Monitor.Enabled)
		}
		if !strings.HasPrefix(host, "nats-headless.") {
			p.addf("monitoring endpoint host %s: use the chart's headless Service, whose per-pod names the scaler builds in a cluster", host)
		}
	}
	if !found {
		p.addf("no nats-jetstream trigger")
	}
	b := so.Spec.Advanced
	if b == nil || b.HorizontalPodAutoscalerConfig == nil || b.HorizontalPodAutoscalerConfig.Behavior == nil ||
		b.HorizontalPodAutoscalerConfig.Behavior.ScaleDown == nil ||
		!slices.ContainsFunc(b.HorizontalPodAutoscalerConfig.Behavior.ScaleDown.Policies, func(hp autoscalingv2.HPAScalingPolicy) bool {
			return hp.Type == autoscalingv2.PodsScalingPolicy
		}) {
		p.addf("scale-down is not limited to a number of pods per period: every removed worker is a round of hand-offs")
	}
	return p
}
