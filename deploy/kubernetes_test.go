package deploy

import (
	"fmt"
	"path"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// kinds maps apiVersion/kind to the Go type a document must decode into.
// A manifest of a kind not listed here fails the tests: add its type.
var kinds = map[string]func() any{
	"v1/Namespace":                  func() any { return &corev1.Namespace{} },
	"v1/ServiceAccount":             func() any { return &corev1.ServiceAccount{} },
	"v1/Service":                    func() any { return &corev1.Service{} },
	"apps/v1/Deployment":            func() any { return &appsv1.Deployment{} },
	"batch/v1/Job":                  func() any { return &batchv1.Job{} },
	"policy/v1/PodDisruptionBudget": func() any { return &policyv1.PodDisruptionBudget{} },
	// No Go type in k8s.io/api: minimal strict structs of the fields used.
	"kustomize.config.k8s.io/v1beta1/Kustomization": func() any { return &kustomization{} },
	"keda.sh/v1alpha1/ScaledObject":                 func() any { return &scaledObject{} },
}

// kustomization is the part of kustomize's Kustomization that
// kubernetes/kustomization.yaml uses.
type kustomization struct {
	metav1.TypeMeta `json:",inline"`
	Namespace       string   `json:"namespace"`
	Resources       []string `json:"resources"`
	Labels          []struct {
		Pairs            map[string]string `json:"pairs"`
		IncludeSelectors bool              `json:"includeSelectors"`
	} `json:"labels"`
	Images []struct {
		Name    string `json:"name"`
		NewName string `json:"newName"`
		NewTag  string `json:"newTag"`
	} `json:"images"`
}

// manifest is one decoded document.
type manifest struct {
	where string // file#index
	kind  string // apiVersion/kind
	obj   any
}

// decodeDocument decodes one YAML document strictly into the type its
// apiVersion and kind name: an unknown or duplicated field is an error.
func decodeDocument(doc []byte) (string, any, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return "", nil, err
	}
	key := tm.APIVersion + "/" + tm.Kind
	newObj, ok := kinds[key]
	if !ok {
		return key, nil, fmt.Errorf("apiVersion %q kind %q: no type to check it against; add one to kinds", tm.APIVersion, tm.Kind)
	}
	obj := newObj()
	if err := unmarshalStrict(doc, obj); err != nil {
		return key, nil, err
	}
	return key, obj, nil
}

// decodeFile decodes every document of a (multi-document) file.
func decodeFile(name string, b []byte) ([]manifest, error) {
	var out []manifest
	for i, doc := range splitDocuments(b) {
		kind, obj, err := decodeDocument(doc)
		where := fmt.Sprintf("%s#%d", name, i)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		out = append(out, manifest{where: where, kind: kind, obj: obj})
	}
	return out, nil
}

// loadManifests decodes every .yaml file of dirs.
func loadManifests(t *testing.T, dirs ...string) []manifest {
	t.Helper()
	var all []manifest
	for _, dir := range dirs {
		for _, name := range yamlFiles(t, dir) {
			ms, err := decodeFile(name, readFile(t, name))
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, ms...)
		}
	}
	return all
}

func objectsOf[T any](ms []manifest) []T {
	var out []T
	for _, m := range ms {
		if o, ok := m.obj.(*T); ok {
			out = append(out, *o)
		}
	}
	return out
}

func TestManifestsDecodeStrictly(t *testing.T) {
	t.Parallel()
	ms := loadManifests(t, "kubernetes", "keda")
	have := map[string]int{}
	for _, m := range ms {
		have[m.kind]++
	}
	for kind, n := range map[string]int{
		"apps/v1/Deployment": 2, "policy/v1/PodDisruptionBudget": 2, "v1/ServiceAccount": 2,
		"v1/Service": 2, "batch/v1/Job": 1, "keda.sh/v1alpha1/ScaledObject": 1,
	} {
		if have[kind] != n {
			t.Errorf("%d documents of %s, want %d", have[kind], kind, n)
		}
	}
}

