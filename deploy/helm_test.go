package deploy

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/conf"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	kjson "sigs.k8s.io/json"
)

// helmValues is the part of the NATS chart's values (chart "nats" 1.x,
// nats-io/k8s helm/charts/nats/values.yaml) that helm/nats-values.yaml
// sets. Decoding is strict, so a key the chart does not have (such as the
// 0.x chart's "fileStorage") fails instead of being ignored by Helm.
type helmValues struct {
	Config struct {
		Cluster struct {
			Enabled  bool `json:"enabled"`
			Replicas int  `json:"replicas"`
		} `json:"cluster"`
		JetStream struct {
			Enabled   bool `json:"enabled"`
			FileStore struct {
				Enabled bool   `json:"enabled"`
				Dir     string `json:"dir"`
				PVC     struct {
					Enabled          bool    `json:"enabled"`
					Size             string  `json:"size"`
					StorageClassName *string `json:"storageClassName"`
				} `json:"pvc"`
				MaxSize string `json:"maxSize"`
			} `json:"fileStore"`
			MemoryStore struct {
				Enabled bool   `json:"enabled"`
				MaxSize string `json:"maxSize"`
			} `json:"memoryStore"`
			Merge map[string]any `json:"merge"`
		} `json:"jetstream"`
		Monitor struct {
			Enabled bool `json:"enabled"`
			Port    int  `json:"port"`
		} `json:"monitor"`
		Merge struct {
			Accounts map[string]natsAccount `json:"accounts"`
		} `json:"merge"`
	} `json:"config"`
	Container struct {
		Env   map[string]helmEnv `json:"env"`
		Merge struct {
			Resources corev1.ResourceRequirements `json:"resources"`
		} `json:"merge"`
	} `json:"container"`
	PodDisruptionBudget struct {
		Enabled bool `json:"enabled"`
	} `json:"podDisruptionBudget"`
}

// natsAccount is an account of the server configuration, as the Helm
// values and nats/nats-server.conf both write it.
type natsAccount struct {
	JetStream string     `json:"jetstream"`
	Users     []natsUser `json:"users"`
}

type natsUser struct {
	User        string           `json:"user"`
	Password    string           `json:"password"`
	Permissions *natsPermissions `json:"permissions,omitempty"`
}

type natsPermissions struct {
	Publish   *natsPermission `json:"publish,omitempty"`
	Subscribe *natsPermission `json:"subscribe,omitempty"`
}

type natsPermission struct {
	Allow []string `json:"allow,omitempty"`
	Deny  []string `json:"deny,omitempty"`
}

// helmEnv is an entry of the chart's container.env: a plain value, or an
// object such as {valueFrom: {secretKeyRef: ...}}.
type helmEnv struct {
	Value     string
	ValueFrom *corev1.EnvVarSource `json:"valueFrom"`
}

func (e *helmEnv) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		return json.Unmarshal(b, &e.Value)
	}
	var obj struct {
		ValueFrom *corev1.EnvVarSource `json:"valueFrom"`
	}
	if err := strictJSON(b, &obj); err != nil {
		return err
	}
	e.ValueFrom = obj.ValueFrom
	return nil
}