// TestMisspeltFieldFails shows that strict decoding catches what a lenient
// decoder would silently drop.
func TestMisspeltFieldFails(t *testing.T) {
	t.Parallel()
	cases := []struct{ file, old, new string }{
		{"kubernetes/worker.yaml", "terminationGracePeriodSeconds: 40", "terminationGracePeriodSecond: 40"},
		{"kubernetes/worker.yaml", "readinessProbe:", "readynessProbe:"},
		{"kubernetes/worker.yaml", "maxUnavailable: 1", "maxUnavailabe: 1"},
		{"kubernetes/sink.yaml", "readOnlyRootFilesystem: true", "readOnlyRootFileSystem: true"},
		{"kubernetes/init-job.yaml", "ttlSecondsAfterFinished", "ttlSecondAfterFinished"},
		{"kubernetes/kustomization.yaml", "resources:", "resource:"},
		{"keda/scaledobject.yaml", "maxReplicaCount: 64", "maxReplicasCount: 64"},
		{"keda/scaledobject.yaml", "stabilizationWindowSeconds: 300", "stabilisationWindowSeconds: 300"},
		// A key given twice is an error too, not "the last one wins".
		{"kubernetes/worker.yaml", "  revisionHistoryLimit: 5\n", "  revisionHistoryLimit: 5\n  revisionHistoryLimit: 6\n"},
	}
	for _, c := range cases {
		t.Run(path.Base(c.file)+"/"+strings.Fields(c.new)[0], func(t *testing.T) {
			b := readFile(t, c.file)
			if _, err := decodeFile(c.file, b); err != nil {
				t.Fatalf("the file itself does not decode: %v", err)
			}
			_, err := decodeFile(c.file, mutate(t, b, c.old, c.new))
			if err == nil {
				t.Fatalf("replacing %q with %q decoded without error", c.old, c.new)
			}
			t.Logf("rejected as it should be: %v", err)
		})
	}
}

func TestKustomizationListsEveryManifest(t *testing.T) {
	t.Parallel()
	ms := loadManifests(t, "kubernetes")
	ks := objectsOf[kustomization](ms)
	if len(ks) != 1 {
		t.Fatalf("%d kustomizations, want 1", len(ks))
	}
	k := ks[0]
	var want []string
	for _, name := range yamlFiles(t, "kubernetes") {
		if base := path.Base(name); base != "kustomization.yaml" {
			want = append(want, base)
		}
	}
	got := slices.Clone(k.Resources)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("kustomization resources %v, want every manifest of the directory %v", got, want)
	}
	if k.Namespace != "leasehold" {
		t.Errorf("kustomization namespace %q, want leasehold", k.Namespace)
	}
	for _, c := range leaseholdContainers(ms) {
		name, _, _ := strings.Cut(c.container.Image, ":")
		if !slices.ContainsFunc(k.Images, func(i struct {
			Name    string `json:"name"`
			NewName string `json:"newName"`
			NewTag  string `json:"newTag"`
		}) bool {
			return i.Name == name
		}) {
			t.Errorf("%s: image %s is not set by the kustomization's images", c.where, c.container.Image)
		}
	}
}

// podOwner is a Deployment or Job with its pod template.
type podOwner struct {
	where    string
	kind     string
	name     string
	replicas int32
	selector *metav1.LabelSelector
	template corev1.PodTemplateSpec
}

func podOwners(ms []manifest) []podOwner {
	var out []podOwner
	for _, m := range ms {
		switch o := m.obj.(type) {
		case *appsv1.Deployment:
			r := int32(1)
			if o.Spec.Replicas != nil {
				r = *o.Spec.Replicas
			}
			out = append(out, podOwner{m.where, "Deployment", o.Name, r, o.Spec.Selector, o.Spec.Template})
		case *batchv1.Job:
			out = append(out, podOwner{m.where, "Job", o.Name, 1, o.Spec.Selector, o.Spec.Template})
		}
	}
	return out
}

type leaseholdContainer struct {
	where     string
	owner     podOwner
	container corev1.Container
}

// isLeaseholdImage reports whether image is the leasehold command's.
func isLeaseholdImage(image string) bool {
	name, _, _ := strings.Cut(image, ":")
	return name == "leasehold" || strings.HasSuffix(name, "/leasehold")
}

func leaseholdContainers(ms []manifest) []leaseholdContainer {
	var out []leaseholdContainer
	for _, o := range podOwners(ms) {
		for _, c := range append(slices.Clone(o.template.Spec.InitContainers), o.template.Spec.Containers...) {
			if isLeaseholdImage(c.Image) {
				out = append(out, leaseholdContainer{o.where + "/" + c.Name, o, c})
			}
		}
	}
	return out
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// problems collects what a check finds, so that tests can also show that a
// broken file is caught.
type problems []string

func (p *problems) addf(format string, args ...any) { *p = append(*p, fmt.Sprintf(format, args...)) }

// TestContainersFollowTheContract checks every leasehold container: its
// command line against the CLI contract, probes on the --http port, a grace
// period above the drain, credentials from Secrets, and a locked-down
// security context.
func TestContainersFollowTheContract(t *testing.T) {
	t.Parallel()
	commands := map[string]int{}
	for _, lc := range leaseholdContainers(loadManifests(t, "kubernetes")) {
		if inv, err := parseInvocation(lc.container.Args); err == nil {
			commands[inv.command]++
		}
		for _, p := range checkContainer(lc) {
			t.Errorf("%s: %s", lc.where, p)
		}
	}
	for _, cmd := range []string{"worker", "sink", "init"} {
		if commands[cmd] == 0 {
			t.Errorf("no container runs `leasehold %s`", cmd)
		}
	}
}

// TestContainerChecksCatchMistakes breaks the worker manifest in ways that
// still decode, and expects the contract checks to notice each one.
func TestContainerChecksCatchMistakes(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, old, new string }{
		{"grace below drain", "terminationGracePeriodSeconds: 40", "terminationGracePeriodSeconds: 25"},
		{"probe on another port", "containerPort: 8080", "containerPort: 9090"},
		{"liveness on /readyz", "path: /livez", "path: /readyz"},
		{"flag the command lacks", "--drain-timeout=25s", "--drain-timout=25s"},
		{"bad duration", "--ttl=10s", "--ttl=10"},
		{"worker id not the pod name", "--worker-id=$(POD_NAME)", "--worker-id=worker"},
		{"password as a literal", "            - name: NATS_PASSWORD\n              valueFrom:\n                secretKeyRef:\n                  name: leasehold-nats-worker\n                  key: password\n",
			"            - name: NATS_PASSWORD\n              value: hunter2\n"},
		{"variable nobody reads", "name: OTEL_SERVICE_NAME", "name: LEASEHOLD_SERVICE_NAME"},
		{"root file system writable", "readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false"},
		{"no memory limit", "              cpu: \"1\"\n              memory: 256Mi\n", "              cpu: \"1\"\n"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := mutate(t, readFile(t, "kubernetes/worker.yaml"), c.old, c.new)
			ms, err := decodeFile("worker.yaml", b)
			if err != nil {
				t.Fatalf("the mutated file must still decode: %v", err)
			}
			var found problems
			for _, lc := range leaseholdContainers(ms) {
				found = append(found, checkContainer(lc)...)
			}
			if len(found) == 0 {
				t.Fatal("not caught")
			}
			t.Logf("caught: %s", strings.Join(found, "; "))
		})
	}
}