// strictJSON decodes JSON as unmarshalStrict decodes YAML.
func strictJSON(b []byte, v any) error {
	strict, err := kjson.UnmarshalStrict(b, v, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

func decodeHelmValues(b []byte) (helmValues, error) {
	var v helmValues
	err := unmarshalStrict(b, &v)
	return v, err
}

func loadHelmValues(t *testing.T) helmValues {
	t.Helper()
	v, err := decodeHelmValues(readFile(t, "helm/nats-values.yaml"))
	if err != nil {
		t.Fatalf("helm/nats-values.yaml: %v", err)
	}
	return v
}

func TestHelmValues(t *testing.T) {
	t.Parallel()
	v := loadHelmValues(t)
	c := v.Config
	if !c.Cluster.Enabled || c.Cluster.Replicas != 3 {
		t.Errorf("cluster enabled=%v replicas=%d, want a 3-node cluster", c.Cluster.Enabled, c.Cluster.Replicas)
	}
	js := c.JetStream
	if !js.Enabled || !js.FileStore.Enabled || !js.FileStore.PVC.Enabled || js.MemoryStore.Enabled {
		t.Errorf("jetstream enabled=%v fileStore=%v pvc=%v memoryStore=%v, want JetStream on file storage on a PVC only",
			js.Enabled, js.FileStore.Enabled, js.FileStore.PVC.Enabled, js.MemoryStore.Enabled)
	}
	size, err := resource.ParseQuantity(js.FileStore.PVC.Size)
	if err != nil {
		t.Fatalf("pvc size %q: %v", js.FileStore.PVC.Size, err)
	}
	if maxSize, err := resource.ParseQuantity(js.FileStore.MaxSize); err != nil || maxSize.Cmp(size) >= 0 {
		t.Errorf("fileStore.maxSize %q must be below the PVC size %s: the store needs room beyond what it counts", js.FileStore.MaxSize, &size)
	}
	if got := js.Merge["sync_interval"]; got != "always" {
		t.Errorf("jetstream sync_interval %v, want always: acknowledged writes must survive a power failure", got)
	}
	if !c.Monitor.Enabled {
		t.Error("monitoring is off; KEDA's nats-jetstream scaler reads /jsz")
	}
	if !v.PodDisruptionBudget.Enabled {
		t.Error("no PodDisruptionBudget for the NATS servers")
	}
	if _, ok := v.Container.Merge.Resources.Requests[corev1.ResourceMemory]; !ok {
		t.Error("no memory request for the NATS servers")
	}

	// Every password is a variable from a Secret.
	placeholder := regexp.MustCompile(`^<< \$([A-Z_][A-Z0-9_]*) >>$`)
	for name, acct := range c.Merge.Accounts {
		if acct.JetStream != "enabled" {
			t.Errorf("account %s: jetstream %q, want enabled", name, acct.JetStream)
		}
		for _, u := range acct.Users {
			m := placeholder.FindStringSubmatch(u.Password)
			if m == nil {
				t.Errorf("user %s: password %q: use << $VARIABLE >> from container.env, never a literal", u.User, u.Password)
				continue
			}
			e, ok := v.Container.Env[m[1]]
			if !ok || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
				t.Errorf("user %s: %s must be in container.env, from a Secret", u.User, m[1])
			}
		}
	}
}

func TestHelmValuesMisspeltKeyFails(t *testing.T) {
	t.Parallel()
	b := readFile(t, "helm/nats-values.yaml")
	for _, c := range []struct{ old, new string }{
		{"    fileStore:", "    fileStorage:"}, // the 0.x chart's key
		{"  monitor:", "  monitoring:"},
		{"podDisruptionBudget:", "podDisruptionBudgets:"},
	} {
		if _, err := decodeHelmValues(mutate(t, b, c.old, c.new)); err == nil {
			t.Errorf("%q decoded without error", c.new)
		} else {
			t.Logf("rejected as it should be: %v", err)
		}
	}
}

// passwordEnv are the variables nats/nats-server.conf and the Helm values
// read passwords from; tests set them to "pw-<NAME>".
var passwordEnv = []string{"ADMIN_PASSWORD", "PRODUCER_PASSWORD", "WORKER_PASSWORD", "SINK_PASSWORD"}

func setPasswords(t *testing.T) {
	for _, name := range passwordEnv {
		t.Setenv(name, "pw-"+name)
	}
}

// confAccounts parses nats/nats-server.conf with nats-server's own parser
// and returns its accounts.
func confAccounts(t *testing.T) map[string]natsAccount {
	t.Helper()
	setPasswords(t)
	m, err := conf.ParseFile("nats/nats-server.conf")
	if err != nil {
		t.Fatalf("nats/nats-server.conf: %v", err)
	}
	b, err := json.Marshal(m["accounts"])
	if err != nil {
		t.Fatal(err)
	}
	var accts map[string]natsAccount
	if err := strictJSON(b, &accts); err != nil {
		t.Fatalf("nats/nats-server.conf accounts: %v", err)
	}
	return accts
}

// TestHelmUsersMatchComposeConfig keeps the users and permissions of the
// Helm values and of nats/nats-server.conf the same.
func TestHelmUsersMatchComposeConfig(t *testing.T) {
	fromConf := confAccounts(t)
	fromHelm := loadHelmValues(t).Config.Merge.Accounts
	placeholder := regexp.MustCompile(`^<< \$([A-Z_][A-Z0-9_]*) >>$`)
	for name, acct := range fromHelm {
		for i, u := range acct.Users {
			if m := placeholder.FindStringSubmatch(u.Password); m != nil {
				acct.Users[i].Password = "pw-" + m[1]
			}
		}
		fromHelm[name] = acct
	}
	if got, want := sortedKeys(fromHelm), sortedKeys(fromConf); !slices.Equal(got, want) {
		t.Fatalf("accounts: helm %v, nats-server.conf %v", got, want)
	}
	for name := range fromConf {
		h, c := describeUsers(fromHelm[name].Users), describeUsers(fromConf[name].Users)
		if h != c {
			t.Errorf("account %s differs.\nhelm/nats-values.yaml:\n%s\nnats/nats-server.conf:\n%s", name, h, c)
		}
	}
	users := map[string]bool{}
	for _, u := range fromConf["LEASEHOLD"].Users {
		users[u.User] = true
	}
	for _, want := range []string{"admin", "producer", "worker", "sink"} {
		if !users[want] {
			t.Errorf("no %s user", want)
		}
	}
}

func describeUsers(us []natsUser) string {
	var b strings.Builder
	for _, u := range us {
		p, _ := json.MarshalIndent(u.Permissions, "  ", "  ")
		fmt.Fprintf(&b, "%s (password %s): %s\n", u.User, u.Password, p)
	}
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}