func checkContainer(lc leaseholdContainer) problems {
	var p problems
	c, spec := lc.container, lc.owner.template.Spec
	if len(c.Command) != 0 {
		p.addf("command %v overrides the image's entrypoint (the leasehold binary); put the command in args", c.Command)
	}
	inv, err := parseInvocation(c.Args)
	if err != nil {
		p.addf("args %v: %v", c.Args, err)
		return p
	}
	env := map[string]corev1.EnvVar{}
	known := contractEnv()
	for _, e := range c.Env {
		env[e.Name] = e
		if !known[e.Name] && !libraryEnv[e.Name] {
			p.addf("env %s: the leasehold command does not read it (contract variables: NATS_*, LEASEHOLD_<FLAG>, DATABASE_URL)", e.Name)
		}
		if isSecret(e.Name) && (e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil) {
			p.addf("env %s must come from a Secret (valueFrom.secretKeyRef), not a literal", e.Name)
		}
	}
	for _, a := range c.Args {
		for _, m := range envRef.FindAllStringSubmatch(a, -1) {
			if _, ok := env[m[1]]; !ok {
				p.addf("arg %s refers to $(%s), which the container does not define", a, m[1])
			}
		}
	}
	if _, ok := env["NATS_URL"]; !ok {
		p.addf("NATS_URL is not set: the command would dial %s", connectionFlags["nats"].def)
	}
	if _, creds := env["NATS_CREDS"]; !creds {
		for _, name := range []string{"NATS_USER", "NATS_PASSWORD"} {
			if e, ok := env[name]; !ok || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
				p.addf("%s must come from a Secret", name)
			}
		}
	}
	checkResources(&p, c)
	checkSecurity(&p, spec, c)
	switch inv.command {
	case "worker", "sink":
		checkServing(&p, spec, c, inv)
	}
	if inv.command == "worker" {
		if got := inv.value("worker-id"); got != "$(POD_NAME)" {
			p.addf("--worker-id=%s, want $(POD_NAME): pod names are unique among live pods", got)
		}
		if e := env["POD_NAME"]; e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "metadata.name" {
			p.addf("POD_NAME must come from the downward API (fieldRef metadata.name)")
		}
	}
	return p
}

func isSecret(name string) bool {
	return strings.Contains(name, "PASSWORD") || name == "DATABASE_URL" || name == "NATS_NKEY"
}

func checkResources(p *problems, c corev1.Container) {
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := c.Resources.Requests[r]; !ok {
			p.addf("no %s request: the scheduler would place the pod blind", r)
		}
		if _, ok := c.Resources.Limits[r]; !ok {
			p.addf("no %s limit", r)
		}
	}
	if req, lim := c.Resources.Requests.Memory(), c.Resources.Limits.Memory(); !lim.IsZero() && req.Cmp(*lim) > 0 {
		p.addf("memory request %s is above the limit %s", req, lim)
	}
}

func checkSecurity(p *problems, spec corev1.PodSpec, c corev1.Container) {
	nonRoot := spec.SecurityContext != nil && spec.SecurityContext.RunAsNonRoot != nil && *spec.SecurityContext.RunAsNonRoot
	if sc := c.SecurityContext; sc != nil && sc.RunAsNonRoot != nil {
		nonRoot = *sc.RunAsNonRoot
	}
	if !nonRoot {
		p.addf("runAsNonRoot is not set")
	}
	if ps := spec.SecurityContext; ps != nil && ps.RunAsUser != nil && *ps.RunAsUser == 0 {
		p.addf("runAsUser is 0 (root)")
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		p.addf("the pod mounts a service account token it has no use for")
	}
	sc := c.SecurityContext
	if sc == nil {
		p.addf("no container securityContext")
		return
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		p.addf("readOnlyRootFilesystem is not true")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		p.addf("allowPrivilegeEscalation is not false")
	}
	if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
		p.addf("capabilities do not drop ALL")
	}
}

// checkServing checks what a long-running worker or sink needs: probes on
// its --http port and time to drain before it is killed.
func checkServing(p *problems, spec corev1.PodSpec, c corev1.Container, inv invocation) {
	port := inv.httpPort()
	if !slices.ContainsFunc(c.Ports, func(cp corev1.ContainerPort) bool { return int(cp.ContainerPort) == port }) {
		p.addf("--http is on port %d, which the container does not declare", port)
	}
	for _, pr := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"liveness", c.LivenessProbe, "/livez"}, {"readiness", c.ReadinessProbe, "/readyz"}} {
		if pr.probe == nil || pr.probe.HTTPGet == nil {
			p.addf("no HTTP %s probe", pr.name)
			continue
		}
		if pr.probe.HTTPGet.Path != pr.path {
			p.addf("%s probe on %s, want %s", pr.name, pr.probe.HTTPGet.Path, pr.path)
		}
		if got := resolvePort(c, pr.probe.HTTPGet.Port); got != port {
			p.addf("%s probe on port %d, and --http is on %d", pr.name, got, port)
		}
	}
	drain := inv.drainTimeout()
	if spec.TerminationGracePeriodSeconds == nil {
		p.addf("terminationGracePeriodSeconds is not set (default 30s) against a drain of %v", drain)
	} else if grace := *spec.TerminationGracePeriodSeconds; float64(grace) <= drain.Seconds() {
		p.addf("terminationGracePeriodSeconds %d is not above the drain timeout %v: the kubelet would kill the pod mid-drain", grace, drain)
	}
}

// resolvePort turns a probe's port (number or container port name) into a
// number, 0 when the name is unknown.
func resolvePort(c corev1.Container, p intstr.IntOrString) int {
	if p.Type == intstr.Int {
		return p.IntValue()
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return int(cp.ContainerPort)
		}
	}
	return 0
}

// TestSelectorsMatch checks that each Deployment's selector selects its own
// pods, and that every PodDisruptionBudget and Service selects the pods of
// exactly one workload.
func TestSelectorsMatch(t *testing.T) {
	t.Parallel()
	ms := loadManifests(t, "kubernetes")
	owners := podOwners(ms)
	matching := func(sel labels.Selector) []string {
		var names []string
		for _, o := range owners {
			if sel.Matches(labels.Set(o.template.Labels)) {
				names = append(names, o.kind+"/"+o.name)
			}
		}
		return names
	}
	for _, o := range owners {
		if o.kind != "Deployment" {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(o.selector)
		if err != nil || sel.Empty() {
			t.Errorf("%s: selector %v: %v", o.where, o.selector, err)
			continue
		}
		if !sel.Matches(labels.Set(o.template.Labels)) {
			t.Errorf("%s: selector %v does not select the pod template's labels %v", o.where, sel, o.template.Labels)
		}
	}
	for _, m := range ms {
		switch o := m.obj.(type) {
		case *policyv1.PodDisruptionBudget:
			sel, err := metav1.LabelSelectorAsSelector(o.Spec.Selector)
			if err != nil {
				t.Fatalf("%s: %v", m.where, err)
			}
			if got := matching(sel); len(got) != 1 || !strings.HasPrefix(got[0], "Deployment/") {
				t.Errorf("%s: PodDisruptionBudget %s selects %v, want exactly one Deployment", m.where, o.Name, got)
			}
		case *corev1.Service:
			got := matching(labels.SelectorFromSet(o.Spec.Selector))
			if len(got) != 1 {
				t.Errorf("%s: Service %s selects %v, want exactly one workload", m.where, o.Name, got)
				continue
			}
			for _, sp := range o.Spec.Ports {
				for _, ow := range owners {
					if ow.kind+"/"+ow.name != got[0] {
						continue
					}
					found := false
					for _, c := range ow.template.Spec.Containers {
						found = found || resolvePort(c, sp.TargetPort) != 0
					}
					if !found {
						t.Errorf("%s: Service port %s targets %s, which no container of %s declares", m.where, sp.Name, sp.TargetPort.String(), got[0])
					}
				}
			}
		}
	}
}

// partitionsOf is the --partitions of every leasehold container that has it.
func partitionsOf(t *testing.T, ms []manifest) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, lc := range leaseholdContainers(ms) {
		inv, err := parseInvocation(lc.container.Args)
		if err != nil {
			t.Fatalf("%s: %v", lc.where, err)
		}
		if _, ok := commandFlags[inv.command]["partitions"]; ok {
			out[lc.owner.kind+"/"+lc.owner.name] = inv.int("partitions")
		}
	}
	return out
}

func TestPartitionsAgree(t *testing.T) {
	t.Parallel()
	parts := partitionsOf(t, loadManifests(t, "kubernetes"))
	if len(parts) < 2 {
		t.Fatalf("partitions found in %v, want the workers and the init job", parts)
	}
	counts := map[int]bool{}
	for _, n := range parts {
		counts[n] = true
	}
	if len(counts) != 1 {
		t.Errorf("--partitions differ: %v; the workers must use the count `leasehold init` provisioned", parts)
	}
}
